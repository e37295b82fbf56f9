"""Collectives whose groups join processes, each with several members in every process (built in two levels):
all-reduces (sums of several dtypes, a bfloat16 max, flat sizes the members per process do not divide),
all-gathers (packed and uneven) and reduce-scatters, on meshes (8,) and (2, 4) over both axes and over one.

Every process runs the same cases; each prints one JSON line with, per case, the partitioned result, the
unpartitioned program's on the same inputs, and the levels and process crossings of the ops emitted.
"""

import json
import sys

import numpy as np


def cases(gs, tf):
  """[(name, mesh, fn, inputs, in_shardings, out_sharding)] of programs whose collectives span processes."""
  P = gs.P
  rng = np.random.default_rng(0)
  m8 = gs.Mesh((8,), ("d",))
  m24 = gs.Mesh((2, 4), ("a", "b"))
  x = rng.standard_normal((16, 15)).astype(np.float32)
  w = rng.standard_normal((16, 7)).astype(np.float32)
  ints = rng.integers(-50, 50, (16, 5)).astype(np.int32)
  square = rng.integers(-50, 50, (16, 16)).astype(np.int32)
  small = rng.integers(-3, 4, (16, 3)).astype(np.int8)
  halves = rng.standard_normal((16, 6)).astype(np.float16)
  wide = rng.standard_normal((8, 40)).astype(np.float32)
  return [
      # partial sums of a [15, 7] result (105 elements: padded to the members per process)
      ("matmul_sum", m8, lambda a, b: a @ b, (x.T.copy(), w), (P(None, "d"), P("d", None)), P()),
      ("int32_sum", m8, lambda a: tf.reduce_sum(a, 0), (ints,), (P("d", None),), P()),
      ("int8_sum", m8, lambda a: tf.reduce_sum(a, 0), (small,), (P("d", None),), P()),
      ("float16_sum", m8, lambda a: tf.reduce_sum(a, 0), (halves,), (P("d", None),), P()),
      ("bfloat16_max", m8, lambda a: tf.cast(tf.reduce_max(tf.cast(a, tf.bfloat16), 0), tf.float32), (x,),
       (P("d", None),), P()),
      ("float32_gather", m8, tf.identity, (x,), (P("d", None),), P()),
      ("uneven_gather", m8, tf.identity, (x[:13],), (P("d", None),), P()),
      ("bool_gather", m8, lambda a: tf.cast(gs.replicate(a > 0), tf.int32), (x,), (P(None, "d"),), P()),
      ("int8_gather", m8, lambda a: tf.cast(gs.replicate(a), tf.int32), (small.T.copy(),), (P(None, "d"),), P()),
      # a partial sum kept split: reduce-scatter
      ("reduce_scatter", m8, lambda a, b: a @ b, (wide.T.copy()[:, :8], wide[:8]), (P(None, "d"), P("d", None)),
       P("d", None)),
      ("int32_reduce_scatter", m8, lambda a: tf.reduce_sum(a, 1), (square,), (P(None, "d"),), P("d")),
      # over both axes of (2, 4), and over the axis that joins two processes of two members (4 processes)
      ("both_axes_sum", m24, lambda a: tf.reduce_sum(a, 0), (x,), (P(("a", "b"), None),), P()),
      ("b_axis_sum", m24, lambda a: tf.reduce_sum(a, 1), (wide,), (P("a", "b"),), P("a")),
      ("b_axis_gather", m24, tf.identity, (wide,), (P("a", "b"),), P("a", None)),
  ]


def run(gs, tf):
  out = {}
  for name, mesh, fn, inputs, in_shardings, out_sharding in cases(gs, tf):
    f = gs.function(fn, mesh=mesh, in_shardings=in_shardings, out_shardings=out_sharding, exchange="collectives")
    got = f(*inputs).numpy()
    want = tf.function(fn)(*[tf.constant(a) for a in inputs]).numpy()
    report = f.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in inputs]).report
    out[name] = {"got": got.astype(np.float64).tolist(), "want": want.astype(np.float64).tolist(),
                 "levels": sorted({(op.level or "flat", op.cross_process) for op in report.emitted_ops()}),
                 "cross_bytes": report.cross_process_bytes_per_device()}
  return out


def main(run_cases=run):
  """Joins the cluster and prints `run_cases`'s record of every case."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  k, n = gs.initialize(cpu_devices=8)
  print("RESULT " + json.dumps({"process": k, "processes": n, "cases": run_cases(gs, tf)}), flush=True)


if __name__ == "__main__":
  sys.exit(main())
