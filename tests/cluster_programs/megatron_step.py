"""A Megatron MLP training step on mesh (2, 4), run by every process of a cluster (or by one process).

Prints one JSON line: the losses, sums of a result split over both axes and of the trained weights, and (with
--save DIR) saves a checkpoint (every process the same call; one checkpoint). With
--restore PREFIX it starts from that checkpoint instead of the seeded weights.
"""

import argparse
import json
import os
import sys

import numpy as np


def train(gs, tf, mesh, steps, restore=None, save=None):
  """The step and its results, the same in one process and in several."""
  P = gs.P
  rng = np.random.default_rng(0)
  x = rng.standard_normal((16, 32)).astype(np.float32)
  w1 = tf.Variable(rng.standard_normal((32, 64)).astype(np.float32) * 0.1, name="w1")
  w2 = tf.Variable(rng.standard_normal((64, 30)).astype(np.float32) * 0.1, name="w2")   # 30: uneven over 4
  ckpt = tf.train.Checkpoint(w1=w1, w2=w2)

  @gs.function(mesh=mesh, in_shardings=P("data", None), out_shardings=(P(), P("data", "model")))
  def step(x):
    gs.shard(w1, P(None, "model"))
    gs.shard(w2, P("model", None))
    with tf.GradientTape() as tape:
      h = tf.nn.relu(x @ w1) @ w2
      loss = tf.reduce_mean(h ** 2)
    g1, g2 = tape.gradient(loss, [w1, w2])
    w1.assign_sub(0.1 * g1)
    w2.assign_sub(0.1 * g2)
    return loss, h

  out = {}
  if restore:
    ckpt.read(restore).assert_existing_objects_matched()
    out["restored_w1"] = float(np.abs(w1.numpy()).sum())
    out["restored_w2"] = float(np.abs(w2.numpy()).sum())
  # Each process passes only its own rows of the batch (rows split over "data": mesh row = position // 4).
  mine = sorted({p // 4 for p in range(8) if mesh.resolve_devices()[p] in gs.local_devices(mesh)})
  rows = x[mine[0] * 8:(mine[-1] + 1) * 8]
  batch = gs.from_process_local_data(rows, mesh, P("data", None))
  out["batch_local"] = batch.is_fully_addressable
  losses = []
  for _ in range(steps):
    loss, h = step(batch)
    losses.append(float(loss))
  out.update(losses=losses, h_sum=float(np.abs(h.numpy()).sum()), h_local=h.is_fully_addressable,
             w1=float(np.abs(w1.numpy()).sum()), w2=float(np.abs(w2.numpy()).sum()))
  if save:   # every process saves to the same path: each writes its own tiles, the chief merges them
    out["saved"] = ckpt.write(os.path.join(save, "ckpt"))
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--save", default=None)
  parser.add_argument("--restore", default=None)
  args = parser.parse_args()
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  k, n = gs.initialize(cpu_devices=8)
  mesh = gs.Mesh((2, 4), ("data", "model"))
  out = train(gs, tf, mesh, args.steps, args.restore, args.save)
  out.update(process=k, processes=n, local=list(gs.local_devices(mesh)))
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  sys.exit(main())
