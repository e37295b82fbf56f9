"""What the training binaries share: flags, the loop, TensorBoard, checkpoints, --resume, --plan and the check.

A binary describes its model as a `Task` and calls `run(task)`:

  Task.axes        mesh axis names; --mesh gives their sizes
  Task.build()     -> Model: the variables (created for the mesh), the train step (a Python function that
                      captures them, annotations inside), and what to checkpoint
  Task.batch(k)    the k-th batch (numpy), a pure function of (--seed, k): a resumed run sees the same data
  Task.in_specs    one P per batch input; Task.unit, Task.per_step: what the throughput counts

The loop prints one `step K loss X` line per step (and a progress bar on a terminal), writes loss, step time
and throughput to TensorBoard (--logdir), saves a checkpoint every --ckpt_every steps (atomically, through
tf.train.CheckpointManager), and with --resume continues from the latest one. At the end it re-runs the first
--check_steps steps unpartitioned, from the same initial values, and fails unless the losses agree (rtol 1e-4).
--plan prints the sharding and communication plan for --plan_mesh (default 2048 devices) without running.
"""

import dataclasses
import math
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, Sequence

from absl import flags
import numpy as np

flags.DEFINE_list("mesh", None, "Mesh shape, one positive size per axis (e.g. 2,4).")
flags.DEFINE_integer("steps", 30, "Training steps (with --resume: the step to stop at).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of the initial values and of the data.", lower_bound=0)
flags.DEFINE_float("lr", 3e-3, "Learning rate (a positive number).")
flags.DEFINE_string("logdir", "/tmp/tf_gspmd_runs", "TensorBoard and checkpoint root directory.")
flags.DEFINE_integer("ckpt_every", 10, "Save a checkpoint every this many steps (0: never).", lower_bound=0)
flags.DEFINE_bool("resume", False, "Continue from the latest checkpoint in --logdir.")
flags.DEFINE_bool("plan", False, "Print the sharding and communication plan for --plan_mesh and exit.")
flags.DEFINE_list("plan_mesh", None, "Mesh shape for --plan, one positive size per axis (default: 2048 devices).")
flags.DEFINE_integer("plan_hosts", None, "For --plan: the mesh's devices spread over this many hosts (processes), "
                     "an equal number each, hosts major; the plan then tells which collectives cross hosts.",
                     lower_bound=1)
flags.DEFINE_integer("check_steps", 3, "Steps re-run unpartitioned at the end to check the losses (0: skip).",
                     lower_bound=0)
flags.DEFINE_bool("auto", False, "Choose the layouts of the batch, the weights and the optimizer state automatically "
                  "(in_shardings=\"auto\": an integer program over the whole step) instead of the model's annotations.")
flags.DEFINE_float("memory_budget_mib", None, "With --auto: MiB per device the arguments, weights, optimizer state and "
                   "the activations live at the peak may take (--plan prints what a plan takes, counted this way).")
flags.DEFINE_bool("gpu_form", False, "Lower the train step for a mesh of --mesh GPUs (none needed here), check its GPU "
                  "form (gs.gpu_form: its XLA clusters through tf2xla, one all-reduce configuration per cluster, one "
                  "launch order on every device), print it and exit.")
flags.DEFINE_string("report_html", None, "Write the train step's plan (with --plan: for --plan_mesh) as one "
                    "self-contained HTML page to this path: collectives, bytes per layer, memory, layouts, warnings.")
flags.DEFINE_bool("explore", False, "Open the train step's plan (with --plan: for --plan_mesh) in Model Explorer "
                  "(pip install 'tf_gspmd[explore]') on 127.0.0.1, serving until Ctrl+C.")
flags.DEFINE_integer("explore_port", None, "With --explore: the port (default: a free one).", lower_bound=1)
flags.DEFINE_integer("crash_at_step", None, "Fault drill: the job's last process kills itself (SIGKILL) as this "
                     "step starts, in the job's first start only (python -m tf_gspmd.launch --max_restarts=N starts "
                     "it again; with --resume it goes on from its last checkpoint).", lower_bound=0)
flags.DEFINE_bool("jit", False, "Compile the compute between collectives with XLA (jit_compile=True).")
flags.DEFINE_enum("exchange", "auto", ["auto", "collectives"], "How the devices exchange data (gs.function's "
                  "`exchange`): auto runs the CPUs of each process as one graph (TF's collectives only across "
                  "processes); collectives runs each device's program on its own thread, joined by TF's collective "
                  "ops, as GPUs do.")
