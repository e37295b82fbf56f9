"""`gs.function`: the decorator that partitions a TF function over a mesh and runs it SPMD."""

import dataclasses
import functools
import numbers
import re
import threading

import tensorflow as tf
from absl import logging

from tf_gspmd._platform import cluster as _cluster
from tf_gspmd._platform import compat as _compat
from tf_gspmd._layout.mesh import Mesh, P
from tf_gspmd._layout.sharding import Sharding, per_value, to_annotation
from tf_gspmd import _explore
from tf_gspmd._visualize import visualize_sharding
from tf_gspmd.errors import InputError, MeshError, ShapeError
from tf_gspmd.rewriter.sharding import auto as auto_pass
from tf_gspmd.rewriter import pipeline
from tf_gspmd.rewriter.program import Options, Program
from tf_gspmd.rewriter.backend import xla_export
from tf_gspmd.rewriter.graph.graph_view import public_key
from tf_gspmd.runtime import state as _state
from tf_gspmd.runtime import tpu as _tpu
from tf_gspmd.runtime.executable import Executable
from tf_gspmd.runtime.sharded_tensor import ShardedTensor

PARTITIONERS = ("tf_gspmd", xla_export.XLA)
# The partitioner a gs.function uses when none is named, by the kind of its mesh's devices (None: not known, a
# plan without the devices). tf_gspmd's own partitioner everywhere for now; XLA's is asked for with
# partitioner="xla".
DEFAULT_PARTITIONER = {"CPU": "tf_gspmd", "GPU": "tf_gspmd", "TPU": "xla", None: "tf_gspmd"}


def default_partitioner(devices):
  """The partitioner for a mesh of `devices` (TF device names, or None when they are not known)."""
  kinds = {tf.DeviceSpec.from_string(d).device_type.upper() for d in devices} if devices else {None}
  kind = kinds.pop() if len(kinds) == 1 else None
  return DEFAULT_PARTITIONER.get(kind, DEFAULT_PARTITIONER[None])


