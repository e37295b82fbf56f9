"""Programs whose collectives cross processes, run with exchange "auto": each process runs its devices as one
graph, with one TF collective of the stacked operand for each collective across processes, and TF's broadcast op on its
device for each transfer of a collective-permute across processes (rewriter/one_graph/in_process.py).

The cases of hierarchical.py (two levels: within each process in the graph, across in one op), and collectives
over the axis of (2, 4) whose groups have one member in each process they join. Every process prints one JSON line
with, per case, the partitioned and the unpartitioned results, whether it ran as one graph, and the instance keys
of the graph's TF collectives in the order its edges force.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import hierarchical  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def cases(gs, tf):
  P = gs.P
  rng = np.random.default_rng(1)
  m8 = gs.Mesh((8,), ("d",))
  m24 = gs.Mesh((2, 4), ("a", "b"))
  wide = rng.standard_normal((8, 40)).astype(np.float32)
  rows = rng.standard_normal((6, 16)).astype(np.float32)
  ints = rng.integers(-50, 50, (8, 40)).astype(np.int32)
  tall = rng.standard_normal((32, 8)).astype(np.float32)

  def several(a, i, c):   # independent collectives across processes: one order in every process
    return tf.concat([tf.reduce_sum(a, 0), tf.cast(tf.reduce_sum(i, 0), tf.float32), tf.reduce_max(a, 0),
                      tf.reshape(gs.replicate(c), [-1]), tf.reduce_min(c, 0)], 0)

  return hierarchical.cases(gs, tf) + [
      # groups of one member in each process they join (axis a of (2, 4)): one op of the stacked operand
      ("a_axis_sum", m24, lambda a: tf.reduce_sum(a, 0), (wide,), (P("a", "b"),), P("b")),
      ("a_axis_gather", m24, tf.identity, (wide,), (P("a", "b"),), P(None, "b")),
      ("a_axis_all_to_all", m24, tf.identity, (wide,), (P("a", None),), P(None, "a")),
      ("a_axis_uneven_gather", m24, lambda a: a * 2.0, (rows,), (P("a", None),), P()),
      ("a_axis_several", m24, several, (wide, ints, rows), (P("a", None),) * 3, P()),
      # an all-to-all over all 8 devices: several members in each process, in one op of the process's blocks
      ("flat_all_to_all", m8, tf.identity, (wide,), (P("d", None),), P(None, "d")),
      # neighbours' rows (collective-permutes), across the processes' boundaries: a transfer per device
      ("shift_across", m8, lambda a: a[1:] + a[:-1], (tall,), (P("d", None),), P("d", None)),
  ]


STEPS = 50   # calls of the program with several independent collectives across processes (none may hang)


def run(gs, tf):
  from tf_gspmd.rewriter.collectives import ordering  # pylint: disable=g-import-not-at-top
  out = {}
  for name, mesh, fn, inputs, in_shardings, out_sharding in cases(gs, tf):
    f = gs.function(fn, mesh=mesh, in_shardings=in_shardings, out_shardings=out_sharding)
    got = f(*inputs).numpy()
    again = [f(*inputs).numpy() for _ in range(STEPS if name == "a_axis_several" else 1)]
    got_again = again[0] if all(np.array_equal(a, again[0]) for a in again) else None
    want = tf.function(fn)(*[tf.constant(a) for a in inputs]).numpy()
    low = f.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in inputs])
    graph = low.program.in_process
    out[name] = {"got": got.astype(np.float64).tolist(),
                 "again": got_again.astype(np.float64).tolist() if got_again is not None else None,
                 "want": want.astype(np.float64).tolist(), "one_graph": graph is not None,
                 "sequence": ordering.sequence(graph.graph_def) if graph is not None else None,
                 "kinds": sorted({op.kind for op in low.report.emitted_ops() if op.cross_process})}
  return out


if __name__ == "__main__":
  sys.exit(hierarchical.main(run))