flags.DEFINE_bool("auto_parallel", False, "Plan pipeline stages, their submeshes and intra-operator layouts "
                  "automatically (gs.auto_parallel, Alpa's two levels) and train the model's plain-TF step as an MPMD "
                  "pipeline, SGD at --lr; with --plan: only the plan, for --plan_mesh, without devices.")
flags.DEFINE_integer("stage_layers", None, "With --auto_parallel: the layers the step's ops are clustered into (the "
                     "stage boundaries fall between them; default: the model's layers + 2).", lower_bound=1)
flags.DEFINE_bool("stage_profile", True, "With --auto_parallel: time the stages of the plans the cost model "
                  "chooses, and the step without a pipeline, and plan again with the measured latencies "
                  "(gs.auto_parallel(profile=...)); --nostage_profile: the cost model alone.")
flags.DEFINE_list("profile", [], "Steps FIRST,LAST (e.g. 3,5) to trace with the TensorFlow profiler into "
                  "<logdir>/<task>/profile (open in TensorBoard's Profile tab); empty: no trace.")

FLAGS = flags.FLAGS


# ---- flag checks: every value is checked as the flags are parsed, before TensorFlow starts ------------------------
# A bad value ends the binary with absl's usage error naming the flag (exit status 1), instead of a traceback after
# TensorFlow's start-up (or a run that silently does nothing).

def sizes(values):
  """A list flag's values as a tuple of positive ints, or None when one of them is not."""
  if not values or not all(v.strip().isdigit() and int(v) > 0 for v in values):
    return None
  return tuple(int(v) for v in values)


def positive_number(value):
  return value is None or (math.isfinite(value) and value > 0)


def _profile_steps(values):
  """Whether --profile is empty, one step or FIRST,LAST (0 or more, FIRST <= LAST)."""
  if not values:
    return True
  if len(values) > 2 or not all(v.strip().isdigit() for v in values):
    return False
  return int(values[0]) <= int(values[-1])


for _flag in ("mesh", "plan_mesh"):
  flags.register_validator(_flag, lambda v: v is None or sizes(v) is not None,
                           "give one positive whole size per mesh axis, e.g. 2,4")
flags.register_validator("lr", lambda v: positive_number(v) and v is not None, "give a positive learning rate")
flags.register_validator("memory_budget_mib", positive_number, "give a positive number of MiB (or leave it out)")
flags.register_validator("profile", _profile_steps, "give the steps FIRST,LAST to trace (FIRST <= LAST, 0 or more, "
                         "e.g. 3,5), one step (e.g. 3), or nothing")
flags.register_multi_flags_validator(
    ["profile", "steps"], lambda v: not _profile_steps(v["profile"]) or not v["profile"] or
    int(v["profile"][-1]) < v["steps"],
    "--profile names a step the run does not reach: trace steps below --steps")


def check_meshes(meshes, extra=()):
  """Registers the check of --mesh, --plan_mesh and --plan_hosts against the binary's meshes.

  `meshes(values)` -> (the axis names a mesh may have -- a list of tuples, one per accepted rank, or None for any
  rank --, the default --plan_mesh), for the flag values `values` (a dict of mesh, plan_mesh, plan_hosts, plan,
  auto_parallel and the binary's flags `extra`, e.g. its pipeline stages)."""
  names = ["mesh", "plan_mesh", "plan_hosts", "plan", "auto_parallel", *extra]

  def check(values):
    axes, default_plan_mesh = meshes(values)
    for flag in ("mesh", "plan_mesh"):
      shape = sizes(values[flag])
      if shape is not None and axes is not None and len(shape) not in {len(a) for a in axes}:
        ranks = " or ".join(f"{len(a)} ({','.join(a)})" for a in axes)
        raise flags.ValidationError(f"--{flag}={','.join(values[flag])} gives {len(shape)} sizes, but this run's "
                                    f"mesh has {ranks} axes: give one size per axis")
    plan_shape = sizes(values["plan_mesh"]) or tuple(default_plan_mesh)
    hosts, devices = values["plan_hosts"], math.prod(plan_shape)
    if hosts is not None and devices % hosts:
      raise flags.ValidationError(f"--plan_hosts={hosts} does not divide the {devices} devices of the plan's mesh "
                                  f"{','.join(map(str, plan_shape))}: give a number of hosts that divides {devices}")
    return True

  flags.register_multi_flags_validator(names, check)


@dataclasses.dataclass
class Model:
  step: Callable[..., Any]          # train step: batch tensors -> loss (updates the variables)
  trackables: Dict[str, Any]        # what the checkpoint holds (variables, Keras models, optimizers)


