"""The GSPMD paper's scale, planned on this machine: the training binaries' --plan at full model sizes, no devices.

Each row runs one binary (`examples/train_transformer.py`, `examples/train_moe.py`) with --plan in a fresh
process: the model is built shape-only (`gs.plan_scope()`), the train step is lowered for the mesh from
TensorSpecs, and the binary prints its plan. From that output and the process's resource usage the table gives:
lowering time (the binary's `lowered in`), the process's wall time and peak resident set, and per device the
weights, the optimizer state, the activations live at the estimated peak and the constants of the per-device
program, the collectives and their bytes per step (loops counted per iteration times their trip count).
Weights per device are checked against the layout's arithmetic (`weight_bytes`; docs/performance.md "The paper's
scale").

Configs (Lingvo's GShard dense LMs, lingvo/tasks/lm/params/synthetic_packed_input.py):
  dense128b  DenseLm128B32x32: 64 layers, d_model 8192, d_ff 65536, 128 heads, seq 1024, batch 512, mesh (32, 64)
  dense1t    DenseLm1T16x16: 128 layers, d_model 16384, d_ff 131072, 256 heads, seq 512, batch 16, mesh (16, 32)
each in the Megatron and the 2D layout (--layout); the 2048-expert MoE on (2048,); the 128B dims as a GSPMD
pipeline of 16 stages (4 layers each, Megatron inside a stage) and 16 microbatches on (16, 16, 8). Sweeps:
lowering time from 8 to 2048 devices (2 layers at the 128B dims) and from d_model 1024 to 8192 (8 layers,
d_ff = 8 d_model, 64 heads, mesh (32, 64)).

  .venv/bin/python bench/scale.py [--only dense128b,moe,pipeline,devices,width] [--layers N]
"""

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONWARNINGS="ignore")
VOCAB = 32000
DENSE = {
    "dense128b": dict(layers=64, d_model=8192, d_ff=65536, heads=128, seq_len=1024, batch=512, mesh=(32, 64)),
    "dense1t": dict(layers=128, d_model=16384, d_ff=131072, heads=256, seq_len=512, batch=16, mesh=(16, 32)),
}


def weight_bytes(cfg, layout, mesh):
  """Per-device bytes of the transformer's float32 weights in `layout` on mesh (X, Y) = (data, model), by
  arithmetic: what each variable's spec (examples/transformer_model.py) leaves on one device.

  megatron: embedding, positions, layer norms and the biases of d_model width replicated; attention's q/k/v/o and
            the MLP's matrices, their head and hidden biases and the vocabulary head split over Y.
  2d:       every matrix over X*Y (d_model over X, the other dim over Y); every vector, and the position table,
            over Y.
  """
  x, y = mesh
  m, h, v, s, n = cfg["d_model"], cfg["d_ff"], VOCAB, cfg["seq_len"], cfg["layers"]
  if layout == "megatron":
    per_layer = 4 * m + 3 * m * m / y + 3 * m / y + m * m / y + m + m * h / y + h / y + h * m / y + m
    rest = v * m + s * m + 2 * m + m * v / y + v / y
  else:
    per_layer = 4 * m / y + 4 * m * m / (x * y) + 3 * m / y + m / y + 2 * m * h / (x * y) + h / y + m / y
    rest = v * m / (x * y) + s * m / y + 2 * m / y + m * v / (x * y) + v / y
  return 4 * (n * per_layer + rest)


def _number(pattern, text, cast=int):
  m = re.search(pattern, text)
  return cast(m.group(1).replace(",", "")) if m else None


