"""End-to-end check of the GPU path: reference programs partitioned over GPUs and compiled by XLA, each compared
with the same function run unpartitioned on one device (sized for 8 minutes on one H100; --time_budget stops it).

  python tools/gpu_check.py              # GPUs (one GPU is split into --logical_gpus devices)
  python tools/gpu_check.py --dry_run    # no GPU needed: plans every program for a GPU mesh, runs it on CPUs
  python tools/gpu_check.py --cpu        # the checks on 8 logical CPU devices

Programs: the ten workloads (bench/workloads.py) on meshes of their axes over the check's devices ((n // 2, 2) or
(n,)), the 4-layer Megatron training step (examples/transformer_model.py) and a small keras-hub Gemma train step
(built from its constructor, laid out by its own layout map; skipped without keras_hub), each with
jit_compile=True (XLA clusters, summing all-reduces inside where the library puts them) and "segments" (every
collective between clusters). Logical GPUs sharing one GPU cannot use NCCL: their collectives carry the hint "ring"
and stay between clusters. The table: program, mode, devices, `low.program.jit`, collective counts, the hints
(inside XLA | outside), first call and median step time, TF DTensor's step time with the same layouts (MLP and
transformer steps), and the largest error (tolerance 2e-4 + 2e-3 |expected|).

Each unit (a program in one mode, its GPU plan, its DTensor step) runs in a worker process; after a unit that
raised (TF aborts a process's collectives once one fails), hung (--unit_timeout) or crashed, a fresh worker goes on
from the next. The exit status is non-zero when a result differs or a unit (DTensor's aside) failed or did not run.
--dry_run (GPUs hidden) lowers every program in both modes for a planned mesh of GPUs, checks its GPU form
(gs.gpu_form) and runs it on CPUs against one device, then runs every program on --logical_gpus CPU devices.
"""

import collections
import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any, Optional, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
import numpy as np  # noqa: E402

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
for _path in ("", "examples", "bench"):
  sys.path.insert(0, os.path.join(_ROOT, _path))

import workloads as reference  # noqa: E402  (bench/workloads.py; it defines an --only flag, redefined below)

flags.DEFINE_bool("dry_run", False, "No GPU: plan every program for a GPU mesh and run it on logical CPU devices.")
flags.DEFINE_bool("cpu", False, "Run the checks on 8 logical CPU devices instead of GPUs.")
flags.DEFINE_integer("logical_gpus", 4, "Logical GPUs to split a single GPU into (and CPU devices a dry run uses).",
                     lower_bound=2, upper_bound=4)
flags.DEFINE_integer("memory_limit", 16384, "MiB of GPU memory per logical GPU when one GPU is split.")
flags.DEFINE_integer("steps", 5, "Timed steps per program and mode.")
flags.DEFINE_bool("gpu_form_run", True, "In a dry run, also run each GPU form (gs.gpu_form) on the CPU devices and "
                  "compare it with one device.")
flags.DEFINE_integer("time_budget", 420, "Seconds after which the check stops (the unit running and those not yet "
                     "run are reported as failures), so that it ends within its slot.")
flags.DEFINE_integer("unit_timeout", 180, "Seconds a unit (a program in one mode, its plan, or its DTensor step; a "
                     "fresh process's start counts into its first unit) may run before its process is killed as hung.")
flags.DEFINE_integer("child_start", -1, "Internal: the unit a worker process starts from (-1: the parent process).")
flags.DEFINE_list("only", [], "Run only these programs (workload names, transformer_train_step, "
                  "keras_hub_gemma_train_step); a dry run still plans all of them for GPUs.", allow_override=True)
FLAGS = flags.FLAGS

MODES = (True, "segments")
GPU_NAME = "/job:localhost/replica:0/task:0/device:GPU:{}"
DTENSOR_PROGRAMS = ("mlp_train_step", "transformer_train_step")
ATOL, RTOL = 2e-4, 2e-3
HEAD = ("program", "mode", "devices", "jit", "collectives", "hints (in XLA | outside)", "first call s", "step ms",
        "DTensor ms", "max error", "result")


