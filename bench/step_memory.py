"""Peak memory of a training step per device: the memory pass's estimate next to a measurement.

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

  .venv/bin/python bench/step_memory.py [--only transformer]
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
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


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--only", default="", help="transformer or moe (default: both)")
  args = parser.parse_args()
  env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
  rows = []
  for program in ("transformer", "moe"):
    if args.only and program != args.only:
      continue
    for mesh in ("1", "2,4", "8"):
      out = subprocess.run([sys.executable, "-c", CHILD, program, mesh, ROOT], cwd=ROOT, env=env,
                           capture_output=True, text=True)
      if out.returncode:
        raise SystemExit(f"{program} on mesh {mesh} failed:\n{out.stderr[-4000:]}")
      rows.append((program, mesh, json.loads(out.stdout.strip().splitlines()[-1])))
  mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
  print("peak memory per device, MiB. measured: process-level peak RSS during one step above the RSS before the "
        "arguments and variables existed, divided by the number of devices; step growth: what the step added to "
        "the RSS it started from, divided likewise")
  head = ("program", "mesh", "estimate", "of which args+state", "measured", "step growth", "unpart. estimate",
          "unpart. measured")
  table = []
  for program, mesh, r in rows:
    whole = next(x for p, m, x in rows if p == program and m == "1")
    table.append((program, "unpartitioned" if mesh == "1" else f"({mesh})", mib(r["est"]), mib(r["est_persistent"]),
                  mib(r["measured"]), mib(r["growth"]), mib(whole["est"]), mib(whole["measured"])))
  widths = [max(len(x) for x in col) for col in zip(head, *table)]
  for row in [head] + table:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
  main()
