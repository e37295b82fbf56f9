"""Fill, Range, Shape-family constants, scatters and strided-slice gradients."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.graph_ir import Graph

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


@pytest.mark.parametrize("spec", [P(), P("data"), P(("data", "model"))], ids=str)
def test_scatter_nd_and_tensor_scatter(rng, spec):
  idx = rng.integers(0, 10, size=(8, 1)).astype(np.int32)
  upd = rng.standard_normal((8, 6)).astype(np.float32)
  base = rng.standard_normal((10, 6)).astype(np.float32)

  def fn(i, u, b):
    return tf.scatter_nd(i, u, [10, 6]), tf.tensor_scatter_nd_add(b, i, u), tf.tensor_scatter_nd_update(b, i[:1], u[:1])

  f = gs.function(fn, mesh=MESH, in_shardings=(spec, spec, P(None, "model")))
  for got, want in zip(f(idx, upd, base), fn(idx, upd, base)):
    assert_close(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [P(), P("data", "model"), P(None, "model")], ids=str)
def test_strided_slice_gradient(rng, spec):
  def fn(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.reduce_sum(x[:, 2:7] ** 2) + tf.reduce_sum(x[3] * 2.0) + tf.reduce_sum(x[:, ::2])
    return tape.gradient(y, x)

  x = rng.standard_normal((8, 12)).astype(np.float32)
  f = gs.function(fn, mesh=MESH, in_shardings=spec)
  assert_close(f(x).numpy(), fn(tf.constant(x)), rtol=1e-5)


@pytest.mark.parametrize("spec", [P(), P("data", "model"), P(None, "model")], ids=str)
def test_gather_nd_and_its_gradient(rng, spec):
  x = rng.standard_normal((8, 12)).astype(np.float32)
  idx = np.array([[0, 1], [2, 3], [7, 11]], np.int32)

  def fn(t):
    with tf.GradientTape() as tape:
      tape.watch(t)
      y = tf.reduce_sum(tf.gather_nd(t, idx) ** 2) + tf.reduce_sum(tf.gather_nd(t, idx[:, :1]))
    return y, tape.gradient(y, t)

  f = gs.function(fn, mesh=MESH, in_shardings=spec)
  for got, want in zip(f(x), fn(tf.constant(x))):
    assert_close(got.numpy(), want, rtol=1e-5, atol=1e-5)