class Lowered:
  """The result of lowering a gs.function for given argument specs (no devices needed).

  Attributes:
    shardings: {tensor name: Sharding} for every tensor of the global graph ("h", "h:1", ...).
    report: the partition report (`counts()`, `bytes_per_device()`, `collectives`).
    graph_def: the per-device program; global_graph_def: the global graph after folding.
    in_shardings / out_shardings: the layouts the arguments arrive in and the results leave in.
    exported, xla_function, xla_hlo(): with partitioner="xla", the program handed to XLA.
  """

  def __init__(self, program):
    self.program = program
    self._executable = None
    self._report = None
    self._view = None

  @property
  def shardings(self):
    return {public_key(r): s for r, s in self.program.shardings.items()}

  @property
  def report(self):
    """The partition report; with partitioner="xla", tf_gspmd's own plan of the exported program (XLA partitions
    the program that runs), worked out when first asked."""
    if self._report is None:
      report = self.program.report if self.program.exported is None else pipeline.plan_of_export(self.program)
      self._report = report.with_page(lambda path: _explore.save_html(self, path))
    return self._report

  def view(self):
    """The plan's `PlanView` (what `report.save_html` and `explore` draw), made on first use."""
    if self._view is None:
      if self.program.exported is not None:
        raise InputError("with partitioner=\"xla\" XLA partitions the program: its pictures are XLA's (xla_hlo()); "
                         "lower with tf_gspmd's partitioner to draw tf_gspmd's plan")
      self._view = _explore.PlanView.of(self)
    return self._view

  def explore(self, **options):
    """Opens Model Explorer on this plan (`gs.explore`; options: host, port, open_browser, block)."""
    return _explore.explore(self, **options)

  @property
  def graph_def(self):
    return self.program.local_graph_def

  @property
  def global_graph_def(self):
    return self.program.graph_def

  @property
  def auto_plan(self):
    """What automatic sharding chose (`rewriter.sharding.auto.AutoPlan`), or None when nothing was "auto"."""
    return self.program.auto_plan

  @property
  def in_shardings(self):
    return self.program.param_shardings

  @property
  def out_shardings(self):
    return self.program.output_shardings

  @property
  def partitioner(self):
    return self.program.options.partitioner

  @property
  def exported(self):
    """With partitioner="xla": the global program with every layout as XLA sharding (`xla_export.Exported`)."""
    if self.program.exported is None:
      raise InputError("this lowering is tf_gspmd's partition; lower a gs.function(..., partitioner=\"xla\") for "
                       "the program handed to XLA")
    return self.program.exported

  @property
  def xla_function(self):
    """With partitioner="xla": the exported program's ConcreteFunction (jit-compiled)."""
    return self.exported.concrete_function()

  def xla_hlo(self, stage="hlo"):
    """With partitioner="xla": the exported program as HLO text (or `stage` of experimental_get_compiler_ir)."""
    return self.exported.hlo(stage)

  def explain(self):
    """A table: node, op, global shape, sharding, and why completion chose it."""
    ir = self.program.ir
    rows = [("tensor", "op", "shape", "sharding", "why")]
    for node in ir.nodes:
      for o, info in enumerate(node.outputs):
        r = node.ref(o)
        rows.append((public_key(r), node.op, str(list(info.shape)), str(self.program.shardings[r]),
                     self.program.explanations.get(r, "")))
    widths = [max(len(row[k]) for row in rows) for k in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows)

  def visualize(self, name, show=True):
    """Draw how tensor `name` (a key of `shardings`) is laid out over the mesh; returns the drawing."""
    r = name if isinstance(name, str) and ":" in name else f"{name}:0"
    if r not in self.program.shardings:
      known = sorted(public_key(k) for k in self.program.shardings)
      raise InputError(f"no tensor {name!r} in this lowering; give a key of .shardings, e.g. "
                       f"{', '.join(map(repr, known[:5]))}", node=str(name))
    return visualize_sharding(self.program.shardings[r], self.program.ir.info(r).shape, show=show)

  def as_text(self):
    """The per-device program, one line per node: name = Op(inputs)."""
    lines = []
    for n in self.graph_def.node:
      lines.append(f"{n.name} = {n.op}({', '.join(n.input)})")
    return "\n".join(lines)

  def executable(self):
    if self._executable is None:
      if self.program.exported is not None:
        raise InputError("with partitioner=\"xla\" XLA partitions and runs this program: call the gs.function, or "
                         "use lowered.xla_function")
      if self.program.device_program is None:
        raise MeshError("this lowering has no devices to run on (a plan): lower the function for a mesh whose "
                        "devices exist, or call it")
      self._executable = Executable(self.program.device_program)
    return self._executable


