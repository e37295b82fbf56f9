"""The package's floors, asserted on the imports of every module (function-local imports included).

core values -> ops -> rewriter -> runtime -> API/Keras: a module imports only from its own floor or the floors
below, and no set of modules imports each other in a loop. A new module must be given a floor here.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Source directory -> the package it is installed as (setup.py package_dir).
PACKAGES = {"tf_gspmd": "tf_gspmd", "ops": "tf_gspmd.ops", "rewriter": "tf_gspmd.rewriter"}

FLOORS = (   # lowest first; a module belongs to the floor of its longest matching prefix
    ("core", ("tf_gspmd.errors", "tf_gspmd._cluster", "tf_gspmd._mesh", "tf_gspmd._sharding", "tf_gspmd._annotations",
              "tf_gspmd.initializers", "tf_gspmd._compat", "tf_gspmd._plan_scope")),
    ("ops", ("tf_gspmd.ops",)),
    # the rewriter, by phase: GraphDef reading and editing; the records of a lowering; tracing and annotations;
    # the collectives; sharding completion and automatic sharding; inter-operator stages; partitioning; the
    # one-graph form; the per-device back end; the pass list
    ("rewriter.graph", ("tf_gspmd.rewriter", "tf_gspmd.rewriter.graph")),
    ("rewriter.records", ("tf_gspmd.rewriter.program", "tf_gspmd.rewriter.report")),
    ("rewriter.frontend", ("tf_gspmd.rewriter.frontend",)),
    ("rewriter.collectives", ("tf_gspmd.rewriter.collectives",)),
    ("rewriter.sharding", ("tf_gspmd.rewriter.sharding",)),
    ("rewriter.stages", ("tf_gspmd.rewriter.stages",)),
    ("rewriter.partition", ("tf_gspmd.rewriter.partition",)),
    ("rewriter.one_graph", ("tf_gspmd.rewriter.one_graph",)),
    ("rewriter.backend", ("tf_gspmd.rewriter.backend",)),
    ("rewriter.pipeline", ("tf_gspmd.rewriter.pipeline",)),
    ("runtime", ("tf_gspmd.runtime",)),
    ("api", ("tf_gspmd", "tf_gspmd._function", "tf_gspmd._pipeline", "tf_gspmd._mpmd", "tf_gspmd._visualize", "tf_gspmd.keras",
             "tf_gspmd.tpu")),
)

# Private TensorFlow/Keras modules -- every module of the two packages but their public entry points (`tensorflow`,
# `keras` and Keras's public subpackages): only the adapter may import them (or a module listed with its reason).
PRIVATE_PREFIXES = ("tensorflow.", "keras.src", "tf_keras.")
PUBLIC_MODULES = ("tensorflow.compat.v1", "tensorflow.compat.v2")
PRIVATE_ALLOWED = {"tf_gspmd._compat"}


def _modules():
  out = {}
  for directory, package in PACKAGES.items():
    base = ROOT / directory
    for path in sorted(base.rglob("*.py")):
      parts = list(path.relative_to(base).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join([package] + parts)] = path
  return out


MODULES = _modules()


def _is_package(name):
  return MODULES[name].name == "__init__.py"


def _imports(name):
  """(imported tf_gspmd modules, imported private TF/Keras modules) of module `name`, with line numbers."""
  tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
  ours, private = [], []
  package = name if _is_package(name) else name.rpartition(".")[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")
        anchor = anchor[:len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    else:
      continue
    full = [a.name for a in node.names] if isinstance(node, ast.Import) else [f"{base}.{a.name}" for a in node.names]
    private += [(t, node.lineno) for t in full if _private(t)]
    for t in targets:
      while t and t not in MODULES and t.startswith("tf_gspmd"):
        t = t.rpartition(".")[0]
      if t in MODULES and t != name:
        ours.append((t, node.lineno))
  return ours, private


def _private(module):
  """Whether `module` (an imported dotted name) is a non-public TensorFlow or Keras module."""
  if any(module == p or module.startswith(p + ".") for p in PUBLIC_MODULES):
    return False
  return module.startswith(PRIVATE_PREFIXES)


def floor_of(name):
  best = None
  for level, (floor, prefixes) in enumerate(FLOORS):
    for p in prefixes:
      if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[2]):
        best = (level, floor, len(p))
  return best


def test_every_module_has_a_floor():
  assert {"tf_gspmd", "tf_gspmd.ops.registry", "tf_gspmd.rewriter.sharding.completion", "tf_gspmd.runtime.executable",
          "tf_gspmd.keras"} <= set(MODULES)   # the sources were found (pip checkout or Bazel runfiles)
  unplaced = [m for m in MODULES if floor_of(m) is None]
  assert not unplaced, f"give these modules a floor in tests/test_layering.py: {unplaced}"


def test_no_upward_imports():
  wrong = []
  for name in MODULES:
    level, floor, _ = floor_of(name)
    for target, line in _imports(name)[0]:
      t_level, t_floor, _ = floor_of(target)
      if t_level > level:
        wrong.append(f"{MODULES[name].relative_to(ROOT)}:{line} ({floor}) imports {target} ({t_floor})")
  assert not wrong, "imports that go up a floor:\n" + "\n".join(wrong)


MAX_LINES = 600


def test_no_module_over_600_lines():
  """Every Python file of the project -- package, tests, examples, benchmarks, tools -- stays readable in one
  sitting: a module that grows past MAX_LINES is split along the jobs it does."""
  long = []
  for directory in ("tf_gspmd", "ops", "rewriter", "tests", "examples", "bench", "tools"):
    for path in sorted((ROOT / directory).rglob("*.py")):
      n = len(path.read_text().splitlines())
      if n > MAX_LINES:
        long.append(f"{path.relative_to(ROOT)}: {n} lines")
  assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


def _cycles(graph):
  """Strongly connected components with more than one module (Tarjan), each sorted."""
  index, low, stack, on, out = {}, {}, [], set(), []
  counter = [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycles():
  graph = {name: sorted({t for t, _ in _imports(name)[0]}) for name in MODULES}
  assert not _cycles(graph), f"modules that import each other in a loop: {_cycles(graph)}"


def test_cycle_finder_finds_a_planted_loop():
  assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
  assert not _cycles({"a": ["b"], "b": [], "c": ["a"]})


def test_private_tensorflow_and_keras_apis_only_through_the_adapter():
  wrong = []
  for name in MODULES:
    if name in PRIVATE_ALLOWED:
      continue
    for target, line in _imports(name)[1]:
      wrong.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}")
  assert not wrong, "private TF/Keras modules imported outside tf_gspmd/_compat.py:\n" + "\n".join(wrong)


@pytest.mark.parametrize("module,private", [
    ("tensorflow", False), ("tensorflow.compat.v1", False), ("keras", False), ("keras.distribution", False),
    ("tensorflow.python.eager.context", True), ("tensorflow.compiler.xla.xla_data_pb2", True),
    ("tensorflow.core.framework.graph_pb2", True), ("keras.src.backend", True),
])
def test_every_non_public_tensorflow_module_counts_as_private(module, private):
  assert _private(module) == private


@pytest.mark.parametrize("source,expected", [
    ("from tf_gspmd.rewriter.sharding import completion", ["tf_gspmd.rewriter.sharding.completion"]),
    ("from tf_gspmd import ops as op_rules", ["tf_gspmd.ops"]),
    ("import tf_gspmd as gs", ["tf_gspmd"]),
    ("def f():\n  from tf_gspmd.rewriter.graph.graph_view import ref", ["tf_gspmd.rewriter.graph.graph_view"]),
])
def test_import_reader_sees_every_form(tmp_path, monkeypatch, source, expected):
  path = tmp_path / "probe.py"
  path.write_text(source)
  monkeypatch.setitem(MODULES, "tf_gspmd.ops.probe", path)
  assert [t for t, _ in _imports("tf_gspmd.ops.probe")[0]] == expected