def run(argv):
  """Runs one binary with --plan: (its output, wall seconds, peak RSS bytes)."""
  start = time.perf_counter()
  proc = subprocess.Popen([sys.executable] + argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  out = proc.stdout.read()
  _, status, usage = os.wait4(proc.pid, 0)
  wall = time.perf_counter() - start
  if status != 0:
    tail = "\n".join(out.splitlines()[-15:])
    raise RuntimeError(f"{' '.join(argv)} failed:\n{tail}")
  return out, wall, usage.ru_maxrss * 1024


def measure(argv):
  out, wall, rss = run(argv)
  return {
      "lower_s": _number(r"lowered in ([\d.]+) s", out, float), "wall_s": wall, "rss": rss,
      "weights": _number(r"weight variables: ([\d,]+) B per device", out),
      "state": _number(r"update state variables: ([\d,]+) B per device", out),   # optimizer slots, counters
      "activations": _number(r"peak memory [\d,]+ B per device \(estimate\):.*?live activations ([\d,]+)", out),
      "constants": _number(r"(?m)^constants: ([\d,]+) B per device", out),
      # collective ops run per step (a loop's once per iteration) and the bytes they send per device per step
      "collectives": _number(r"collective\(s\), ([\d,]+) run per step", out) or _number(
          r"([\d,]+) collective\(s\), [\d,]+ bytes per device", out),
      "bytes": _number(r"([\d,]+) bytes per device", out),
  }


def transformer_argv(cfg, layout, mesh=None):
  mesh = mesh or cfg["mesh"]
  return ["examples/train_transformer.py", "--plan", f"--layout={layout}", f"--plan_mesh={mesh[0]},{mesh[1]}",
          f"--vocab={VOCAB}"] + [f"--{k}={cfg[k]}" for k in ("layers", "d_model", "d_ff", "heads", "seq_len", "batch")]


def gib(b):
  return f"{b / 2**30:,.2f}" if b is not None else "?"


def mib(b):
  return f"{b / 2**20:,.2f}" if b is not None else "?"


HEADER = (f"{'program':34s} {'mesh':>10s} {'lower s':>8s} {'wall s':>7s} {'RSS GiB':>8s} {'weights MiB':>12s} "
          f"{'arith MiB':>10s} {'Adam MiB':>10s} {'act. GiB':>9s} {'const KiB':>10s} {'colls':>6s} {'GiB/step':>9s}")


def row(name, mesh, r, arithmetic=None):
  slots = r["state"]
  const = f"{r['constants'] / 1024:,.1f}" if r["constants"] is not None else "?"
  print(f"{name:34s} {'x'.join(map(str, mesh)):>10s} {r['lower_s'] or 0:8.1f} {r['wall_s']:7.1f} {gib(r['rss']):>8s} "
        f"{mib(r['weights']):>12s} {mib(arithmetic):>10s} {mib(slots):>10s} {gib(r['activations']):>9s} {const:>10s} "
        f"{r['collectives'] or 0:6d} {gib(r['bytes']):>9s}", flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--only", default="dense128b,dense1t,moe,pipeline,devices,width")
  parser.add_argument("--layers", type=int, default=None, help="override the dense configs' layer count")
  args = parser.parse_args()
  only = set(args.only.split(","))
  print(HEADER)
  for name, cfg in DENSE.items():
    if name not in only:
      continue
    cfg = dict(cfg, layers=args.layers or cfg["layers"])
    for layout in ("megatron", "2d"):
      r = measure(transformer_argv(cfg, layout))
      row(f"{name} {layout} ({cfg['layers']} layers)", cfg["mesh"], r, weight_bytes(cfg, layout, cfg["mesh"]))
  if "moe" in only:
    row("moe 2048 experts", (2048,), measure(["examples/train_moe.py", "--plan", "--experts=2048",
                                              "--plan_mesh=2048"]))
  if "pipeline" in only:
    cfg = dict(DENSE["dense128b"], layers=64)
    argv = transformer_argv(cfg, "megatron", (16, 16, 8))
    argv = [a for a in argv if not a.startswith(("--layout", "--plan_mesh"))]
    row("pipeline 128b, 16 stages x 16 microb.", (16, 16, 8), measure(
        argv + ["--plan_mesh=16,16,8", "--pipeline_stages=16", "--microbatches=16"]))
  if "devices" in only:
    cfg = dict(DENSE["dense128b"], layers=2)
    for mesh in ((2, 4), (4, 16), (16, 16), (32, 64)):
      row(f"128b dims, 2 layers, 2d", mesh, measure(transformer_argv(cfg, "2d", mesh)),
          weight_bytes(cfg, "2d", mesh))
  if "width" in only:
    for width in (1024, 2048, 4096, 8192):
      cfg = dict(DENSE["dense128b"], layers=8, d_model=width, d_ff=8 * width, heads=64)   # heads split evenly
      row(f"d_model {width}, 8 layers, 2d", (32, 64), measure(transformer_argv(cfg, "2d")),
          weight_bytes(cfg, "2d", (32, 64)))


if __name__ == "__main__":
  main()