class ShardedFunction:
  """A TF function partitioned over a mesh. Create with `gs.function`."""

  def __init__(self, fn, mesh, in_shardings, out_shardings, strict, collective_timeout, weight_update_sharding=None,
               jit_compile="auto", memory_budget=None, axis_cost=None, flops_per_byte=1000.0, exchange="auto",
               partitioner=None, solver_time_limit=None, auto_pins="all"):
    if not isinstance(mesh, Mesh):
      raise MeshError(f"gs.function needs mesh=gs.Mesh(...); got {mesh!r}")
    if not callable(fn):
      raise InputError(f"gs.function partitions a function; got {type(fn).__name__} {fn!r:.80}: decorate a Python "
                       "function or tf.function, or pass it as gs.function(fn, mesh=...)", node="fn")
    _check_shardings_argument(in_shardings, "in_shardings")
    _check_shardings_argument(out_shardings, "out_shardings")
    collective_timeout = _checked_timeout(collective_timeout)
    memory_budget = parse_bytes(memory_budget, "memory_budget")
    self.fn = fn
    self.mesh = mesh
    self._in = in_shardings
    self._out = out_shardings
    if jit_compile not in ("auto", True, False, "segments"):
      raise InputError(f"jit_compile must be 'auto', True, False or 'segments'; got {jit_compile!r}")
    if exchange not in ("auto", "collectives"):
      raise InputError(f"exchange must be 'auto' or 'collectives'; got {exchange!r}")
    if partitioner is not None and partitioner not in PARTITIONERS:
      raise InputError(f"partitioner must be None (the default for the mesh's devices) or one of {PARTITIONERS}; "
                       f"got {partitioner!r}")
    self.partitioner = partitioner
    if weight_update_sharding not in (None, False, True) and weight_update_sharding not in mesh.axis_names:
      raise MeshError(f"weight_update_sharding={weight_update_sharding!r} is not an axis of {mesh}; give True (the "
                      f"'data' axis) or one of {mesh.axis_names}")
    self.options = Options(strict=strict, collective_timeout=collective_timeout,
                                    weight_update_sharding=weight_update_sharding, jit_compile=jit_compile,
                                    exchange=exchange)
    self._auto = _auto_options(mesh, in_shardings, memory_budget, axis_cost, flops_per_byte, solver_time_limit,
                               auto_pins)
    self._cache = {}
    self.lowerings = 0   # times the pipeline lowered this function (a retrace counts; a cached lowering does not)
    self._last = None      # (per argument (shape, sharding, dtype) objects, Lowered) of the last call
    self._lock = threading.Lock()
    functools.update_wrapper(self, fn)

  def _raw_in(self, n):
    return per_value(self._in, n, "in_shardings", "the function was called with {n} arguments")

  def _declared_in(self, specs):
    raw = self._raw_in(len(specs))
    return tuple((None, ()) if _is_auto(s) else to_annotation(s, self.mesh, rank=spec.shape.rank,
                                                              what=f"argument {k}")
                 for k, (s, spec) in enumerate(zip(raw, specs)))

  def _options(self, n, devices):
    options = dataclasses.replace(self.options, partitioner=self.partitioner or default_partitioner(devices))
    if self._auto is None:
      return options
    auto = dataclasses.replace(self._auto, arguments=tuple(_is_auto(s) for s in self._raw_in(n)))
    return dataclasses.replace(options, auto=auto)

  def lower(self, *specs, arg_shardings=None, processes=None):
    """Completes and partitions the function for `specs` (TensorSpecs); needs no devices.

    A ShardedTensor among `specs` arrives in its layout, as in a call (so a call with it runs this lowering),
    unless `arg_shardings` gives the arriving layouts. `processes`: plan for the mesh's devices spread over this many processes (hosts), an equal number each,
    processes major (as `gs.initialize` orders them); the report then tells which collectives cross processes
    and how many bytes per device do. Default: the processes that drive the mesh's devices now.
    """
    for k, s in enumerate(specs):
      self._check_mesh_of(s, k)
    arriving = tuple(arg_shardings) if arg_shardings else tuple(_arriving(s) for s in specs)
    specs = tuple(_as_spec(s, k) for k, s in enumerate(specs))
    try:
      devices = self.mesh.resolve_devices()
    except MeshError:
      devices = None
    plan = None
    if processes is not None:
      if isinstance(processes, bool) or not isinstance(processes, numbers.Integral) or processes < 1 or \
          self.mesh.size % processes:
        raise MeshError(f"processes={processes!r} must divide the mesh's {self.mesh.size} devices evenly: give the "
                        "number of processes (hosts) they are spread over, a whole number of 1 or more",
                        node="processes")
      n = int(processes)
      plan = tuple(p // (self.mesh.size // n) for p in range(self.mesh.size))
    return self._lower(specs, arriving, devices, plan)

  def _lower(self, specs, arriving, devices, processes=None):
    # The processes driving the devices now; a lowering for others (`processes` given) is a plan for them.
    driving = tuple(_cluster.process_of(d) for d in devices) if devices is not None and \
        _cluster.is_multi_process() else None
    processes = driving if processes is None else processes
    key = (specs, arriving, devices, processes)
    with self._lock:
      cached = self._cache.get(key)
    if cached is not None:
      if self._still_valid(cached):
        return cached
      logging.info("tf_gspmd: retracing %s: a captured variable is now stored in another layout",
                   getattr(self.fn, "__name__", self.fn))
    else:
      same = self._same_program(key)
      if same is not None:
        return same
      with self._lock:
        previous = [k for k in self._cache if k[2:] == (devices, processes)]
      if previous:
        logging.info("tf_gspmd: retracing %s: %s", getattr(self.fn, "__name__", self.fn),
                     _retrace_reason(previous[-1], key))
    declared_in = self._declared_in(specs)
    here = driving is not None and processes == driving
    program = Program(fn=self.fn, mesh=self.mesh, options=self._options(len(specs), devices), arg_specs=specs,
                      declared_in=tuple(s for s, _ in declared_in), open_in=tuple(o for _, o in declared_in),
                      arriving_in=arriving, devices=devices, processes=processes,
                      process=_cluster.process_index() if here else None,
                      variable_layout=functools.partial(_state.layout_of, mesh=self.mesh))
    program = pipeline.run(program.replace(declared_out=tuple(self._out) if isinstance(self._out, list) else self._out))
    lowered = Lowered(program)
    with self._lock:
      self._cache[key] = lowered
      self.lowerings += 1
    return lowered

  def _same_program(self, key):
    """A cached lowering that runs a call of signature `key` as it is, or None; found, it is cached under `key` too.

    The arriving layouts differ between the calls of a training loop: its first step gets host values, later
    ones the ShardedTensors earlier steps returned. A lowering for the same argument specs, devices and
    processes takes such a call when every argument arrives as it did for that lowering or already in the layout
    the program takes (used in place): lowering again would build the same program. (A host value where that
    lowering got a ShardedTensor is lowered for: it may be scattered in a layout that needs no resharding.)"""
    specs, arriving = key[:2]
    with self._lock:
      candidates = [(k, v) for k, v in self._cache.items() if k[0] == specs and k[2:] == key[2:]]
    for k, lowered in candidates:
      taken = lowered.program.param_shardings
      if len(taken) == len(arriving) and all(a == was or a == t for a, was, t in zip(arriving, k[1], taken)):
        if self._still_valid(lowered):
          with self._lock:
            self._cache[key] = lowered
          return lowered
    return None

  def _still_valid(self, lowered):
    """Whether a cached lowering still holds: every captured variable is stored as it was when lowered, or in
    the layout the program gives it."""
    program = lowered.program
    if not program.variables:
      return True
    now = tuple(_state.layout_of(v, self.mesh) if v is not None else None for v in program.variables)
    return now == program.variable_pins or all(n is None or n == s for n, s in zip(now, program.variable_shardings))

  def __call__(self, *args):
    # A training loop calls again with the results of the last call (or the same arguments): the same shape,
    # layout and dtype objects, so the lowering found last time is found without building its key.
    last = self._last
    if last is not None and len(args) == len(last[0]) and all(
        type(a) is ShardedTensor and a.shape is s and a.sharding is h and a.dtype is d  # pylint: disable=unidiomatic-typecheck
        for a, (s, h, d) in zip(args, last[0])) and self._still_valid(last[1]):
      return self._run(last[1], args)
    specs, arriving = [], []
    for k, a in enumerate(args):
      if isinstance(a, ShardedTensor):
        self._check_mesh_of(a, k)
        specs.append(tf.TensorSpec(a.shape, a.dtype))
        arriving.append(_arriving(a))
      else:
        t = _dense_argument(a, k)
        specs.append(tf.TensorSpec(t.shape, t.dtype))
        arriving.append(None)
    # A TPU mesh runs through its TPUStrategy (tf_gspmd.tpu), which places the program on the cores itself.
    devices = self.mesh.resolve_devices() if _tpu.is_tpu_mesh(self.mesh) else _cluster.runnable_devices(self.mesh)
    lowered = self._lower(tuple(specs), tuple(arriving), devices)
    if all(type(a) is ShardedTensor for a in args):  # pylint: disable=unidiomatic-typecheck
      self._last = (tuple((a.shape, a.sharding, a.dtype) for a in args), lowered)
    return self._run(lowered, args)

  def _check_mesh_of(self, a, k):
    """InputError when argument `k` is a ShardedTensor laid out over another mesh than this function's: its
    components live on that mesh's devices, in that mesh's tiles; it moves only through an explicit transfer."""
    if isinstance(a, ShardedTensor) and a.sharding.mesh != self.mesh:
      spec = a.sharding.spec if a.sharding.spec is not None else P()
      raise InputError(f"argument {k} is a ShardedTensor laid out over {a.sharding.mesh} "
                       f"(devices {a.sharding.mesh.devices or 'by default'}), but this function runs on {self.mesh} "
                       f"(devices {self.mesh.devices or 'by default'}); move it onto this mesh first with "
                       f"gs.reshard(x, mesh, {spec!r}) (the layout it takes there), or pass a "
                       "host value (x.numpy())", node=f"argument {k}")

  def _run(self, lowered, args):
    if lowered.program.exported is not None:
      flat = _run_exported(lowered.program, args)
    else:
      flat = lowered.executable()(args)
    # The traced structure holds each result's index in `flat` (None for a result that was None).
    return tf.nest.map_structure(lambda k: None if k is None else flat[k], lowered.program.output_structure)


def _run_exported(program, args):
  """partitioner="xla": on a TPU mesh, the exported program run by TPUStrategy with XLA's SPMD partitioning over
  the mesh's cores (tf_gspmd.tpu). Elsewhere, jit-compiled on the mesh's first device: on CPUs and GPUs XLA here
  has one partition: it runs the program unpartitioned (its sharding annotations change no value), so results are
  the unpartitioned program's, whole tf.Tensors. A captured variable tf_gspmd stores sharded is brought up to date
  before and its shards after."""
  devices = program.devices or ()
  values = [tf.convert_to_tensor(a.numpy()) if isinstance(a, ShardedTensor) else tf.convert_to_tensor(a) for a in args]
  if any(tf.DeviceSpec.from_string(d).device_type.upper() == "TPU" for d in devices):
    # TPUStrategy's SPMD bridge: XLA partitions the program over the mesh's cores (tf_gspmd.tpu)
    return _tpu.run_exported(program.exported, program.mesh, values)
  managed = [v for v in program.variables if v is not None and _state.storage_of(v) is not None]
  for v in managed:
    v.read_value()   # its shards copied into it
  flat = program.exported(values)
  for v in managed:
    v.assign(_compat.read_unhooked(v))
  return flat


_DENSE = {
    tf.RaggedTensor: "x.to_tensor() (padded), or x.flat_values and x.nested_row_splits as separate arguments",
    tf.SparseTensor: "tf.sparse.to_dense(x), or x.indices, x.values and x.dense_shape as separate arguments",
    tf.IndexedSlices: "tf.convert_to_tensor(x)",
}


def _dense_argument(a, k):
  """Argument `a` (number `k`) as a dense tf.Tensor; InputError for values a gs.function cannot take."""
  if isinstance(a, tf.Tensor):
    return a
  for kind, fix in _DENSE.items():
    if isinstance(a, kind):
      raise InputError(f"argument {k} is a {kind.__name__}; a gs.function takes dense tensors (arrays, tf.Tensor, "
                       f"ShardedTensor): pass {fix}", node=f"argument {k}")
  if isinstance(a, dict) or (isinstance(a, (tuple, list)) and any(
      isinstance(e, (tf.Tensor, ShardedTensor, dict, tf.RaggedTensor, tf.SparseTensor)) for e in a)):
    raise InputError(f"argument {k} is a {type(a).__name__} of tensors; a gs.function takes one dense tensor per "
                     "positional argument: pass its tensors as separate arguments (f(*values) and a matching "
                     "in_shardings tuple), or stack them into one array", node=f"argument {k}")
  try:
    return tf.convert_to_tensor(a)
  except (TypeError, ValueError) as e:
    raise InputError(f"argument {k} ({type(a).__name__}) is not a tensor: {e}; pass a numpy array, a tf.Tensor "
                     "or a ShardedTensor", node=f"argument {k}") from e


def _check_shardings_argument(value, what):
  """InputError unless `value` is what `in_shardings`/`out_shardings` take: None, "auto", a P, a Sharding, an
  OpSharding (or its bytes), a spec tuple, or a tuple/list of those, one per value."""
  def leaf(v):
    return v is None or isinstance(v, (P, Sharding, str, bytes)) or type(v).__name__ == "OpSharding"

  def spec_tuple(v):
    return isinstance(v, (tuple, list)) and all(e is None or isinstance(e, str) or (
        isinstance(e, tuple) and all(isinstance(a, str) for a in e)) for e in v)

  if leaf(value) or (isinstance(value, (tuple, list)) and all(leaf(v) or spec_tuple(v) for v in value)):
    return
  bad = value if not isinstance(value, (tuple, list)) else next(v for v in value if not (leaf(v) or spec_tuple(v)))
  raise InputError(f"{what}={value!r}: {bad!r} ({type(bad).__name__}) is not a sharding; give None (completion "
                   f"decides), gs.P(...) or a gs.Sharding for every value, or a tuple of them with one entry per "
                   f"{'argument' if what == 'in_shardings' else 'result'}", node=what)


def _checked_timeout(seconds):
  """`collective_timeout` as a float: InputError unless a finite number of seconds above 0."""
  if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 < seconds < float("inf"):
    raise InputError(f"collective_timeout={seconds!r}: give the seconds (a positive number, e.g. 300) after which a "
                     "stuck collective raises DeadlineExceededError", node="collective_timeout")
  return float(seconds)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, what):
  """A byte count from a number or a string with a unit ("64MB", "2GiB", "1.5 GB"; KB/MB/GB/TB are powers of 1000,
  KiB/MiB/GiB/TiB of 1024); None stays None. InputError for anything else."""
  if value is None:
    return None
  if isinstance(value, str):
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", value)
    unit = m.group(2).lower() if m else None
    if unit not in _UNITS:
      raise InputError(f"{what}={value!r} is not a size; give bytes as a number or a string like \"64MB\" or "
                       f"\"2GiB\" (units {sorted(set(u.upper().replace('I', 'i') for u in _UNITS if u))})", node=what)
    value = float(m.group(1)) * _UNITS[unit]
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < float("inf"):
    raise InputError(f"{what}={value!r}: give bytes per device (a positive number, or a string like \"64MB\") or None",
                     node=what)
  return int(value)


