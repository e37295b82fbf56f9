"""`gs.plan_stages`: automatic pipeline stages and submeshes for a step, planned without devices."""

import numpy as np
import tensorflow as tf

from tf_gspmd._function import function as gs_function, parse_bytes
from tf_gspmd._parallel.stage_programs import leaf_paths
from tf_gspmd._layout.mesh import Mesh, P
from tf_gspmd.errors import InputError, MeshError
from tf_gspmd.rewriter import pipeline
from tf_gspmd.rewriter.program import Options, Program
from tf_gspmd.rewriter.stages import calibrate, plan as stages


def _time_all_reduce(best_of, elements=1 << 20):
  """Seconds per byte of an all-reduce of `elements` float32 over two devices, or None without two devices (the
  planner's calibration of collectives)."""
  kind = "GPU" if len(tf.config.list_logical_devices("GPU")) >= 2 else "CPU"
  devices = tf.config.list_logical_devices(kind)
  if len(devices) < 2:
    return None
  mesh = Mesh((2,), ("x",), devices=tuple(d.name for d in devices[:2]))
  f = gs_function(lambda x: tf.reduce_sum(x, axis=0), mesh=mesh, in_shardings=P("x", None), out_shardings=P())
  x = np.ones((2, elements), np.float32)
  small = np.ones((2, 1), np.float32)
  overhead = best_of(lambda: np.asarray(f(small)))
  return max(best_of(lambda: np.asarray(f(x))) - overhead, 1e-9) / (elements * 4)


def _time_stage_call(best_of, first, second, microbatches=4):
  """Seconds per stage-program call, fitted to a measured MPMD pipeline of two trivial stages on `first` and
  `second` (1F1B, `microbatches`): its step over the calls the planner prices for it (per microbatch a forward
  and a backward call of each stage, and the move each way between them). Python dispatches one call at a time,
  so the calls add up."""
  from tf_gspmd._parallel.mpmd import Stage, mpmd_pipeline  # pylint: disable=g-import-not-at-top
  stages = [Stage(lambda p, h: h * p[0], first, in_sharding=P("x", None), out_sharding=P("x", None)),
            Stage(lambda p, h, t: tf.reduce_mean(tf.square(h * p[0] - t)), second, in_sharding=P("x", None),
                  target_sharding=P("x", None))]
  pipe = mpmd_pipeline(stages, microbatches=microbatches)
  w = (np.ones((1,), np.float32),)
  x = np.ones((2 * microbatches, 2), np.float32)
  seconds = best_of(lambda: pipe([w, w], x, x))
  return seconds / (microbatches * (2 * 2 + 2))


def _time_stage_runs(best_of, elements=1 << 20):
  """(seconds per stage-program call (`_time_stage_call`), seconds per byte a destination device
  receives when gs.reshard moves a float32 tensor between two disjoint 2-device submeshes, how many devices
  compute at once: k x one device's matmul time / k devices' time for a matmul each, inf when that is near k,
  seconds per destination device of the move of a tiny tensor: what each tensor a move carries costs whatever its
  size), or None without four devices of one type (the planner's calibration of what a pipeline's runtime adds)."""
  from tf_gspmd.runtime import cross_mesh  # pylint: disable=g-import-not-at-top
  kind = "GPU" if len(tf.config.list_logical_devices("GPU")) >= 4 else "CPU"
  devices = [d.name for d in tf.config.list_logical_devices(kind)]
  if len(devices) < 4:
    return None
  src = Mesh((2,), ("x",), devices=tuple(devices[:2]))
  dst = Mesh((2,), ("x",), devices=tuple(devices[2:4]))
  f = gs_function(lambda x: x + 1.0, mesh=src, in_shardings=P("x", None), out_shardings=P("x", None))
  small = np.ones((2, 1), np.float32)
  per_call = _time_stage_call(best_of, src, dst)
  big_x, small_x = f(np.ones((2, elements), np.float32)), f(small)
  moved = best_of(lambda: np.asarray(cross_mesh.reshard(big_x, dst, P())))
  tiny = best_of(lambda: np.asarray(cross_mesh.reshard(small_x, dst, P())))
  per_byte = max(moved - tiny, 1e-9) / (2 * elements * 4)   # (each destination device gets it all)
  k = min(len(devices), 8)
  n = 256
  w = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
  one = gs_function(lambda x, y: x @ y, mesh=Mesh((1,), ("x",), devices=tuple(devices[:1])),
                    in_shardings=(P("x", None), P()), out_shardings=P("x", None))
  many = gs_function(lambda x, y: x @ y, mesh=Mesh((k,), ("x",), devices=tuple(devices[:k])),
                     in_shardings=(P("x", None), P()), out_shardings=P("x", None))
  t1 = best_of(lambda: np.asarray(one(np.tile(w, (4, 1)), w)))
  tk = best_of(lambda: np.asarray(many(np.tile(w, (4 * k, 1)), w)))   # (the same work on each of k devices)
  parallel = k * t1 / max(tk, 1e-9)
  return per_call, per_byte, (float("inf") if parallel > 0.8 * k else max(parallel, 1.0)), tiny / 2


# What the planner's calibration times (`calibrate.calibrate(timers=TIMERS)`).
TIMERS = calibrate.Timers(all_reduce=_time_all_reduce, stage_runs=_time_stage_runs)


def check_mesh(mesh, caller):
  """MeshError naming `mesh=` for anything but a gs.Mesh (e.g. a shape tuple)."""
  if isinstance(mesh, Mesh):
    return
  shape = f"{tuple(mesh)!r}" if isinstance(mesh, (tuple, list)) and all(isinstance(n, int) for n in mesh) else "(2, 4)"
  raise MeshError(f"mesh={mesh!r}: {caller} cuts its stages from a gs.Mesh, not {type(mesh).__name__}; give e.g. "
                  f"mesh=gs.Mesh({shape}, (\"host\", \"device\")) (its last axis is a row of devices)", node="mesh")