@dataclasses.dataclass
class Program:
  name: str
  fn: Any
  args: list                        # numpy arrays
  in_shardings: tuple
  out_shardings: Any
  axes: Tuple[str, ...]             # mesh axis names the shardings use
  skipped: Optional[str] = None     # why the program cannot be built here


def _programs(tf):
  """The programs to check, in order; one that cannot be built comes with `skipped` saying why."""
  try:
    for name, fn, mesh, ins, outs, args, _ in reference.workloads():
      yield Program(name, fn, list(args), tuple(ins), outs, mesh.axis_names)
  except Exception as e:  # pylint: disable=broad-except
    yield Program("reference workloads", None, [], (), None, (), skipped=f"ERROR building them: {_first_line(e)}")
  try:
    import transformer_model as tm  # pylint: disable=g-import-not-at-top
    fn, args, specs = tm.megatron_train_args(tm.Config(layers=4))
    yield Program("transformer_train_step", fn, list(args), tuple(specs), None, ("data", "model"))
  except Exception as e:  # pylint: disable=broad-except
    yield Program("transformer_train_step", None, [], (), None, (), skipped=f"ERROR building it: {_first_line(e)}")
  try:
    yield _keras_hub_program(tf)
  except Exception as e:  # pylint: disable=broad-except
    yield Program("keras_hub_gemma_train_step", None, [], (), None, (),
                  skipped=f"ERROR building it: {_first_line(e)}")


def _keras_hub_program(tf):
  """A small keras-hub Gemma causal LM's SGD step, its weights as arguments (`stateless_call`) laid out by
  GemmaBackbone's layout map."""
  name = "keras_hub_gemma_train_step"
  try:
    import keras  # pylint: disable=g-import-not-at-top
    import keras_hub  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return Program(name, None, [], (), None, (), skipped=f"keras_hub not importable ({e})")
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top
  vocab, seq, batch = 96, 12, 8
  keras.utils.set_random_seed(3)
  backbone = keras_hub.models.GemmaBackbone(vocabulary_size=vocab, num_layers=1, num_query_heads=4,
                                            num_key_value_heads=4, hidden_dim=40, intermediate_dim=56, head_dim=12)
  lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
  trainable, fixed = list(lm.trainable_variables), list(lm.non_trainable_variables)
  # The layout map only names mesh axes per dimension: a one-device keras mesh with the check's axis names.
  device_mesh = keras.distribution.DeviceMesh((1, 1), ["data", "model"], np.array([["cpu:0"]]))
  layout_map = keras_hub.models.GemmaBackbone.get_layout_map(device_mesh, model_parallel_dim_name="model",
                                                             data_parallel_dim_name="data")

  def spec(variable):
    layout = layout_map[variable.path]
    return P(*layout.axes) if layout is not None else P()

  def train_step(token_ids, padding_mask, targets, *weights):
    train_w, fixed_w = list(weights[:len(trainable)]), list(weights[len(trainable):])
    with tf.GradientTape() as tape:
      tape.watch(train_w)
      logits, _ = lm.stateless_call(train_w, fixed_w, {"token_ids": token_ids, "padding_mask": padding_mask})
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))
    grads = tape.gradient(loss, train_w)
    return [w - 0.01 * g for w, g in zip(train_w, grads)] + [loss]

  tokens = np.random.default_rng(0).integers(1, vocab, (batch, seq + 1)).astype(np.int32)
  args = [tokens[:, :-1], np.ones((batch, seq), bool), tokens[:, 1:]] + [np.asarray(v.numpy()) for v in
                                                                         trainable + fixed]
  specs = (P("data", None),) * 3 + tuple(spec(v) for v in trainable + fixed)
  return Program(name, train_step, args, specs, None, ("data", "model"))