def _is_auto(s):
  return isinstance(s, str) and s == auto_pass.AUTO


def _auto_options(mesh, in_shardings, memory_budget, axis_cost, flops_per_byte, time_limit=None, pins="all"):
  """AutoOptions when some in_shardings entry is "auto" (None otherwise); the other arguments checked."""
  single = in_shardings is None or isinstance(in_shardings, (P, Sharding, str))
  entries = (in_shardings,) if single or not isinstance(in_shardings, (tuple, list)) else in_shardings
  for k, s in enumerate(entries):
    if isinstance(s, str) and not _is_auto(s):
      raise InputError(f"in_shardings entry {k} is the string {s!r}; the only string accepted is \"auto\" (the "
                       "layout is chosen by the auto-sharding solver)")
  if not any(_is_auto(s) for s in entries):
    if memory_budget is not None or axis_cost is not None or time_limit is not None or pins != "all":
      raise InputError("memory_budget, axis_cost, solver_time_limit and auto_pins apply to automatic sharding: "
                       "give in_shardings=\"auto\" (or \"auto\" for some arguments)")
    return None
  if axis_cost is not None and not isinstance(axis_cost, dict):
    raise InputError(f"axis_cost={axis_cost!r}: give a dict {{mesh axis: relative time per byte}}, e.g. "
                     f"{{{mesh.axis_names[0]!r}: 8.0}}", node="axis_cost")
  axis_cost = dict(axis_cost or {})
  for a, c in axis_cost.items():
    if a not in mesh.axis_names:
      raise MeshError(f"axis_cost names {a!r}, which is not an axis of {mesh}; give costs for {mesh.axis_names}")
    if not _positive(c):
      raise InputError(f"axis_cost[{a!r}] = {c!r}: give a positive relative time per byte (1.0 = the default)")
  if not _positive(flops_per_byte):
    raise InputError(f"flops_per_byte={flops_per_byte!r}: give a positive number")
  if time_limit is not None and not _positive(time_limit):
    raise InputError(f"solver_time_limit={time_limit!r}: give seconds (a positive number) or None")
  if pins not in ("all", "state"):
    raise InputError(f"auto_pins={pins!r}: give \"all\" or \"state\"")
  options = auto_pass.AutoOptions(memory_budget=None if memory_budget is None else int(memory_budget),
                                  axis_cost=tuple(sorted(axis_cost.items())), flops_per_byte=float(flops_per_byte),
                                  pin_intermediates=pins == "all")
  return options if time_limit is None else dataclasses.replace(options, time_limit=float(time_limit))


