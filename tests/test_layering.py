"""The package's floors, asserted on the imports of every module (function-local imports included).

core values -> ops -> rewriter -> runtime -> API/Keras: a module imports only from its own floor or the floors
below, and no set of modules imports each other in a loop. A new module must be given a floor here.
"""

import ast
import re
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Source directory -> the package it is installed as (setup.py package_dir).
PACKAGES = {"tf_gspmd": "tf_gspmd", "ops": "tf_gspmd.ops", "rewriter": "tf_gspmd.rewriter"}

FLOORS = (   # lowest first; a module belongs to the floor of its longest matching prefix
    # the values users write (meshes, shardings, annotations, plan scopes) and the platform (TF adapter, processes)
    ("core", ("tf_gspmd.errors", "tf_gspmd.initializers", "tf_gspmd._layout", "tf_gspmd._platform")),
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
    # the public API: functions, the parallelism entry points (pipelines, MPMD, stages, auto_parallel), Keras
    ("api", ("tf_gspmd", "tf_gspmd._function", "tf_gspmd._parallel", "tf_gspmd._keras", "tf_gspmd._visualize",
             "tf_gspmd._explore",
             "tf_gspmd.keras", "tf_gspmd.tpu")),
)

# Private TensorFlow/Keras modules -- every module of the two packages but their public entry points (`tensorflow`,
# `keras` and Keras's public subpackages): only the adapter may import them (or a module listed with its reason).
PRIVATE_PREFIXES = ("tensorflow.", "keras.src", "tf_keras.")
PUBLIC_MODULES = ("tensorflow.compat.v1", "tensorflow.compat.v2")
PRIVATE_ALLOWED = {"tf_gspmd._platform.compat"}


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
  assert not wrong, "private TF/Keras modules imported outside tf_gspmd/_platform/compat.py:\n" + "\n".join(wrong)


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


COLLECTIVES_PACKAGE = "tf_gspmd.rewriter.collectives"


def _docstrings(tree):
  """The ids of the docstring constants of a module, its classes and functions."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body and \
        isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
      out.add(id(node.body[0].value))
  return out


def _names_in_code(path, names):
  """(line, name) of each of `names` that module `path` spells in its code: a string (docstrings and comments
  aside), an identifier or an attribute (`tf.raw_ops.<name>`)."""
  tree = ast.parse(path.read_text(), str(path))
  docstrings, found = _docstrings(tree), []
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
      words = set(re.findall(r"\w+", node.value))
    elif isinstance(node, ast.Attribute):
      words = {node.attr}
    elif isinstance(node, ast.Name):
      words = {node.id}
    else:
      continue
    found += [(node.lineno, w) for w in sorted(words & names)]
  return found


def test_collective_op_names_only_in_the_collectives_package():
  """A TF collective op is named (built, matched, decoded) in rewriter/collectives/ only; every other module asks
  its vocabulary (kinds, builders) -- one place to add a collective."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  ops = {n for n in dir(tf.raw_ops) if n.startswith(("Collective", "Nccl"))}
  assert {"CollectiveReduceV2", "CollectiveGatherV2", "CollectiveBcastRecvV2", "NcclAllReduce"} <= ops
  wrong = [f"{MODULES[m].relative_to(ROOT)}:{line} {name}" for m in sorted(MODULES)
           if not (m == COLLECTIVES_PACKAGE or m.startswith(COLLECTIVES_PACKAGE + "."))
           for line, name in _names_in_code(MODULES[m], ops)]
  assert not wrong, "collective op names outside rewriter/collectives/:\n" + "\n".join(wrong)


def test_the_name_finder_sees_code_and_skips_docstrings(tmp_path):
  path = tmp_path / "probe.py"
  path.write_text('"""CollectiveGatherV2 in a docstring."""\nimport tensorflow as tf\n'
                  'A = ("CollectiveReduceV2",)  # CollectiveBcastSendV2 in a comment\n'
                  'def f(x):\n  return tf.raw_ops.CollectiveGatherV2(input=x)\n')
  assert _names_in_code(path, {"CollectiveReduceV2", "CollectiveGatherV2", "CollectiveBcastSendV2"}) == [
      (3, "CollectiveReduceV2"), (5, "CollectiveGatherV2")]


MAX_FUNCTION_LINES = 80


def test_no_library_function_over_80_lines():
  """Every function and method of the library reads in one screen: one that grows past MAX_FUNCTION_LINES (its
  docstring included) is split into the steps it takes."""
  long = []
  for name in sorted(MODULES):
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = node.end_lineno - node.lineno + 1
        if n > MAX_FUNCTION_LINES:
          long.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
  assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_no_session_in_the_rewriter():
  """The rewriter lowers without running anything: no tf.compat.v1.Session executes inside a pass."""
  wrong = [f"{MODULES[m].relative_to(ROOT)}:{line}" for m in sorted(MODULES) if m.startswith("tf_gspmd.rewriter")
           for line, _ in _names_in_code(MODULES[m], {"Session", "InteractiveSession"})]
  assert not wrong, "Sessions in the rewriter:\n" + "\n".join(wrong)
