"""Shard-by-shard variable creation: values independent of the mesh, the right distributions, no full value."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd import initializers as gi
from tf_gspmd.runtime.state import storage_of

MESH = gs.Mesh((2, 4), ("data", "model"))
MESH8 = gs.Mesh((8,), ("x",))


@pytest.mark.parametrize("init", [gi.Uniform(-2.0, 3.0, seed=7), gi.Normal(1.0, 0.5, seed=3),
                                  gi.Normal(0.0, 1.0, seed=3, truncated=True), gi.glorot_uniform(seed=1),
                                  gi.Constant(2.5)])
def test_same_values_on_every_mesh_and_unsharded(init):
  shape = (10, 13)   # uneven on both meshes
  whole = init(shape).numpy()
  a = gs.variable(init, shape, mesh=MESH, spec=P("model", "data"))
  b = gs.variable(init, shape, mesh=MESH8, spec=P(None, "x"))
  # Before any read, only shards exist: the tf.Variable itself holds no value yet.
  assert not a.is_initialized() and not b.is_initialized()
  assert all(tuple(c.shape.as_list()) == (3, 7) for c in storage_of(a).components)
  assert_close(a.numpy(), whole, rtol=0, atol=0)
  assert_close(b.numpy(), whole, rtol=0, atol=0)


@pytest.mark.parametrize("init", [gi.Normal(1.0, 0.5, seed=3), gi.he_normal(seed=2), gi.Constant(2.5)])
@pytest.mark.parametrize("shape,starts,lengths,chunk", [((9, 7, 5), (2, 1, 0), (6, 5, 5), 30),   # rows of 25
                                                        ((9, 7, 5), (0, 3, 1), (3, 4, 4), 7),     # a row > chunk
                                                        ((40,), (3,), (35,), 8)])
def test_chunked_block_is_the_block(init, shape, starts, lengths, chunk):
  # A large shard is generated a piece at a time to bound its temporaries; the pieces are exactly the block.
  want = init.block(shape, starts, lengths, tf.float32).numpy()
  got = init.chunked(shape, starts, lengths, tf.float32, chunk_elements=chunk).numpy()
  assert got.shape == tuple(lengths)
  assert_close(got, want, rtol=0, atol=0)


def test_distributions_and_seeds():
  shape = (256, 512)
  n = gi.Normal(0.5, 2.0, seed=1)(shape).numpy()
  assert abs(n.mean() - 0.5) < 0.02 and abs(n.std() - 2.0) < 0.02
  t = gi.Normal(0.0, 1.0, seed=1, truncated=True)(shape).numpy()
  assert np.abs(t).max() <= 2.0 + 1e-5 and 0.85 < t.std() < 0.9
  u = gi.Uniform(-1.0, 1.0, seed=2)(shape).numpy()
  assert -1.0 < u.min() < -0.99 and 0.99 < u.max() < 1.0 and abs(u.mean()) < 0.01
  assert not np.array_equal(gi.Uniform(seed=1)(shape).numpy(), gi.Uniform(seed=2)(shape).numpy())
  g = gi.glorot_uniform()((300, 100)).numpy()
  limit = np.sqrt(6.0 / 400)
  assert np.abs(g).max() <= limit and np.abs(g).max() > 0.99 * limit


def test_keras_initializers_convert_with_their_scale():
  keras = pytest.importorskip("keras")
  he = gi.from_keras(keras.initializers.HeNormal(seed=4))
  assert he == gi.VarianceScaling(2.0, "fan_in", "truncated_normal", 4)
  assert gi.from_keras("zeros") == gi.Constant(0.0)
  assert gi.from_keras(keras.initializers.RandomUniform(-0.1, 0.2, seed=5)) == gi.Uniform(-0.1, 0.2, 5)
  w = he((512, 256)).numpy()
  assert abs(w.std() - np.sqrt(2.0 / 512)) < 0.05 * np.sqrt(2.0 / 512)
  with pytest.raises(gs.InputError, match="no shard-by-shard equivalent"):
    gi.from_keras(keras.initializers.Orthogonal())


def test_created_variable_trains_in_place(rng):
  w = gs.variable(gi.Normal(0.0, 0.1, seed=0), (16, 32), mesh=MESH, spec=P(None, "model"), name="w")
  start = w.numpy()
  x = rng.standard_normal((8, 16)).astype(np.float32)

  @gs.function(mesh=MESH, in_shardings=(P("data", None),))
  def step(xb):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(xb @ w))
    w.assign_sub(0.1 * tape.gradient(loss, w))
    return loss

  loss = step(x).numpy()
  ref = tf.Variable(start)
  with tf.GradientTape() as tape:
    want = tf.reduce_mean(tf.square(x @ ref))
  ref.assign_sub(0.1 * tape.gradient(want, ref))
  assert_close(loss, want.numpy())
  assert_close(w.numpy(), ref.numpy())
  assert gs.sharding_of(w).spec == P(None, "model")