def _positive(value):
  """Whether `value` is a finite number above 0 (not a bool, a string or NaN)."""
  return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 < value < float("inf")


def _retrace_reason(old, new):
  """Why signature `new` (specs, arriving layouts, devices) needed its own lowering, compared with `old`."""
  if len(old[0]) != len(new[0]):
    return f"called with {len(new[0])} arguments instead of {len(old[0])}"
  for k, (a, b) in enumerate(zip(old[0], new[0])):
    if a != b:
      return f"argument {k} is {b.dtype.name}{b.shape.as_list()} (was {a.dtype.name}{a.shape.as_list()})"
  for k, (a, b) in enumerate(zip(old[1], new[1])):
    if a != b:
      return f"argument {k} arrives laid out as {b} (was {a})"
  return "new devices"


def _arriving(a):
  """The layout argument `a` arrives in: a ShardedTensor's (at its rank), else None (a whole value)."""
  if not isinstance(a, ShardedTensor):
    return None
  return a.sharding if a.sharding.is_maximal else a.sharding.with_rank(a.shape.rank)


def _as_spec(s, k):
  if isinstance(s, tf.TensorSpec):
    spec = s
  elif hasattr(s, "shape") and hasattr(s, "dtype"):
    spec = tf.TensorSpec(s.shape, s.dtype)
  else:
    raise InputError(f"argument {k} of lower() must be a tf.TensorSpec or an array; got {s!r}")
  if not spec.shape.is_fully_defined():
    raise ShapeError(f"argument {k} has dynamic shape {spec.shape}; give every dimension a size", node=f"argument {k}")
  return tf.TensorSpec(spec.shape, spec.dtype)


