"""Memory per device: creating large sharded variables, a narrow slice of a split variable, and training steps.

Three tables (`--only initializers|slice|steps`), each configuration in a fresh process (RSS only grows
within one) on 8 logical CPU devices.

initializers: process memory (RSS) for creating one variable f32[ROWS, COLS] split over all 8 devices with
gs.variable, by initializer: the RSS the creation added, the peak RSS above the start (VmHWM) and the peak's
ratio to the variable. Random shards are generated CHUNK_ELEMENTS at a time (tf_gspmd/initializers.py), so the
peak stays near the variable whatever the shard size.

slice: `v[:8, :8]` of that variable (split on dim 1) inside a gs.function: the bytes the emitted program moves
per device, and the peak RSS growth of the first call (trace, lowering and run) and of a later call, against
one shard of the variable.

steps: Peak memory of a training step per device: the memory pass's estimate next to a measurement.

Two steps: the 12-layer decoder-only transformer with Adam (examples/transformer_model.py, Megatron layout,
parameters and slots as arguments) and the GShard mixture-of-experts step (examples/train_moe.py, weights and
Adam slots as variables), each on meshes (2, 4) and (8,) of logical CPU devices and unpartitioned (one
tf.function on one device; its estimate is the same function lowered for a 1-device mesh).

Measured: TF cannot report allocator statistics for CPU devices (tf.config.experimental.get_memory_info does
not support them), so the figure is process-level: the process's peak resident set (VmHWM, reset through
/proc/self/clear_refs) during one step, above its resident set before the arguments and variables were
created, divided by the number of devices (all of a mesh's devices live in one process). Each configuration
runs in a fresh process with glibc's mmap threshold fixed at 64 KiB and malloc_trim before the measured step, so
freed buffers go back to the system and the high-water mark follows what is live. It also holds what the first
(warm-up) steps left behind: the imported graphs, kernels and their caches, which the estimate does not count.
"step growth" is the part the measured step itself added on top of what was resident just before it.

  .venv/bin/python bench/memory.py [--only steps] [--rows 8192 --cols 16384]
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Freed buffers go back to the system at once, so the high-water mark follows what is live.
ENV = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", TF_CPP_MIN_LOG_LEVEL="2")

INIT_CHILD = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
import tf_gspmd as gs
from tf_gspmd import P

def status(key):
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))

gs.split_cpu_devices(8)
mesh = gs.Mesh((8,), ("m",))
rows, cols, name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
I = gs.initializers
init = {"zeros": I.zeros(), "ones": I.ones(), "uniform": I.Uniform(seed=1), "normal": I.Normal(seed=1),
        "truncated_normal": I.Normal(seed=1, truncated=True), "glorot_uniform": I.glorot_uniform(seed=1),
        "glorot_normal": I.glorot_normal(seed=1), "he_normal": I.he_normal(seed=1),
        "keras_he_uniform": I.get("he_uniform", seed=1)}[name]
tf.zeros([8]).numpy()   # runtime up before the first reading
before = status("VmRSS")
v = gs.variable(init, [rows, cols], mesh=mesh, spec=P(None, "m"))
print(json.dumps({"added": status("VmRSS") - before, "peak": status("VmHWM") - before, "bytes": rows * cols * 4}))
"""

SLICE_CHILD = r"""
import ctypes, json, sys
import tensorflow as tf
import tf_gspmd as gs
from tf_gspmd import P

def status(key):
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))

def settle():
  ctypes.CDLL("libc.so.6").malloc_trim(0)
  with open("/proc/self/clear_refs", "w") as c:
    c.write("5")
  return status("VmRSS")

gs.split_cpu_devices(8)
mesh = gs.Mesh((8,), ("m",))
rows, cols = int(sys.argv[1]), int(sys.argv[2])
v = gs.variable(gs.initializers.Normal(seed=1), [rows, cols], mesh=mesh, spec=P(None, "m"))
f = gs.function(lambda: v[:8, :8], mesh=mesh)
before = settle()
first = f().numpy()
first_growth = status("VmHWM") - before
before = settle()
again = f().numpy()
growth = status("VmHWM") - before
assert (first == again).all()
print(json.dumps({"bytes": rows * cols * 4, "moved": f.lower().report.bytes_per_device(), "first": first_growth,
                  "growth": growth, "result": first.nbytes}))
"""

