"""Each op family on 1-D, 2-D and 3-D meshes with even and uneven sizes (17 over 4, 3 over 8), against the
unpartitioned program."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

MESHES = {
    "8": gs.Mesh((8,), ("a",)),
    "2x4": gs.Mesh((2, 4), ("a", "b")),
    "2x2x2": gs.Mesh((2, 2, 2), ("a", "b", "c")),
}


def _specs(mesh):
  """Layouts to try: all axes on dim 0, the first axis on dim 0 and the last on dim 1, replicated."""
  names = mesh.axis_names
  out = [P(names), P()]
  if len(names) > 1:
    out.append(P(names[0], names[-1]))
    out.append(P(None, names[1:]))
  else:
    out.append(P(None, names[0]))
  return out


FAMILIES = {
    "elementwise": (lambda x, y: tf.tanh(x) * y + tf.maximum(x, 0.5) - tf.exp(-tf.square(y)), 2),
    "matmul": (lambda x, y: tf.matmul(x, y, transpose_b=True) + tf.reduce_sum(x @ tf.transpose(y)), 2),
    "reduction": (lambda x, y: (tf.reduce_sum(x, 0), tf.reduce_max(y, 1), tf.reduce_mean(x * y),
                                tf.reduce_min(x, 1, keepdims=True)), 2),
    "softmax": (lambda x, y: (tf.nn.softmax(x), tf.nn.log_softmax(y, axis=0)), 2),
    "views": (lambda x, y: (tf.transpose(x), tf.reshape(tf.concat([x, y], 0), [-1]), tf.expand_dims(y, 1)), 2),
    "select_slice_pad": (lambda x, y: (tf.where(x > y, x, y)[1:, :2], tf.pad(x, [[1, 0], [0, 2]]),
                                       tf.concat([x, y], 1), tf.tile(y, [2, 1])), 2),
    "scan_arg": (lambda x, y: (tf.cumsum(x, 0), tf.argmax(y, 0), tf.math.top_k(x, 2).values), 2),
}


@pytest.mark.parametrize("rows,cols", [(17, 6), (3, 5), (16, 8)], ids=["17x6", "3x5", "16x8"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family(rng, family, mesh_name, rows, cols):
  fn, n = FAMILIES[family]
  mesh = MESHES[mesh_name]
  args = [rng.uniform(-1, 1, (rows, cols)).astype(np.float32) for _ in range(n)]
  if family == "matmul":
    args[1] = rng.uniform(-1, 1, (rows + 1, cols)).astype(np.float32)
  want = tf.nest.flatten(fn(*[tf.constant(a) for a in args]))
  for spec in _specs(mesh):
    f = gs.function(fn, mesh=mesh, in_shardings=(spec,) * n)
    got = tf.nest.flatten(f(*args))
    for g, w in zip(got, want):
      assert_close(g.numpy(), w, rtol=1e-5, atol=1e-5)
      assert [tuple(c.shape) for c in g.components] == [g.sharding.shard_shape(w.shape)] * mesh.size