def _devices(tf):
  """(device names the checks run on, "GPU" or "CPU"), configured before TensorFlow initialises its devices."""
  if FLAGS.dry_run or FLAGS.cpu:
    tf.config.set_visible_devices([], "GPU")
    import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
    names = gs.split_cpu_devices(8)
    return names[:FLAGS.logical_gpus] if FLAGS.dry_run else names[:8], "CPU"
  gpus = tf.config.list_physical_devices("GPU")
  if not gpus:
    raise SystemExit("no GPU visible to TensorFlow; run with --dry_run (no GPU needed) or --cpu")
  if len(gpus) == 1:
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=FLAGS.memory_limit)] * FLAGS.logical_gpus)
  return [d.name for d in tf.config.list_logical_devices("GPU")], "GPU"


def _mesh(gs, axes, devices):
  """A mesh with axis names `axes` over `devices`: (n,) for one axis, (n // 2, 2) for two (n odd: (n, 1))."""
  n = len(devices)
  if len(axes) == 1:
    shape = (n,)
  elif len(axes) == 2:
    shape = (n // 2, 2) if n % 2 == 0 else (n, 1)
  else:
    raise ValueError(f"no mesh shape for axes {axes}")
  return gs.Mesh(shape, tuple(axes), devices=list(devices))


def _specs(tf, args):
  return [tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in args]


def _error(got, want):
  """(largest |got - want|, largest ratio of it to the tolerance ATOL + RTOL |want|)."""
  if len(got) != len(want):
    return float("inf"), float("inf")
  err, ratio = 0.0, 0.0
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    if g.shape != w.shape:
      return float("inf"), float("inf")
    if g.size:
      diff = np.abs(g - w)
      err = max(err, float(np.max(diff)))
      ratio = max(ratio, float(np.max(diff / (ATOL + RTOL * np.abs(w)))))
  return err, ratio


def _hints(low):
  """The communication hints of the per-device program's collectives, inside XLA clusters | between them."""
  gd = low.graph_def
  whole = low.program.jit == "whole"
  compiled = {n.attr["f"].func.name for n in gd.node
              if "_XlaMustCompile" in n.attr and n.attr["_XlaMustCompile"].b and "f" in n.attr}
  inside, outside = collections.Counter(), collections.Counter()

  def hint(node):
    return node.attr["communication_hint"].s.decode() if "communication_hint" in node.attr else "?"

  for n in gd.node:
    if n.op.startswith("Collective"):
      (inside if whole else outside)[hint(n)] += 1
  for fdef in gd.library.function:
    for n in fdef.node_def:
      if n.op.startswith("Collective"):
        (inside if whole or fdef.signature.name in compiled else outside)[hint(n)] += 1

  text = lambda counter: ", ".join(f"{k} {h}" for h, k in sorted(counter.items())) or "-"  # noqa: E731
  return f"{text(inside)} | {text(outside)}"


def _counts(low):
  return ", ".join(f"{n} {k}" for k, n in sorted(low.report.counts().items())) or "none"


def _mode_name(mode):
  return f"jit={mode}"


def _first_line(e):
  text = str(e).strip()
  return f"{type(e).__name__}: {text.splitlines()[0][:150] if text else ''}"


def _placed(gs, mesh, args, ins):
  """The arguments laid out on `mesh` (their shards on its devices), so that timed steps move no input."""
  place = gs.function(lambda *a: tuple(a), mesh=mesh, in_shardings=tuple(ins), out_shardings=tuple(ins),
                      jit_compile=False, collective_timeout=60)
  return list(place(*args))


def _unpartitioned(tf, fn, args, device):
  with tf.device(device):
    out = tf.function(fn)(*[tf.constant(a) for a in args])
  return [np.asarray(t) for t in tf.nest.flatten(out)]


def _dtensor_mesh(tf, devices, kind, shape):
  """A DTensor mesh ("data", "model") of `shape` over `devices`, its device started (before any other program
  runs); or the reason there is none."""
  try:
    from tensorflow.experimental import dtensor  # pylint: disable=g-import-not-at-top
    dmesh = dtensor.create_mesh(list(zip(("data", "model"), shape)), devices=list(devices[:int(np.prod(shape))]),
                                device_type=kind)
    dtensor.copy_to_mesh(tf.zeros([]), dtensor.Layout.replicated(dmesh, rank=0))
    return dtensor, dmesh
  except Exception as e:  # pylint: disable=broad-except
    return None, f"no DTensor mesh: {_first_line(e)}"


def _dtensor_step(tf, dtensor, dmesh, program, want):
  """(median ms of one TF DTensor step of the program with the same layouts, as table text; whether an attempt
  raised). XLA on, else off; the result is checked as bench/runtime.py's DTensor calls check it."""
  def layout(spec, rank):
    dims = list(spec) + [None] * (rank - len(spec))
    return dtensor.Layout([d if d else dtensor.UNSHARDED for d in dims], dmesh)

  placed = []
  for a, s in zip(program.args, program.in_shardings):
    t = tf.constant(a)
    placed.append(dtensor.relayout(dtensor.copy_to_mesh(t, layout((), t.shape.rank)), layout(tuple(s), t.shape.rank)))
  raised = False
  for jit in (True, False):
    f = tf.function(program.fn, jit_compile=jit)
    try:
      out = tf.nest.flatten(f(*placed))
      got = []
      for t in out:
        replicated = dtensor.Layout.replicated(dtensor.fetch_layout(t).mesh, rank=t.shape.rank)
        got.append(dtensor.unpack(dtensor.relayout(t, replicated))[0].numpy())
    except Exception as e:  # pylint: disable=broad-except
      print(f"  DTensor {program.name} with XLA {'on' if jit else 'off'}: {_first_line(e)}", flush=True)
      raised = True
      continue
    if _error(got, want)[1] > 1.0:
      return "differs" + ("" if jit else " (XLA off)"), raised
    times = []
    for _ in range(FLAGS.steps):
      start = time.perf_counter()
      tf.nest.flatten(f(*placed))[-1].numpy()
      times.append(time.perf_counter() - start)
    return f"{np.median(times) * 1e3:.1f}" + ("" if jit else " (XLA off)"), raised
  return "fails", raised


def _row(program, mode, devices, **cols):
  row = dict.fromkeys(HEAD, "-")
  row.update(program=program, mode=mode, devices=devices, failed=False, raised=False)
  row.update({k.replace("_", " "): v for k, v in cols.items()})
  return row


def _lowered_cols(low):
  return {"jit": str(low.program.jit), "collectives": _counts(low), "hints (in XLA | outside)": _hints(low)}


class _Context:
  """What the units of one process share: its devices, the unpartitioned results and laid-out arguments of the
  program at hand, the DTensor mesh."""

  def __init__(self, tf, gs, devices, kind):
    self.tf, self.gs, self.devices, self.kind = tf, gs, devices, kind
    self._program, self._want, self._placed = None, None, None
    self.dtensor = (None, "not set up")

  def want(self, program):
    """The unpartitioned function's results on the first device (computed once per program)."""
    if self._program is not program:
      self._program, self._want, self._placed = program, None, None
    if self._want is None:
      self._want = _unpartitioned(self.tf, program.fn, program.args, self.devices[0])
    return self._want

  def placed(self, program, mesh):
    """The arguments laid out on `mesh` (computed once per program)."""
    self.want(program)
    if self._placed is None:
      self._placed = _placed(self.gs, mesh, program.args, program.in_shardings)
    return self._placed


def _units(program):
  """The units of work of a program, in order: (kind, mode)."""
  if program.skipped:
    return [("skipped", None)]
  units = [("plan", mode) for mode in MODES] if FLAGS.dry_run else []
  if not FLAGS.only or program.name in FLAGS.only:
    units += [("run", mode) for mode in MODES]
    if program.name in DTENSOR_PROGRAMS:
      units.append(("dtensor", None))
  return units


def _plan_unit(ctx, program, mode):
  """The program lowered for a planned GPU mesh (no GPU needed). Where the library has gs.gpu_form, the GPU form is
  checked and, for a program that runs, run on the CPU devices (its clusters that hold collectives in TF's executor)
  and compared with the unpartitioned function."""
  tf, gs = ctx.tf, ctx.gs
  n = FLAGS.logical_gpus
  mesh = _mesh(gs, program.axes, [GPU_NAME.format(k) for k in range(n)])
  row = _row(program.name, _mode_name(mode), f"GPU plan x{n} {mesh.shape}")
  specs = _specs(tf, program.args)
  options = dict(in_shardings=program.in_shardings, out_shardings=program.out_shardings, jit_compile=mode,
                 collective_timeout=60)
  try:
    low = gs.function(program.fn, mesh=mesh, **options).lower(*specs)
  except Exception as e:  # pylint: disable=broad-except
    return _error_row(row, e, raised=False)
  row.update(_lowered_cols(low), result="planned")
  try:
    form = gs.gpu_form(gs.function(program.fn, mesh=_mesh(gs, program.axes, ctx.devices), **options), *specs)
    print(f"  gpu_form {program.name} {row['mode']}: {form.summary()}", flush=True)
  except Exception as e:  # pylint: disable=broad-except
    row.update(failed=True, result=f"planned; GPU FORM CHECK FAILED {_first_line(e)}")
    return row
  row["result"] = "planned, GPU form checked"
  if not FLAGS.gpu_form_run or FLAGS.only and program.name not in FLAGS.only:
    return row
  try:
    want = ctx.want(program)
    got = [np.asarray(t.numpy()) for t in tf.nest.flatten(form.run(*program.args))]
  except Exception as e:  # pylint: disable=broad-except
    row.update(failed=True, raised=True, result=f"GPU form checked; its run on CPUs: ERROR {_first_line(e)}")
    return row
  err, ratio = _error(got, want)
  row.update({"max error": f"{err:.1e}", "failed": ratio > 1.0, "result": "GPU form checked; its run on CPUs " + (
      f"MISMATCH ({ratio:.1f}x tolerance)" if ratio > 1.0 else "matches")})
  return row


def _run_unit(ctx, program, mode):
  """The program run partitioned on the check's devices, compared with the unpartitioned function."""
  tf, gs = ctx.tf, ctx.gs
  mesh = _mesh(gs, program.axes, ctx.devices)
  row = _row(program.name, _mode_name(mode), f"{ctx.kind} x{len(ctx.devices)} {mesh.shape}")
  try:
    want = ctx.want(program)
    placed = ctx.placed(program, mesh)
    f = gs.function(program.fn, mesh=mesh, in_shardings=program.in_shardings, out_shardings=program.out_shardings,
                    jit_compile=mode, collective_timeout=60)
    start = time.perf_counter()
    got = [np.asarray(t.numpy()) for t in tf.nest.flatten(f(*placed))]
    first = time.perf_counter() - start
    low = f.lower(*placed)   # the lowering the call ran (cached)
    times = []
    for _ in range(FLAGS.steps):
      start = time.perf_counter()
      tf.nest.flatten(f(*placed))[-1].numpy()
      times.append(time.perf_counter() - start)
  except Exception as e:  # pylint: disable=broad-except
    return _error_row(row, e)
  err, ratio = _error(got, want)
  row.update(_lowered_cols(low), **{"first call s": f"{first:.1f}", "step ms": f"{np.median(times) * 1e3:.1f}",
                                    "max error": f"{err:.1e}"})
  row.update(failed=ratio > 1.0, result=f"MISMATCH ({ratio:.1f}x tolerance)" if ratio > 1.0 else "matches")
  return row


def _dtensor_unit(ctx, program):
  """TF DTensor's step time for the program, same layouts, same devices (its "DTensor ms" column)."""
  mesh = _mesh(ctx.gs, program.axes, ctx.devices)
  row = _row(program.name, "DTensor", f"{ctx.kind} x{len(ctx.devices)} {mesh.shape}")
  module, dmesh = ctx.dtensor
  if module is None:
    row["result"] = dmesh
  elif tuple(dmesh.dim_size(a) for a in ("data", "model")) != tuple(mesh.shape):
    row["result"] = "other mesh"
  else:
    try:
      row["result"], row["raised"] = _dtensor_step(ctx.tf, module, dmesh, program, ctx.want(program))
    except Exception as e:  # pylint: disable=broad-except
      print(f"  DTensor {program.name}: {_first_line(e)}", flush=True)
      row.update(raised=True, result="fails")
  return row


def _error_row(row, e, raised=True):
  """The row of a unit that raised `e`; `raised`: it may have left TF's collectives aborted."""
  row.update(failed=True, raised=raised, result=f"ERROR {_first_line(e)}")
  return row


def _child(tf, gs, devices, kind):
  """Runs the units from --child_start on, one line per unit on stdout ("START <json>", then "ROW <json>"); ends
  after a unit that raised (TF aborts its collectives for the rest of a process after a failed one: the parent
  goes on in a fresh process), or after the last unit with "DONE"."""
  ctx = _Context(tf, gs, devices, kind)
  if not FLAGS.only or any(p in FLAGS.only for p in DTENSOR_PROGRAMS):   # DTensor's device first
    ctx.dtensor = _dtensor_mesh(tf, devices, kind, _mesh(gs, ("data", "model"), devices).shape)
  k = -1
  for program in _programs(tf):
    for unit, mode in _units(program):
      k += 1
      if k < FLAGS.child_start:
        continue
      print("START " + json.dumps({"unit": k, "kind": unit, "program": program.name,
                                   "mode": "DTensor" if unit == "dtensor" else _mode_name(mode)}), flush=True)
      if unit == "skipped":
        row = _row(program.name, "-", "-", result=f"skipped: {program.skipped}",
                   failed=program.skipped.startswith("ERROR"))
      elif unit == "plan":
        row = _plan_unit(ctx, program, mode)
      elif unit == "run":
        row = _run_unit(ctx, program, mode)
      else:
        row = _dtensor_unit(ctx, program)
      row.update(unit=k, kind=unit)
      print("ROW " + json.dumps(row), flush=True)
      if row["raised"]:
        sys.stdout.flush()
        os._exit(10)  # pylint: disable=protected-access
  print("DONE", flush=True)
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access


def _child_flags(first):
  return [f"--child_start={first}", f"--dry_run={FLAGS.dry_run}", f"--cpu={FLAGS.cpu}",
          f"--logical_gpus={FLAGS.logical_gpus}", f"--memory_limit={FLAGS.memory_limit}", f"--steps={FLAGS.steps}",
          f"--gpu_form_run={FLAGS.gpu_form_run}", f"--only={','.join(FLAGS.only)}"]


def _run_child(first, rows, start):
  """Runs the units from `first` on in a fresh process, adding their rows; returns the unit to go on from (None:
  all done, or nothing more can run)."""
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)] + _child_flags(first), stdout=subprocess.PIPE,
                          text=True, bufsize=1)
  lines = queue.Queue()

  def read():
    for line in proc.stdout:
      lines.put(line.rstrip("\n"))
    lines.put(None)

  threading.Thread(target=read, daemon=True).start()
  current, reported, done, last = None, False, False, time.perf_counter()
  while True:
    now = time.perf_counter()
    late = now - start > FLAGS.time_budget
    if late or now - last > FLAGS.unit_timeout:
      proc.kill()
      proc.wait()
      reason = (f"STOPPED: past the {FLAGS.time_budget} s time budget" if late else
                f"HUNG: no result within {FLAGS.unit_timeout} s, its process killed")
      if current is None:
        rows.append(_lost_row({"unit": first, "kind": "setup", "program": "(worker start)", "mode": "-"}, reason))
        return None
      if not reported:
        rows.append(_lost_row(current, reason))
      return current["unit"] + 1
    try:
      line = lines.get(timeout=1.0)
    except queue.Empty:
      continue
    if line is None:
      break
    if line.startswith("START "):
      current, reported, last = json.loads(line[len("START "):]), False, time.perf_counter()
    elif line.startswith("ROW "):
      rows.append(json.loads(line[len("ROW "):]))
      reported, last = True, time.perf_counter()
      _print_progress(rows[-1])
    elif line == "DONE":
      done = True
    else:
      print(line, flush=True)
  status = proc.wait()
  if done:
    return None
  if current is None:
    rows.append(_lost_row({"unit": first, "kind": "setup", "program": "(worker start)", "mode": "-"},
                          f"ERROR: the check's process exited with status {status} before its first unit"))
    return None
  if not reported:
    rows.append(_lost_row(current, f"CRASHED: its process exited with status {status}"))
  return current["unit"] + 1


