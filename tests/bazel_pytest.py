"""Runs pytest on one test file for a Bazel py_test (see the root BUILD file).

Usage (as Bazel does it): bazel_pytest.py tests/layout/test_mesh.py [more pytest args]

Makes sure the tests exercise the Bazel-built tf_gspmd from the runfiles tree, not the editable pip install
in the virtualenv, and keeps pytest and Hypothesis from writing into the runfiles tree.
"""

import importlib.util
import os
import sys


def _runfiles_root():
  for var in ("TEST_SRCDIR", "RUNFILES_DIR", "PYTHON_RUNFILES"):
    if os.environ.get(var):
      return os.path.abspath(os.environ[var])
  return None


def _drop_editable_install():
  """Removes the import hooks of `pip install -e` (setuptools' __editable__*_finder modules)."""
  def editable(hook):
    return (getattr(hook, "__module__", None) or "").startswith("__editable__")

  sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
  sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
  sys.path[:] = [p for p in sys.path if not p.startswith("__editable__")]
  sys.path_importer_cache.clear()


def _outside(path, root):
  return root is not None and not os.path.abspath(path).startswith(root + os.sep)


def main(argv):
  if len(argv) < 2:
    sys.exit("usage: bazel_pytest.py TEST_FILE [PYTEST_ARGS...]")
  root = _runfiles_root()
  _drop_editable_install()
  # Python resolves the symlink of the main script, so sys.path[0] is the source checkout's tests/ directory;
  # use the runfiles copy instead.
  sys.path[0] = os.path.dirname(os.path.abspath(__file__))
  sys.dont_write_bytecode = True  # no __pycache__ (or pytest's rewritten .pyc) in the runfiles tree
  tmp = os.environ.get("TEST_TMPDIR")
  if tmp:
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tmp, ".hypothesis"))

  spec = importlib.util.find_spec("tf_gspmd")
  if spec is None or _outside(spec.origin, root):
    sys.exit("bazel_pytest: tf_gspmd does not resolve to the Bazel runfiles tree %s: %s"
             % (root, spec and spec.origin))
  print("bazel_pytest: tf_gspmd from %s" % spec.origin, flush=True)

  import pytest  # pylint: disable=g-import-not-at-top
  # Bazel runs tests in the workspace's runfiles directory, which has no setup.py or ini file. Pin pytest's
  # rootdir to it: without a config file the default rootdir has differed between pytest versions, and
  # --confcutdir defaults to the rootdir, so a rootdir of tests/op_rules/ would skip tests/conftest.py.
  code = pytest.main([argv[1], "-q", "-p", "no:cacheprovider", "--rootdir", os.getcwd()] + argv[2:])

  # Every tf_gspmd module the tests loaded must come from the runfiles tree.
  strays = sorted("%s (%s)" % (name, getattr(mod, "__file__", None))
                  for name, mod in list(sys.modules.items())
                  if (name == "tf_gspmd" or name.startswith("tf_gspmd."))
                  and getattr(mod, "__file__", None) and _outside(mod.__file__, root))
  loaded = sorted(name for name in sys.modules if name == "tf_gspmd" or name.startswith("tf_gspmd."))
  print("bazel_pytest: %d tf_gspmd modules loaded" % len(loaded), flush=True)
  if strays:
    print("bazel_pytest: modules loaded from outside the runfiles tree %s:\n  %s" % (root, "\n  ".join(strays)),
          flush=True)
    return 1
  return int(code)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
