"""gs.plan_scope(): models built with shapes and no values are lowered at any size and refuse to run."""

import resource

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))


def _rss_mib():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_keras_model_and_adam_of_24_gib_are_built_and_lowered_in_little_memory():
  """Two 4 GiB kernels, their biases and Adam's two slots of each (24 GiB): built shape-only and lowered, the
  report's per-device bytes the layout's arithmetic; calling it is refused."""
  before = _rss_mib()
  with gs.plan_scope():
    model = keras.Sequential([keras.Input((32768,), batch_size=8), keras.layers.Dense(32768, name="up"),
                              keras.layers.Dense(32768, name="down")])
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
  kernel = model.get_layer("up").kernel
  assert kernel.shape == (32768, 32768) and gs._layout.plan_scope.is_shape_only(kernel)

  def step(x):
    gs.shard(model.get_layer("up").kernel, P(None, "model"))
    gs.shard(model.get_layer("down").kernel, P("model", None))
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x)))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    return loss

  f = gs.function(step, mesh=MESH, in_shardings=(P("data", None),))
  low = f.lower(tf.TensorSpec((8, 32768), tf.float32))
  assert _rss_mib() - before < 2048   # the state alone is 24 GiB
  per_device = {r.name.split("/", 1)[1]: r.bytes_per_device for r in low.report.state}
  assert per_device["up/kernel:0"] == per_device["down/kernel:0"] == 32768 * 32768 * 4 // 4
  assert per_device["up/bias:0"] == 32768 * 4 // 4   # completed like its kernel's columns
  assert low.report.memory.state_bytes >= 3 * 2 * 32768 * 32768 * 4 // 4   # weights and two Adam slots
  with pytest.raises(gs.InputError, match="plan_scope"):
    f(np.zeros((8, 32768), np.float32))


def test_tf_variables_of_every_kind_get_shapes_without_values():
  """A callable initializer is traced (its shape learnt, nothing computed), a given value lends its shape."""
  with gs.plan_scope():
    a = tf.Variable(lambda: tf.random.normal((1 << 16, 1 << 14)), name="a")   # 4 GiB if it ran
    b = tf.Variable(np.zeros((3, 5), np.int32), name="b")
    c = tf.Variable(0.0, name="c")
  assert a.shape == (1 << 16, 1 << 14) and a.dtype == tf.float32
  assert b.shape == (3, 5) and b.dtype == tf.int32
  assert c.shape == () and c.dtype == tf.float32   # a Python float is float32, as tf.Variable makes it
  with pytest.raises(gs.InputError, match="'a:0'.*plan_scope"):
    a.numpy()
  with pytest.raises(tf.errors.InvalidArgumentError, match="plan_scope"):
    tf.function(lambda: b + 1)()
  outside = tf.Variable(1.0)
  assert not gs._layout.plan_scope.is_shape_only(outside) and outside.numpy() == 1.0