@dataclasses.dataclass
class Task:
  name: str
  axes: Sequence[str]
  default_mesh: Sequence[int]
  default_plan_mesh: Sequence[int]
  build: Callable[[Any], Model]     # build(mesh or None) -> Model; None: unpartitioned, same initial values
  batch: Callable[[int], tuple]
  in_specs: Callable[[Any], tuple]  # in_specs(mesh) -> one P per batch input
  unit: str
  per_step: int


@dataclasses.dataclass
class AutoTask:
  """A model for --auto_parallel: its loss from explicit parameters."""
  name: str
  loss_fn: Callable[..., Any]       # loss_fn(params, *batch) -> the mean loss over the batch rows
  init: Callable[[], Any]           # the initial parameters (a nest of numpy arrays), a pure function of --seed
  param_specs: Callable[[], Any]    # their tf.TensorSpecs (plan mode: nothing of the model's size is allocated)
  batch: Callable[[int], tuple]
  layers: int                       # the model's layers (the clusters default to layers + 2)
  microbatches: int
  default_mesh: Sequence[int]
  default_plan_mesh: Sequence[int]


def run_auto_parallel(task):
  """Train `task` with gs.auto_parallel (or, with --plan, print its plan for --plan_mesh); returns (step, loss)s."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  budget = None if FLAGS.memory_budget_mib is None else math.ceil(FLAGS.memory_budget_mib * 2**20)
  layers = FLAGS.stage_layers or task.layers + 2
  axes = ("host", "device")
  if FLAGS.plan:
    shape = tuple(int(s) for s in (FLAGS.plan_mesh or task.default_plan_mesh))
    mesh = gs.Mesh(shape, axes[-len(shape):] if len(shape) <= 2 else tuple(f"a{i}" for i in range(len(shape))))
    micro = [tf.TensorSpec((a.shape[0] // task.microbatches,) + a.shape[1:], tf.as_dtype(a.dtype))
             for a in task.batch(0)]
    start = time.perf_counter()
    found = gs.plan_stages(task.loss_fn, task.param_specs(), *micro, mesh=mesh, layers=layers,
                           microbatches=task.microbatches, memory_budget=budget)
    print(f"{task.name}: automatic stages for mesh {shape} ({mesh.size} devices), {layers} layers, "
          f"{task.microbatches} microbatches, planned in {time.perf_counter() - start:.1f} s without the devices")
    print(found)
    return []
  shape = tuple(int(s) for s in (FLAGS.mesh or task.default_mesh))
  gs.initialize(cpu_devices=int(np.prod(shape)))
  mesh = gs.Mesh(shape, axes[-len(shape):] if len(shape) <= 2 else tuple(f"a{i}" for i in range(len(shape))))
  params = task.init()
  step = gs.auto_parallel(task.loss_fn, params, *task.batch(0), mesh=mesh, microbatches=task.microbatches,
                          memory_budget=budget, layers=layers, profile=FLAGS.stage_profile)
  print(step)
  params = step.place(params)   # each parameter on its stage's devices, in the planned layout, for the whole run
  losses = []
  for k in range(FLAGS.steps):
    loss, grads = step(params, *task.batch(k))
    params = step.sgd(params, grads, FLAGS.lr)
    losses.append((k, float(loss)))
    print(f"step {k} loss {float(loss):.6f} time {step.last_seconds * 1e3:.0f} ms (plan predicts "
          f"{step.plan.predicted_seconds * 1e3:.1f} ms)", flush=True)
  if FLAGS.check_steps and losses:
    params, ref = task.init(), []
    params = tf.nest.map_structure(tf.constant, params)
    grad_fn = tf.function(lambda p, *b: _value_and_grad(task.loss_fn, p, *b))
    for k in range(min(FLAGS.check_steps, len(losses))):
      loss, grads = grad_fn(params, *[tf.constant(a) for a in task.batch(k)])
      ref.append(float(loss.numpy()))
      params = tf.nest.map_structure(lambda p, g: p - FLAGS.lr * g, params, grads)
    _compare([l for _, l in losses[:len(ref)]], ref)
  return losses


def _value_and_grad(loss_fn, params, *batch):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.GradientTape() as tape:
    tape.watch(params)
    loss = loss_fn(params, *batch)
  grads = tf.nest.map_structure(tf.convert_to_tensor, tape.gradient(loss, params))
  return loss, grads


def _mesh(task, shape):
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  return gs.Mesh(tuple(int(s) for s in shape), tuple(task.axes))


def plan(task):
  """Lower the train step for a mesh of any size, without its devices, and print the plan."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  mesh = _mesh(task, FLAGS.plan_mesh or task.default_plan_mesh)
  with gs.plan_scope():   # the model's variables get shapes, no values: nothing of the model's size is allocated
    model = task.build(mesh, plan_only=True)
  f = gs.function(model.step, mesh=mesh, **_shardings(task, mesh))
  start = time.perf_counter()
  low = f.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in task.batch(0)], processes=FLAGS.plan_hosts)
  took = time.perf_counter() - start
  hosts = f" on {FLAGS.plan_hosts} hosts x {mesh.size // FLAGS.plan_hosts}" if FLAGS.plan_hosts else ""
  print(f"{task.name}: plan for mesh {dict(zip(mesh.axis_names, mesh.shape))} ({mesh.size} devices{hosts}), "
        f"lowered in {took:.1f} s without the devices")
  start = time.perf_counter()
  memory = low.report.memory   # an Account: the per-device program's estimate and the plan's count it holds
  counted = time.perf_counter() - start
  print(f"estimated peak memory: {memory.peak_bytes / 2**20:,.2f} MiB per device ({memory.peak_bytes:,} B at "
        f"{memory.at}, the per-device program; estimated in {counted:.2f} s) =")
  plan = getattr(memory, "plan", None)
  if plan is not None:
    print(f"  memory as --memory_budget_mib counts it: {plan.peak_bytes / 2**20:.9f} MiB per device (the plan at its "
          f"layouts, {plan.peak_bytes:,} B at {plan.at}: arguments {plan.argument_bytes:,} + variables "
          f"{plan.state_bytes:,} + constants {plan.constant_bytes:,} + live activations {plan.activation_bytes:,}, "
          f"loop bodies and the lists loops keep for the backward included)")
    d = memory.difference_bytes
    print(f"  + partitioning adds {d:+,} B ({d / 2**20:+,.2f} MiB): live at the "
          f"per-device peak, collective buffers {memory.added_collective_bytes:,} + per-device tables and partition "
          f"id {memory.added_table_bytes:,} + reshard temporaries and ops above their layout "
          f"{memory.added_other_bytes:,}, {memory.plan_bytes_elsewhere()}"
          + (" (the per-device program holds less than the plan's count)" if d < 0 else ""))
    if memory.budget is not None:
      over = plan.peak_bytes - memory.budget
      print(f"  --memory_budget_mib {memory.budget / 2**20:,.2f} MiB bounds the plan's count: "
            + (f"{-over:,} B to spare" if over <= 0 else f"OVER by {over:,} B"))
  if low.auto_plan is not None:
    print(low.auto_plan)
  print("variables:")
  for r in low.report.state:
    print(f"  {r.name:48s} {str(list(r.shape)):18s} {r.sharding:32s} {r.bytes_per_device:>12,} B/device")
  print(low.report)
  pictures(low)
  return low


