"""An MPMD pipeline step (gs.mpmd_pipeline) against the unpartitioned step, on 8 logical CPUs.

The model of tests/parallel/test_mpmd.py, larger: an embedding stage on a (1, 2) submesh, dense residual blocks on (2,
2), a vocabulary head with softmax cross-entropy on (2,). Prints the median step time of the unpartitioned step
(one tf.function on one device, the whole batch) and of the pipeline under each schedule, with one dispatch
thread per stage and with one thread for all, the pipeline's concurrency (sum of the stages' busy seconds over
the step's seconds) and the bytes moved between stages per step.

  .venv/bin/python bench/mpmd.py [--steps=5] [--microbatches=4] [--vocab=4096] [--dim=256] [--batch=64]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_gspmd as gs  # noqa: E402
from tf_gspmd import P  # noqa: E402


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--microbatches", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=4096)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--tokens", type=int, default=16)
  args = parser.parse_args()
  gs.split_cpu_devices(8)
  devs = [d.name for d in tf.config.list_logical_devices("CPU")]
  v, d, h, n, t = args.vocab, args.dim, 4 * args.dim, args.batch, args.tokens

  def embed(ps, ids):
    return tf.reduce_mean(tf.gather(ps[0], ids), axis=1)

  def blocks(ps, x):
    for k in range(0, len(ps), 2):
      x = x + tf.nn.relu(x @ ps[k]) @ ps[k + 1]
    return x

  def head(ps, x, y):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, x @ ps[0]))

  rng = np.random.default_rng(0)
  f = lambda *s: (rng.normal(size=s) * 0.05).astype(np.float32)  # noqa: E731
  params = [(f(v, d),), (f(d, h), f(h, d), f(d, h), f(h, d)), (f(d, v),)]
  ids = rng.integers(0, v, size=(n, t)).astype(np.int32)
  labels = rng.integers(0, v, size=(n,)).astype(np.int32)
  mesh = lambda shape, names, first: gs.Mesh(shape, names, devices=devs[first:first + int(np.prod(shape))])  # noqa
  stages = [gs.Stage(embed, mesh((1, 2), ("d", "m"), 0), (P(None, "m"),), P("d", None), P(None, "m")),
            gs.Stage(blocks, mesh((2, 2), ("d", "m"), 2), (P(None, "m"), P("m", None)) * 2, P("d", None),
                     P("d", None)),
            gs.Stage(head, mesh((2,), ("m",), 6), (P(None, "m"),), P(), target_sharding=P())]

  flat = [tf.constant(p) for ps in params for p in ps]

  @tf.function
  def whole(ids, labels, *w):
    with tf.GradientTape() as tape:
      tape.watch(w)
      loss = head(w[5:], blocks(w[1:5], embed(w[:1], ids)), labels)
    return loss, [tf.convert_to_tensor(g) for g in tape.gradient(loss, w)]

  def timed(run):
    run()
    times = []
    for _ in range(args.steps):
      start = time.perf_counter()
      run()
      times.append(time.perf_counter() - start)
    return float(np.median(times))

  with tf.device(devs[0]):
    base = timed(lambda: [x.numpy() for x in tf.nest.flatten(whole(ids, labels, *flat))])
  print(f"model: vocab {v}, dim {d}, hidden {h}, batch {n} x {t} tokens, {args.microbatches} microbatches")
  print(f"{'step':34s} {'ms':>8s} {'x unpartitioned':>16s} {'concurrency':>12s} {'MB moved':>9s}")
  print(f"{'unpartitioned (one device)':34s} {base * 1e3:8.1f} {1.0:16.2f}")
  for schedule in ("1f1b", "gpipe"):
    for concurrent in (True, False):
      pipe = gs.mpmd_pipeline(stages, microbatches=args.microbatches, schedule=schedule, concurrent=concurrent)
      step = timed(lambda: [g.numpy() for g in tf.nest.flatten(pipe(params, ids, labels)[1])])  # noqa: B023
      run = pipe.last_run
      label = f"mpmd {schedule}, {'thread per stage' if concurrent else 'one thread'}"
      print(f"{label:34s} {step * 1e3:8.1f} {step / base:16.2f} {sum(run.busy) / run.seconds:12.2f} "
            f"{run.transfers.moved_bytes / 1e6:9.2f}")


if __name__ == "__main__":
  main()
