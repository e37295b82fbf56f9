"""Lowering from shapes only: host memory and time of `f.lower(TensorSpec, ...)` by argument size.

Each row is a fresh process that builds one gs.function, lowers it from TensorSpecs alone (no tensor exists)
and reports the lowering's wall time, the process's peak resident set (`resource.getrusage` ru_maxrss) and how
far that peak rose above the resident set just before `lower()`, with the pass that took longest.

Programs: `w * 2.0`; an Adam-like update of three arguments (w, m, v); generators of the argument's shape
(`zeros_like`, `ones_like`, `fill`, `broadcast_to`, `zeros`); a 2-layer Megatron MLP train step (x[256, d]; per
layer w1[d, f] split on `model`, w2[f, d] split on `model`, f = 2d, 4d at 16 GiB; SGD); a 2-layer decoder-only
transformer's Adam step (examples/transformer_model.py, Megatron layout, parameters and both Adam slots as
arguments; d_ff = 8 d_model, 16 d_model at 16 GiB, so the 2 GiB row has the 128B model's dims, d_model 8192 and
d_ff 65536). Argument size: the bytes of the largest argument (w, or each MLP weight). Meshes: (2, 4) on 8
logical CPUs (the per-device passes run too) and the 2048-device (32, 64), planned without its devices.

  .venv/bin/python bench/lowering.py [--only mul,adam] [--sizes 8M,512M,2G,16G] [--meshes 2x4,32x64]
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
SIZES = {"8M": 8 << 20, "512M": 512 << 20, "2G": 2 << 30, "16G": 16 << 30}
PROGRAMS = ("mul", "adam", "generators", "mlp", "transformer")

CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "examples"))
import tensorflow as tf
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter import pipeline

program, nbytes, shape = sys.argv[1], int(sys.argv[2]), tuple(int(s) for s in sys.argv[3].split("x"))
if shape == (2, 4):
  gs.split_cpu_devices(8)
mesh = gs.Mesh(shape, ("data", "model"))
spec = P("data", "model")
cols = 16384 if nbytes >= 512 << 20 else 1024
w = tf.TensorSpec([nbytes // 4 // cols, cols])

if program == "mul":
  f = gs.function(lambda w: w * 2.0, mesh=mesh, in_shardings=spec)
  specs = [w]
elif program == "adam":
  def adam(w, m, v):
    g = 2.0 * w
    m = 0.9 * m + 0.1 * g
    v = 0.999 * v + 0.001 * g * g
    return w - 1e-3 * m / (tf.sqrt(v) + 1e-8), m, v
  f = gs.function(adam, mesh=mesh, in_shardings=(spec,) * 3)
  specs = [w] * 3
elif program == "generators":
  def generators(w):
    return (w + tf.zeros_like(w) + tf.ones_like(w) * tf.fill(tf.shape(w), 3.0) *
            tf.broadcast_to(tf.constant(2.0), tf.shape(w)) + tf.zeros(w.shape))
  f = gs.function(generators, mesh=mesh, in_shardings=spec)
  specs = [w]
elif program == "transformer":
  import transformer_model as tm
  d = 1
  while 32 * (2 * d) ** 2 <= nbytes:
    d *= 2
  cfg = tm.Config(layers=2, d_model=d, heads=max(d // 128, 4), d_ff=nbytes // 4 // d, seq=32, batch=16)
  names = sorted(tm.param_shapes(cfg))
  shapes, layout = tm.param_shapes(cfg), tm.megatron_specs(cfg)
  f = gs.function(tm.make_train_step(cfg, names), mesh=mesh,
                  in_shardings=[P(), P("data", None), P("data", None)] + [layout[k] for k in names] * 3)
  specs = [tf.TensorSpec([], tf.int32)] + [tf.TensorSpec([cfg.batch, cfg.seq], tf.int32)] * 2 + [
      tf.TensorSpec(shapes[k]) for k in names] * 3
else:
  d = 1
  while 8 * (2 * d) ** 2 <= nbytes:
    d *= 2
  ff = nbytes // 4 // d
  def step(x, *ws):
    with tf.GradientTape() as tape:
      tape.watch(ws)
      h = x
      for w1, w2 in zip(ws[::2], ws[1::2]):
        h = h + tf.nn.gelu(h @ w1) @ w2
      loss = tf.reduce_mean(tf.square(h))
    return [w - 0.1 * g for w, g in zip(ws, tape.gradient(loss, ws))] + [loss]
  layer = (P(None, "model"), P("model", None))
  f = gs.function(step, mesh=mesh, in_shardings=(P("data", None),) + layer * 2)
  specs = [tf.TensorSpec([256, d])] + [tf.TensorSpec([d, ff]), tf.TensorSpec([ff, d])] * 2

def rss():
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))

before = rss()
start = time.perf_counter()
low = f.lower(*specs)
took = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
slow = max(low.report.pass_times.items(), key=lambda kv: kv[1])
print(json.dumps({"seconds": took, "peak": peak, "growth": peak - before, "slowest": slow}))
"""


def child(program, nbytes, mesh, timeout):
  try:
    out = subprocess.run([sys.executable, "-c", CHILD, program, str(nbytes), mesh], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return None, f"over {timeout} s"
  if out.returncode:
    return None, (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1][:60]
  return json.loads(out.stdout.strip().splitlines()[-1]), ""


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--only", default=",".join(PROGRAMS))
  parser.add_argument("--sizes", default="8M,512M,2G,16G")
  parser.add_argument("--meshes", default="2x4,32x64")
  parser.add_argument("--timeout", type=int, default=900, help="seconds per row")
  args = parser.parse_args()
  header = ("program", "mesh", "argument", "lower s", "peak RSS MiB", "growth MiB", "slowest pass")
  rows = []
  for program in args.only.split(","):
    for mesh in args.meshes.split(","):
      for size in args.sizes.split(","):
        r, why = child(program, SIZES[size], mesh, args.timeout)
        label = f"({mesh.replace('x', ',')})"
        if r is None:
          rows.append((program, label, size, "-", "-", "-", why))
        else:
          rows.append((program, label, size, f"{r['seconds']:.2f}", f"{r['peak'] / 2**20:,.0f}",
                       f"{r['growth'] / 2**20:,.0f}", f"{r['slowest'][0]} {r['slowest'][1]:.2f} s"))
        print("  ".join(rows[-1]), file=sys.stderr, flush=True)
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  for row in (header,) + tuple(rows):
    print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
  main()