STEPS_CHILD = r"""
import ctypes, json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
sys.path.insert(0, os.path.join(sys.argv[3], "examples"))
import numpy as np
import tensorflow as tf
import tf_gspmd as gs
from tf_gspmd import P

LIBC = ctypes.CDLL("libc.so.6")


def status(key):
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))


def settle():
  LIBC.malloc_trim(0)
  return status("VmRSS")


def respec(spec, axes):
  keep = lambda d: d if d is None or all(a in axes for a in ((d,) if isinstance(d, str) else d)) else None
  return P(*[keep(d) for d in spec])


program, shape = sys.argv[1], tuple(int(s) for s in sys.argv[2].split(",")) if sys.argv[2] != "1" else ()
gs.split_cpu_devices(8)
tf.zeros([]).numpy()
if program == "transformer":
  import transformer_model as tm
  cfg = tm.Config(layers=12, d_model=256, heads=8, d_ff=1024, vocab=512, seq=64, batch=16)
  fn, args, specs = tm.megatron_train_args(cfg)
  axes = ("model",) if len(shape) == 1 else ("data", "model")
  specs = [respec(s, axes) for s in specs]
  make = lambda: (fn, [tf.constant(a) for a in args])
  arg_specs = [tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in args]
else:
  from absl import flags
  import train_moe
  flags.FLAGS(["moe", "--batch=32", "--seq_len=64", "--d_model=128", "--d_ff=512", "--experts=8", "--layers=2"])
  task = train_moe.task()
  axes = ("expert",) if len(shape) == 1 else ("data", "expert")
  specs = list(task.in_specs(None))
  batch = task.batch(0)
  arg_specs = [tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in batch]

n = int(np.prod(shape)) if shape else 1
# The estimate, before anything is measured (unpartitioned: the same step lowered for a mesh of one device).
mesh = gs.Mesh(shape or (1,) * len(axes), axes)
if program == "transformer":
  est = gs.function(fn, mesh=mesh, in_shardings=tuple(specs)).lower(*arg_specs).report.memory
else:
  plan = task.build(mesh, plan_only=True)
  est = gs.function(plan.step, mesh=mesh, in_shardings=tuple(specs)).lower(*arg_specs).report.memory
  del plan
baseline = settle()
if program == "transformer":
  if shape:
    f = gs.function(fn, mesh=mesh, in_shardings=tuple(specs))
    placed = [gs.function(lambda a: a, mesh=mesh, in_shardings=s, out_shardings=s)(a) for a, s in zip(args, specs)]
    call = lambda: tf.nest.flatten(f(*placed))[-1].numpy()
  else:
    with tf.device("/device:CPU:0"):
      f = tf.function(fn)
      placed = [tf.constant(a) for a in args]
    call = lambda: tf.nest.flatten(f(*placed))[-1].numpy()
else:
  model = task.build(mesh if shape else None)
  if shape:
    f = gs.function(model.step, mesh=mesh, in_shardings=tuple(specs))
    placed = [gs.function(lambda a: a, mesh=mesh, in_shardings=s, out_shardings=s)(a) for a, s in zip(batch, specs)]
  else:
    f = tf.function(model.step)
    placed = [tf.constant(a) for a in batch]
  call = lambda: np.asarray(f(*placed))
call()
call()
before = settle()
with open("/proc/self/clear_refs", "w") as c:
  c.write("5")
call()
hwm = status("VmHWM")
print(json.dumps({"devices": n, "est": est.peak_bytes, "est_persistent": est.argument_bytes + est.state_bytes +
                  est.constant_bytes, "measured": (hwm - baseline) / n, "growth": (hwm - before) / n}))
"""


def _child(code, *argv):
  out = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True)
  if out.returncode:
    raise SystemExit(f"{' '.join(argv)} failed:\n{out.stderr[-4000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _table(head, rows):
  widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
  for row in [head] + rows:
    print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
  print()


def mib(b):
  return f"{b / 2**20:,.1f}"


def initializers(args):
  rows = []
  for name in ("zeros", "ones", "uniform", "normal", "truncated_normal", "glorot_uniform", "glorot_normal",
               "he_normal", "keras_he_uniform"):
    r = _child(INIT_CHILD, str(args.rows), str(args.cols), name)
    rows.append((name, mib(r["bytes"]), mib(r["added"]), mib(r["peak"]), f"{r['peak'] / r['bytes']:.2f}"))
  print(f"creating f32[{args.rows},{args.cols}] split over 8 devices (MiB, whole process)")
  _table(("initializer", "variable", "RSS added", "peak added", "peak / variable"), rows)


def slice_pattern(args):
  r = _child(SLICE_CHILD, str(args.rows), str(args.cols))
  shard = r["bytes"] / 8
  print(f"v[:8, :8] of f32[{args.rows},{args.cols}] split on dim 1 over 8 devices (peak growth: whole process)")
  _table(("bytes moved / device", "shard MiB", "result B", "first call growth MiB", "later call growth MiB",
          "later growth / (shard + result)"),
         [(r["moved"], mib(shard), r["result"], mib(r["first"]), mib(r["growth"]),
           f"{r['growth'] / (shard + r['result']):.2f}")])


def steps(args):
  rows = []
  for program in ("transformer", "moe"):
    if args.program and program != args.program:
      continue
    for mesh in ("1", "2,4", "8"):
      rows.append((program, mesh, _child(STEPS_CHILD, program, mesh, ROOT)))
  print("peak memory per device, MiB. measured: process-level peak RSS during one step above the RSS before the "
        "arguments and variables existed, divided by the number of devices; step growth: what the step added to "
        "the RSS it started from, divided likewise")
  table = []
  for program, mesh, r in rows:
    whole = next(x for p, m, x in rows if p == program and m == "1")
    table.append((program, "unpartitioned" if mesh == "1" else f"({mesh})", mib(r["est"]), mib(r["est_persistent"]),
                  mib(r["measured"]), mib(r["growth"]), mib(whole["est"]), mib(whole["measured"]),
                  f"{r['est'] / r['measured']:.2f}", f"{r['est'] / whole['est']:.2f}"))
  _table(("program", "mesh", "estimate", "of which args+state", "measured", "step growth", "unpart. estimate",
          "unpart. measured", "estimate / measured", "estimate / unpart."), table)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--only", default="", help="initializers, slice or steps (default: all)")
  parser.add_argument("--program", default="", help="steps: transformer or moe (default: both)")
  parser.add_argument("--rows", type=int, default=8192)
  parser.add_argument("--cols", type=int, default=16384)
  args = parser.parse_args()
  for name, run in (("initializers", initializers), ("slice", slice_pattern), ("steps", steps)):
    if args.only in ("", name):
      run(args)


if __name__ == "__main__":
  main()