def function(fn=None, *, mesh, in_shardings=None, out_shardings=None, strict=False, collective_timeout=300.0,
             weight_update_sharding=None, jit_compile="auto", memory_budget=None, axis_cost=None,
             flops_per_byte=1000.0, exchange="auto", partitioner=None, solver_time_limit=None, auto_pins="all"):
  """Partitions `fn` over `mesh` and runs it as one SPMD program on every mesh device.

  Args:
    fn: a Python function or tf.function taking tensors.
    mesh: the `gs.Mesh`.
    in_shardings: one `P`/`Sharding` (or None = let completion decide) per positional argument, or one
      for all of them. A `P.UNCONSTRAINED` entry leaves that dim to completion and pins the others.
    out_shardings: one spec per flattened output, one for all, or None (completion decides); `P.UNCONSTRAINED`
      entries as for in_shardings.
    strict: raise instead of running ops without a partitioning rule replicated (UnsupportedOpError), and
      instead of warning about an involuntary full rematerialization, an all-gather of more than 1 MiB per
      device, or to the full shape of a split variable, that no pinned sharding asked for (PartitionError); and
      refuse a constant of more than 1 MiB in the per-device program, held whole on every device (PartitionError).
    collective_timeout: seconds before a stuck collective raises DeadlineExceededError.
    weight_update_sharding: split optimizer state and the weight update over a data-parallel mesh axis (True:
      the "data" axis, or the first axis; or an axis name): gradients are reduce-scattered, the update runs on
      the shard, weights are all-gathered; optimizer-state memory is divided by the axis size.
    jit_compile: "auto" (XLA on GPU and TPU), True (also on CPU, where the compute between collectives runs as
      XLA-compiled segments), "segments" (on GPUs too, every collective between XLA clusters, none inside), or
      False. On GPUs the summing all-reduces of one mesh group run inside XLA clusters (docs/hardware.md).
    memory_budget: with "auto": bytes per device the arguments and variables (weights, optimizer state) may take.
    axis_cost: with "auto": {mesh axis: relative time per byte} (default 1.0; e.g. 8.0 for an axis across hosts).
    flops_per_byte: with "auto": arithmetic a device does in the time a link moves one byte (weighs splitting the
      work against the bytes it costs).
    solver_time_limit: with "auto": seconds the solver may take (default 60); at the limit a deterministic local
      search gives the plan (within the budget; `auto_plan.timed_out`, with a warning), the same on every call.
    auto_pins: with "auto": "all" (default) pins every tensor the solver priced, so the partitioner does what it
      priced; "state" pins only the arguments and variables and leaves the rest to completion (what a program
      given only those layouts runs, e.g. a Keras LayoutMap's; the budget still bounds the completed plan).
    exchange: "auto": on CPU devices, the program of every device of a process runs as one TF graph in which
      each collective within the process is the ops that compute its result from the members' tensors, passed
      between the devices by reference, and each collective across processes one TF collective per process (the
      same results and the same report); elsewhere TF's collectives. "collectives": TF's collective ops on every
      device always.
    partitioner: "tf_gspmd" (tf_gspmd partitions the program and runs it on every mesh device) or "xla": the
      program after completion (and automatic sharding) is exported with every layout written as XLA sharding
      and compiled with tf.function(jit_compile=True), for XLA's own SPMD partitioner; tf_gspmd's partitioner,
      collectives and runtime do not run it (`f.lower(...).report` is still tf_gspmd's plan, marked as planned;
      `.xla_hlo()` is the exported HLO). Called on CPUs or GPUs, where XLA here has one partition, the exported
      program runs unpartitioned on the mesh's first device: the unpartitioned program's results, as whole
      tf.Tensors (`tools/xla_oracle.py` has XLA partition it over 8 host CPUs). None (default): the default for
      the kind of the mesh's devices (`DEFAULT_PARTITIONER`).

  Example:
    >>> @gs.function(mesh=mesh, in_shardings=(P("data", None), P(None, "model")))
    ... def f(x, w):
    ...   return tf.nn.relu(x @ w)
  """
  def wrap(f):
    return ShardedFunction(f, mesh, in_shardings, out_shardings, strict, collective_timeout, weight_update_sharding,
                           jit_compile, memory_budget, axis_cost, flops_per_byte, exchange, partitioner,
                           solver_time_limit, auto_pins)

  return wrap(fn) if fn is not None else wrap