def pictures(low):
  """The plan's pictures the flags ask for: --report_html's page, --explore's Model Explorer."""
  if FLAGS.report_html:
    print(f"plan page written to {low.report.save_html(FLAGS.report_html)}", flush=True)
  if FLAGS.explore:
    low.explore(port=FLAGS.explore_port, open_browser=False)


def gpu_form(task):
  """Check and print the GPU form of the train step for a mesh of --mesh GPUs, without them."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  mesh = _mesh(task, FLAGS.mesh or task.default_mesh)
  with gs.plan_scope():
    model = task.build(mesh, plan_only=True)
  f = gs.function(model.step, mesh=mesh, **_shardings(task, mesh))
  form = gs.gpu_form(f, *[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in task.batch(0)])
  print(f"{task.name}: GPU form for mesh {dict(zip(mesh.axis_names, mesh.shape))}: {form.summary()}")
  for c in form.clusters:
    print(f"  {c.name}: {c.ops} ops, {len(c.all_reduces)} all-reduce(s) of groups {sorted({g for _, g in c.all_reduces})}"
          f", {c.arithmetic:,.0f} FLOPs per device")
  return form


def _shardings(task, mesh):
  """gs.function's in_shardings (and memory budget) per the flags: the task's specs, or "auto"."""
  if not FLAGS.auto:
    return {"in_shardings": task.in_specs(mesh)}
  budget = None if FLAGS.memory_budget_mib is None else math.ceil(FLAGS.memory_budget_mib * 2**20)
  return {"in_shardings": "auto", "memory_budget": budget}


def _summary(writer, step, values):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with writer.as_default():
    for k, v in values.items():
      tf.summary.scalar(k, v, step=step)


def run(task):
  """Train `task` per the flags; returns the list of (step, loss)."""
  if FLAGS.plan:
    plan(task)
    return []
  if FLAGS.gpu_form:
    gpu_form(task)
    return []
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  shape = FLAGS.mesh or task.default_mesh
  # One process with all the devices, or one of the workers python -m tf_gspmd.launch (or TF_CONFIG) starts.
  gs.initialize(cpu_devices=int(np.prod([int(s) for s in shape])))
  chief = gs.process_index() == 0
  mesh = _mesh(task, shape)
  model = task.build(mesh)
  step_var = tf.Variable(0, dtype=tf.int64, name="global_step")
  ckpt = tf.train.Checkpoint(step=step_var, **model.trackables)
  directory = os.path.join(FLAGS.logdir, task.name)
  checkpoints = os.path.join(directory, "checkpoints")
  # Every process makes the same save to the same directory: each writes the tiles it holds (once over all
  # processes), the chief merges them into one checkpoint.
  manager = tf.train.CheckpointManager(ckpt, checkpoints, max_to_keep=3)
  latest = tf.train.latest_checkpoint(checkpoints)
  if FLAGS.resume and latest:
    ckpt.restore(latest).assert_existing_objects_matched()
    print(f"resumed from {latest} at step {int(step_var.numpy())}")
  train = gs.function(model.step, mesh=mesh, jit_compile=FLAGS.jit, exchange=FLAGS.exchange, **_shardings(task, mesh))
  writer = tf.summary.create_file_writer(directory) if chief else tf.summary.create_noop_writer()
  first = int(step_var.numpy())
  if first >= FLAGS.steps:
    print(f"nothing to train: the checkpoint is at step {first} and --steps={FLAGS.steps}; give a larger --steps to "
          "continue")
  bar = keras.utils.Progbar(FLAGS.steps, verbose=1 if sys.stdout.isatty() else 0)
  losses = []
  trace = [int(s) for s in FLAGS.profile]
  for k in range(first, FLAGS.steps):
    if k == FLAGS.crash_at_step and os.environ.get("TF_GSPMD_RESTART", "0") == "0" and \
        gs.process_index() == gs.process_count() - 1:
      print(f"fault drill: process {gs.process_index()} kills itself as step {k} starts", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    batch = task.batch(k)
    if trace and k == trace[0]:
      tf.profiler.experimental.start(os.path.join(directory, "profile"))
    start = time.perf_counter()
    loss = float(np.asarray(train(*batch)))
    took = time.perf_counter() - start
    if trace and k == trace[-1]:
      tf.profiler.experimental.stop()
      print(f"profile of steps {trace[0]}-{k} written to {os.path.join(directory, 'profile')}")
    losses.append((k, loss))
    print(f"step {k} loss {loss:.6f} time {took * 1e3:.0f} ms", flush=True)
    bar.update(k + 1, [("loss", loss)])
    _summary(writer, k, {"loss": loss, "step_time_s": took, f"{task.unit}_per_second": task.per_step / took})
    step_var.assign(k + 1)
    if FLAGS.ckpt_every and (k + 1) % FLAGS.ckpt_every == 0:
      manager.save(checkpoint_number=k + 1)
  writer.flush()
  if losses:
    low = train.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in task.batch(0)])
    crossing = (f", {low.report.cross_process_bytes_per_device():,} B/device across processes"
                if gs.process_count() > 1 else "")
    print(f"collectives per step: {low.report.counts()}, {low.report.bytes_per_device():,} B/device{crossing}")
    print("runtime: " + ("one graph per process" if low.program.in_process is not None else
                         "each device's program on its own thread, TF's collectives"))
    if low.auto_plan is not None:
      print(low.auto_plan)
    pictures(low)
  if FLAGS.check_steps and first == 0 and losses:
    check(task, [l for _, l in losses[:FLAGS.check_steps]])
  return losses


def check(task, partitioned):
  """The first steps again, unpartitioned from the same initial values: the losses must agree."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  model = task.build(None)
  step = tf.function(model.step)
  ref = [float(step(*[tf.constant(a) for a in task.batch(k)]).numpy()) for k in range(len(partitioned))]
  _compare(partitioned, ref)


def _compare(partitioned, ref):
  rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(partitioned, ref))
  ok = rel <= 1e-4
  print(f"check: first {len(ref)} losses {'match' if ok else 'DIFFER FROM'} the unpartitioned program "
        f"(max relative difference {rel:.1e})")
  if not ok:
    raise SystemExit(f"partitioned losses {partitioned} != unpartitioned {ref}")