def _lost_row(unit, reason):
  """The row of a unit that gave none (its process hung, crashed, or was stopped), printed."""
  dtensor = unit["kind"] == "dtensor"   # (its table text: one word)
  row = _row(unit["program"], unit["mode"], "-", result=reason.split(":")[0].lower() if dtensor else reason,
             failed=not dtensor)
  row.update(unit=unit["unit"], kind=unit["kind"])
  _print_progress(row)
  return row


def _what(row):
  """"<program> <mode> on <devices>", leaving out what is unknown."""
  return " ".join([row["program"]] + [row["mode"]] * (row["mode"] != "-") +
                  [f"on {row['devices']}"] * (row["devices"] != "-"))


def _print_progress(row):
  print(f"{_what(row)}: {row['result']}", flush=True)


def _print_table(rows):
  table = [tuple(str(r[h]) for h in HEAD) for r in rows]
  widths = [max(len(x) for x in col) for col in zip(HEAD, *table)]
  for row in [HEAD] + table:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def _parent():
  """Runs the units in child processes (a fresh one after a unit that raised, hung or crashed), prints the table and
  exits non-zero on any failure."""
  start = time.perf_counter()
  if FLAGS.dry_run:
    print(f"no GPU: dry run (checks this script's own set-up: every program planned for a GPU mesh of "
          f"{FLAGS.logical_gpus} devices, then run on {FLAGS.logical_gpus} logical CPU devices against one device)",
          flush=True)
  rows = []
  first, restarts = 0, 0
  while first is not None:
    if time.perf_counter() - start > FLAGS.time_budget:
      rows.append(_lost_row({"unit": first, "kind": "budget", "program": "(the units left)", "mode": "-"},
                            f"NOT RUN: past the {FLAGS.time_budget} s time budget"))
      break
    if first:
      restarts += 1
      print(f"(going on from unit {first} in a fresh process)", flush=True)
    first = _run_child(first, rows, start)
  timings = {r["program"]: r["result"] for r in rows if r.get("kind") == "dtensor"}
  table = [r for r in rows if r.get("kind") != "dtensor"]
  for r in table:
    if r.get("kind") == "run" and r["program"] in timings:
      r["DTensor ms"] = timings[r["program"]]
  failures = [_what(r) for r in rows if r["failed"]]
  print()
  print(f"tf_gspmd vs one device ({time.perf_counter() - start:.0f} s, {restarts} fresh process(es) after a failure):")
  _print_table(table)
  if failures:
    print(f"{len(failures)} check(s) failed: {'; '.join(failures)}")
    sys.exit(1)
  print("all checks passed")


def main(_):
  logging.set_verbosity(logging.WARNING)   # (DTensor logs its meshes at INFO)
  if FLAGS.child_start < 0:
    _parent()
    return
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  devices, kind = _devices(tf)
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  if FLAGS.child_start == 0:
    print(f"devices: {len(devices)} {kind} ({devices[0]} ... {devices[-1]}); TF {tf.__version__}; "
          f"{FLAGS.steps} timed steps; gs.gpu_form {'available' if hasattr(gs, 'gpu_form') else 'not available'}",
          flush=True)
  _child(tf, gs, devices, kind)


if __name__ == "__main__":
  app.run(main)
