"""Element-wise ops and band masks."""

import numpy as np
import tensorflow as tf

from conftest import check_partitioned
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.graph.grappler_view import LIMIT_BYTES

MESH = gs.Mesh((2, 4), ("data", "model"))


def test_band_part_keeps_batch_dims_split_and_matrix_dims_whole(rng):
  """A causal (lower) and a local (band of 2) mask of a batch of matrices split over both axes: the batch dims
  stay split, the matrix dims are made whole (which elements survive depends on their global position)."""
  x = rng.standard_normal((2, 4, 16, 16)).astype(np.float32)

  def fn(a):
    return tf.linalg.band_part(a, -1, 0) * 2.0, tf.linalg.band_part(a, 2, 2) + 1.0

  low = check_partitioned(fn, [x], (P("data", None, "model", None),), MESH)
  node = next(n for n in low.global_graph_def.node if n.op == "MatrixBandPart")
  assert low.shardings[node.name].spec[0] == "data"
  assert low.shardings[node.name].spec[2:] in ((None, None), ())
  assert not low.report.warnings


def test_band_part_of_a_generated_mask_is_computed_at_its_local_shape(rng):
  """A causal mask made from ones (as Keras's attention builds it) added to split attention scores: the mask is
  computed at its local shape (folded by the per-device optimizer at most at that size), never a global-shaped
  constant."""
  s = rng.standard_normal((8, 4, 64, 64)).astype(np.float32)

  def fn(scores):
    mask = tf.linalg.band_part(tf.ones((8, 4, 64, 64)), -1, 0)
    return tf.nn.softmax(scores + (1.0 - mask) * -1e9)

  low = check_partitioned(fn, [s], (P("data", "model", None, None),), MESH)
  shapes = [tuple(d.size for d in n.attr["value"].tensor.tensor_shape.dim) for n in low.graph_def.node
            if n.op == "Const"]
  assert max(int(np.prod(s)) for s in shapes) * 4 <= LIMIT_BYTES
  assert (8, 4, 64, 64) not in shapes
  assert low.report.counts() == {}
