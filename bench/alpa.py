"""The automatic two-level plan (gs.auto_parallel) against hand plans, on 8 logical CPUs.

  python bench/alpa.py                  # a transformer with a large vocabulary head, mesh (2, 4)

One training step (loss and gradients of every parameter, no optimizer update) per plan:
  data parallel     gs.function, batch split over all 8 devices, weights replicated
  Megatron          gs.function on (data, model): heads and MLP hidden over model, batch over data
  intra-op auto     gs.function with in_shardings="auto" (the integer program over the whole step)
  GSPMD pipeline    gs.pipeline over (stage, data) = (4, 2): the decoder blocks as stages (identical stages only;
                    the embedding and the head outside the pipeline)
  auto two-level    gs.auto_parallel: stages, submeshes and their intra-operator plans (an MPMD pipeline), or
                    the intra-operator plan alone when the planner prices no pipeline below it (then the
                    pipeline it turned down is run too, for its measured and predicted step)
For each: the measured step (median of --repeats after a warm-up), the predicted one where the library predicts it
(the planner's T*; for intra-op auto, the planner's price of the whole step as one stage on the whole mesh) and
memory per device (gs.function: the per-device program's estimated peak; auto two-level: the planner's count of
its largest stage: weights, gradients, 2 optimizer slots and the activations in flight). Prints a markdown table.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

import tf_gspmd as gs  # noqa: E402  pylint: disable=g-import-not-at-top
from tf_gspmd import P  # noqa: E402  pylint: disable=g-import-not-at-top


def _timed(fn, repeats):
  fn()   # warm-up: tracing, partitioning, lowering
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _grad_step(loss, names):
  def step(tokens, targets, *values):
    params = dict(zip(names, values))
    with tf.GradientTape() as tape:
      tape.watch(list(params.values()))
      value = loss(params, tokens, targets)
    return (value,) + tuple(tape.gradient(value, [params[k] for k in names]))
  return step


def _spmd_row(name, step, mesh, in_shardings, args, repeats, **kwargs):
  f = gs.function(step, mesh=mesh, in_shardings=in_shardings, **kwargs)
  seconds = _timed(lambda: [np.asarray(o) for o in f(*args)][0], repeats)
  low = f.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])
  return name, seconds, None, low.report.memory.peak_bytes, f(*args)[0]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d_model", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--d_ff", type=int, default=256)
  p.add_argument("--vocab", type=int, default=8192)
  p.add_argument("--seq", type=int, default=32)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--microbatches", type=int, default=4)
  p.add_argument("--repeats", type=int, default=5)
  a = p.parse_args()
  gs.split_cpu_devices(8)
  cfg = tm.Config(layers=a.layers, d_model=a.d_model, heads=a.heads, d_ff=a.d_ff, vocab=a.vocab, seq=a.seq,
                  batch=a.batch)
  names = sorted(tm.param_shapes(cfg))
  params = tm.init_params(cfg, seed=0)
  tokens, targets = tm.synthetic_batch(cfg, seed=1)

  def loss(prm, tok, tgt):
    return tm.loss_fn(prm, tok, tgt, cfg)

  step = _grad_step(loss, names)
  args = (tokens, targets) + tuple(params[k] for k in names)
  want = float(tf.function(step)(*[tf.constant(x) for x in args])[0])
  dm = gs.Mesh((2, 4), ("data", "model"))
  rows = []
  rows.append(_spmd_row("data parallel", step, dm, (P(("data", "model"), None),) * 2 + (P(),) * len(names), args,
                        a.repeats))
  meg = tm.megatron_specs(cfg)
  rows.append(_spmd_row("Megatron", step, dm, (P("data", None),) * 2 + tuple(meg[k] for k in names), args,
                        a.repeats))
  auto = _spmd_row("intra-op auto", step, dm, "auto", args, a.repeats)
  whole = gs.plan_stages(loss, {k: tf.TensorSpec(v.shape, tf.float32) for k, v in params.items()},
                         tf.TensorSpec(tokens.shape, tf.int32), tf.TensorSpec(targets.shape, tf.int32),
                         mesh=gs.Mesh((2, 4), ("host", "device")), layers=a.layers + 2, microbatches=1, max_stages=1,
                         memory_budget=1 << 60)   # (the stage program bounds the stages under a budget)
  assert len(whole.stages) == 1, whole
  rows.append(auto[:2] + (whole.predicted_seconds,) + auto[3:])
  if a.layers % 4 == 0:   # the GSPMD pipeline: 4 identical stages of the decoder blocks over `stage`
    pm = gs.Mesh((4, 2), ("stage", "data"))
    pnames = sorted(tm.pipelined_shapes(cfg))
    pparams = tm.init_pipelined_params(cfg, 4)
    pspecs = tm.pipelined_specs(cfg)

    def ploss(prm, tok, tgt):
      return tm.pipelined_loss(prm, tok, tgt, cfg, a.microbatches)

    pargs = (tokens, targets) + tuple(pparams[k] for k in pnames)
    rows.append(_spmd_row("GSPMD pipeline (4 stages x 2 data)", _grad_step(ploss, pnames), pm,
                          (P("data", None),) * 2 + tuple(pspecs[k] for k in pnames), pargs, a.repeats))
  start = time.perf_counter()
  two = gs.auto_parallel(loss, params, tokens, targets, mesh=gs.Mesh((2, 4), ("host", "device")),
                         microbatches=a.microbatches, layers=a.layers + 2)
  planned = time.perf_counter() - start
  print(two)
  measured = _timed(lambda: two(params, tokens, targets), a.repeats)
  got = float(two(params, tokens, targets)[0])
  rows.append(("auto two-level (gs.auto_parallel)", measured, two.plan.predicted_seconds,
               max(s.memory_bytes for s in two.plan.stages), got))
  if two.plan is not two.pipelined_plan:   # the pipeline the planner turned down, run for its measurement
    piped = gs.auto_parallel(loss, params, tokens, targets, mesh=gs.Mesh((2, 4), ("host", "device")),
                             microbatches=a.microbatches, layers=a.layers + 2, intra_candidate=False)
    print(piped.plan)
    sec = _timed(lambda: piped(params, tokens, targets), a.repeats)
    rows.insert(len(rows) - 1, ("auto pipelined (turned down)", sec, piped.plan.predicted_seconds,
                                max(s.memory_bytes for s in piped.plan.stages), float(piped(params, tokens, targets)[0])))
  print(f"\nplanned in {planned:.1f} s; unpartitioned loss {want:.6f}")
  print("| plan | measured ms | predicted ms | memory / device (MiB) | loss |")
  print("|---|---:|---:|---:|---:|")
  for name, sec, pred, mem, value in rows:
    pred_s = f"{pred * 1e3:.2f}" if pred is not None else "-"
    print(f"| {name} | {sec * 1e3:.1f} | {pred_s} | {mem / 2**20:.2f} | {float(value):.6f} |")
  best = min(r[1] for r in rows[:-1] if "turned down" not in r[0])
  print(f"\nauto two-level / best other plan (measured): {rows[-1][1] / best:.2f}x; predicted / measured "
        f"(two-level): {rows[-1][2] / rows[-1][1]:.3f}")


if __name__ == "__main__":
  main()
