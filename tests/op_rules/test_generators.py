"""Fill, Range and Shape-family constants (the global shape, never the shard's)."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))


@pytest.mark.parametrize("spec", [P(), P("data", "model"), P(("model", "data"))], ids=str)
def test_fill_range_shape(rng, spec):
  def fn(x):
    return (x + tf.fill([8, 12], 3.0), tf.cast(tf.range(12), tf.float32) * x, x * tf.cast(tf.size(x), tf.float32),
            tf.zeros_like(x) + tf.cast(tf.shape(x)[0], tf.float32))

  x = rng.standard_normal((8, 12)).astype(np.float32)
  f = gs.function(fn, mesh=MESH, in_shardings=spec, out_shardings=spec)
  for got, want in zip(f(x), fn(x)):
    assert_close(got.numpy(), want, rtol=1e-6)


def test_shape_of_a_split_tensor_is_the_global_shape():
  low = gs.function(lambda x: tf.shape(x), mesh=MESH, in_shardings=P("data", "model")).lower(
      tf.TensorSpec([8, 12]))
  shapes = {n.op for n in low.graph_def.node}
  assert "Shape" not in shapes
