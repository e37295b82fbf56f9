"""A check that fails on one process's device, in a step whose all-reduce and variable write cross processes: every
process raises the check's InvalidArgumentError, none writes its shards, and the steps after it run
(rewriter/backend/checks.py). Each process prints, per step, its result or error and whether its shards of the
variable equal the unpartitioned step's variable."""

import json

import numpy as np

STEPS = 8


def main():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  k, n = gs.initialize(cpu_devices=8)
  mesh = gs.Mesh((8,), ("d",))

  def make(v):
    def step(x):
      y = tf.debugging.check_numerics(x, "x went bad")
      v.assign_add(y * 2.0)
      return tf.reduce_sum(y) + tf.reduce_sum(v)
    return step

  ours_v, plain_v = tf.Variable(np.zeros(16, np.float32)), tf.Variable(np.zeros(16, np.float32))
  ours = gs.function(make(ours_v), mesh=mesh, in_shardings=gs.P("d"))
  plain = tf.function(make(plain_v))
  rows = []
  for s in range(STEPS):
    x = np.arange(16, dtype=np.float32) / (s + 1)
    if s % 2:   # a NaN in device 1's piece (process 0), then in device 6's (the last process)
      x[2 if s % 4 == 1 else 13] = np.nan
    row = {}
    for name, fn in (("plain", plain), ("ours", ours)):
      try:
        row[name] = float(fn(x).numpy())
      except tf.errors.InvalidArgumentError as e:
        row[name] = "InvalidArgumentError"
        row[name + "_message"] = e.message
    want = plain_v.numpy()
    row["shards_equal"] = all(np.allclose(sh.numpy(), want[sh.index], rtol=1e-6) for sh in gs.shards_of(ours_v))
    rows.append(row)
  print("RESULT " + json.dumps({"process": k, "processes": n, "rows": rows}), flush=True)


if __name__ == "__main__":
  main()