def trace_forward(fn, arg_specs, mesh):
  """The traced, imported global program of `fn` at `arg_specs` (nested TensorSpecs) on `mesh`: (Program,
  {Placeholder name: readable argument path}, per argument the Placeholder names of its leaves)."""
  flat = tf.nest.flatten(arg_specs)
  if not all(isinstance(s, tf.TensorSpec) for s in flat):
    raise InputError("plan_stages takes tf.TensorSpec arguments (nested structures of them): the step is planned, "
                     "not run", node=getattr(fn, "__name__", "the step"))

  def flat_fn(*args):
    return fn(*tf.nest.pack_sequence_as(list(arg_specs), list(args)))

  flat_fn.__name__ = getattr(fn, "__name__", "step")
  program = Program(fn=flat_fn, mesh=mesh, options=Options(), arg_specs=tuple(flat),
                             declared_in=(None,) * len(flat), arriving_in=(None,) * len(flat))
  program = pipeline.run(program, path=pipeline.PLAN, until="import_annotations")
  paths = [p or str(k) for k, p in enumerate(leaf_paths(list(arg_specs)))]
  names = dict(zip(program.input_names, paths))
  for name, v in zip(program.variable_names, program.variables):
    if v is not None:
      names[name] = v.name.split(":")[0]
  per_arg, pos = [], 0
  for spec in arg_specs:
    n = len(tf.nest.flatten(spec))
    per_arg.append(program.input_names[pos:pos + n])
    pos += n
  return program, names, per_arg


def plan_stages(fn, *arg_specs, mesh, layers, microbatches=1, memory_budget=None, params=(0,), optimizer_slots=2,
                max_stages=None, calibration=None, t_max_step=0.005, solver_time_limit=10.0, whole_mesh=False,
                measured=None, measured_only=False, max_stage_rows=None):
  """Pipeline stages, submeshes and intra-operator plans for `fn` on `mesh` (Alpa's two levels; no devices needed).

  fn: the forward step (e.g. the loss of a model from its parameters and a batch), called with tensors of
    `arg_specs` (tf.TensorSpecs, nested structures allowed), which describe ONE microbatch.
  mesh: the gs.Mesh the stages are cut from: its last axis is a row (e.g. the devices of one host), the others
    rows; submeshes are (1, 2^k) parts of a row and whole rows.
  layers: how many layers the ops are clustered into (the stage boundaries fall between layers).
  microbatches: B of the pipeline; the plan minimises T* = sum t_i + (B - 1) max t_j.
  memory_budget: bytes per device (int or "16GiB"); each stage keeps its parameters x (2 + optimizer_slots) and the
    activations of the microbatches in flight under 1F1B. None: unbounded.
  params: which arguments hold parameters (trained); captured trainable tf.Variables are parameters too.
  calibration: a `Calibration` (seconds per multiply-add and per collective byte); default: this machine's,
    measured once and cached.
  max_stages: at most this many stages (default: as many as layers or devices).
  t_max_step: the stage program skips largest-stage latencies within this fraction of the last one it tried
    (0: tries every one, exact; a few per mille loses little and saves most of the time on large meshes).
  solver_time_limit: seconds the intra-operator program of one layer may take.
  whole_mesh: only configurations of the whole mesh (with max_stages=1 and microbatches=1: the step priced as
    its intra-operator plan alone, no pipeline).
  measured: {(first layer, last layer, submesh shape, logical shape): seconds per microbatch}: stages timed on
    this machine, priced at their measurement instead of the model's (gs.auto_parallel's profiling);
    `measured_only`: plans of those stages alone.
  max_stage_rows: submeshes of at most this many rows (1: each stage within one row, e.g. one process's devices).

  Returns a StagePlan (print it for the table); raises AutoShardingError naming the smallest feasible budget when
  no plan fits `memory_budget`.

  Example:
    >>> specs = ({"w1": tf.TensorSpec((512, 2048)), "w2": tf.TensorSpec((2048, 512))},
    ...          tf.TensorSpec((32, 512)))
    >>> plan = gs.plan_stages(lambda p, x: tf.reduce_sum(tf.nn.relu(x @ p["w1"]) @ p["w2"]), *specs,
    ...                       mesh=gs.Mesh((2, 4), ("host", "device")), layers=2, microbatches=8)
    >>> print(plan)   # stages, submeshes, logical meshes, layouts, predicted t_i and T*
  """
  check_mesh(mesh, "gs.plan_stages")
  if int(microbatches) < 1:
    raise InputError(f"microbatches must be >= 1; got {microbatches}", node=getattr(fn, "__name__", "the step"))
  program, names, per_arg = trace_forward(fn, arg_specs, mesh)
  trained = set()
  for k in params:
    if not 0 <= k < len(per_arg):
      raise InputError(f"params={params!r} names argument {k}, but the step takes {len(per_arg)} arguments",
                       node=getattr(fn, "__name__", "the step"))
    trained.update(per_arg[k])
  trained.update(n for n, v in zip(program.variable_names, program.variables) if v is not None and v.trainable)
  budget = parse_bytes(memory_budget, "memory_budget")
  return stages.plan(program, layers=layers, microbatches=int(microbatches), memory_budget=budget, params=trained,
                     calib=calibration, timers=TIMERS, optimizer_slots=optimizer_slots, max_stages=max_stages,
                     t_max_step=t_max_step, solver_time_limit=solver_time_limit, names=names,
                     whole_mesh=whole_mesh, measured=measured,
                     measured_only=measured_only, max_stage_rows=max_stage_rows)
