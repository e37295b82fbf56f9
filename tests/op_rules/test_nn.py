"""Convolutions, pooling and batch norm, forward and gradients, against the unpartitioned program."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))


def _convnet(x, k1, k2, scale, offset):
  with tf.GradientTape() as tape:
    tape.watch([x, k1, k2, scale, offset])
    h = tf.nn.conv2d(x, k1, 1, "SAME")
    h, _, _ = tf.compat.v1.nn.fused_batch_norm(h, scale, offset, is_training=True)
    h = tf.nn.max_pool2d(tf.nn.relu(h), 2, 2, "VALID")
    h = tf.nn.conv2d(h, k2, 1, "VALID")
    loss = tf.reduce_mean(tf.nn.avg_pool2d(h, 2, 1, "SAME") ** 2)
  return (loss,) + tuple(tape.gradient(loss, [x, k1, k2, scale, offset]))


@pytest.mark.parametrize("x_spec,k_spec", [
    (P("data", None, None, None), P()),
    (P(("data", "model"), None, None, None), P()),
    (P("data", None, None, "model"), P(None, None, "model", None)),
    (P(), P(None, None, None, "model")),
], ids=str)
def test_convnet_step(rng, x_spec, k_spec):
  x = rng.standard_normal((8, 10, 10, 4)).astype(np.float32)
  k1 = rng.standard_normal((3, 3, 4, 8)).astype(np.float32) * 0.3
  k2 = rng.standard_normal((3, 3, 8, 4)).astype(np.float32) * 0.3
  scale = np.ones(8, np.float32)
  offset = np.zeros(8, np.float32)
  f = gs.function(_convnet, mesh=MESH, in_shardings=(x_spec, k_spec, None, None, None))
  low = f.lower(*[tf.TensorSpec(a.shape) for a in (x, k1, k2, scale, offset)])
  assert low.report.fallbacks == ()
  got = f(x, k1, k2, scale, offset)
  want = _convnet(*[tf.constant(a) for a in (x, k1, k2, scale, offset)])
  for g, w in zip(got, want):
    assert_close(g.numpy(), w, rtol=2e-4, atol=2e-4)


def test_batch_split_conv_needs_no_forward_collective():
  f = gs.function(lambda x, k: tf.nn.relu(tf.nn.conv2d(x, k, 1, "SAME")), mesh=MESH,
                  in_shardings=(P("data", None, None, None), P()))
  low = f.lower(tf.TensorSpec([8, 6, 6, 3]), tf.TensorSpec([3, 3, 3, 4]))
  assert low.report.collectives == ()
  assert low.out_shardings[0].spec == P("data", None, None, None)


def test_filter_gradient_of_batch_split_is_one_all_reduce():
  def step(x, k):
    with tf.GradientTape() as tape:
      tape.watch(k)
      loss = tf.reduce_sum(tf.nn.conv2d(x, k, 1, "SAME"))
    return tape.gradient(loss, k)

  f = gs.function(step, mesh=gs.Mesh((8,), ("data",)), in_shardings=(P("data", None, None, None), P()),
                  out_shardings=P())
  low = f.lower(tf.TensorSpec([8, 6, 6, 3]), tf.TensorSpec([3, 3, 3, 4]))
  kinds = [c.kind for c in low.report.collectives]
  assert kinds.count("all-reduce") >= 1 and "all-gather" not in kinds


@pytest.mark.parametrize("mesh_shape,spec", [((8,), P(None, "s", None, None)), ((2, 4), P("b", "s", None, None)),
                                             ((4, 2), P("b", None, "s", None))], ids=str)
def test_spatial_conv_exchanges_only_halos(rng, mesh_shape, spec):
  """Workload 5's pattern: SAME 3x3 convs with a split spatial dim move only one edge row each way."""
  mesh = gs.Mesh(mesh_shape, ("s",) if len(mesh_shape) == 1 else ("b", "s"))
  x = rng.standard_normal((4, 16, 16, 3)).astype(np.float32)
  k1 = rng.standard_normal((3, 3, 3, 5)).astype(np.float32) * 0.3
  k2 = rng.standard_normal((5, 5, 5, 4)).astype(np.float32) * 0.3

  def fn(x, k1, k2):
    return tf.nn.conv2d(tf.nn.relu(tf.nn.conv2d(x, k1, 1, "SAME")), k2, 1, "SAME")

  f = gs.function(fn, mesh=mesh, in_shardings=(spec, P(), P()), out_shardings=spec)
  low = f.lower(*[tf.TensorSpec(a.shape) for a in (x, k1, k2)])
  kinds = low.report.counts()
  assert set(kinds) <= {"collective-permute"} and kinds.get("collective-permute") == 4, kinds
  # each a point-to-point transfer of the halo alone (no gather of every shard's edges)
  point_to_point = {"CollectiveBcastSendV2", "CollectiveBcastRecvV2"}
  assert all({op.op for op in c.ops} <= point_to_point for c in low.report.collectives)
  assert low.report.bytes_per_device() <= low.report.logical_bytes_per_device()
  assert_close(f(x, k1, k2).numpy(), fn(x, k1, k2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("row", [0, 3, 4, 15])
def test_spatial_conv_with_an_inf_matches_the_unpartitioned_conv(rng, row):
  """A 3x3 SAME conv with rows split over 4 and one inf in the input: the edge devices' missing halos are zeros
  (selected, not multiplied by 0, which would turn a neighbouring inf into NaN)."""
  x = rng.standard_normal((2, 16, 8, 3)).astype(np.float32)
  x[1, row, 5, 1] = np.inf
  k = np.abs(rng.standard_normal((3, 3, 3, 4))).astype(np.float32)   # one inf term per output: +inf, never NaN
  spec = P(None, "d", None, None)
  f = gs.function(lambda x, k: tf.nn.conv2d(x, k, 1, "SAME"), mesh=gs.Mesh((4,), ("d",)), in_shardings=(spec, P()),
                  out_shardings=spec)
  want = tf.nn.conv2d(x, k, 1, "SAME").numpy()
  assert np.isinf(want).any() and not np.isnan(want).any()
  np.testing.assert_allclose(f(x, k).numpy(), want, rtol=1e-5, atol=1e-5)


def test_conv_workload_matches_xla_bytes():
  """Workload 5: 4 collective-permutes, 393,216 bytes per device (XLA's figure)."""
  mesh = gs.Mesh((8,), ("spatial",))
  spec = P(None, "spatial", None, None)
  f = gs.function(lambda x, a, b: tf.nn.conv2d(tf.nn.conv2d(x, a, 1, "SAME"), b, 1, "SAME"), mesh=mesh,
                  in_shardings=(spec, P(), P()), out_shardings=spec)
  low = f.lower(tf.TensorSpec([8, 128, 128, 16]), tf.TensorSpec([3, 3, 16, 32]), tf.TensorSpec([3, 3, 32, 32]))
  assert low.report.counts() == {"collective-permute": 4}
  assert low.report.bytes_per_device() == 393216


@pytest.mark.parametrize("mesh_shape,spec", [((8,), P(None, "s", None, None)), ((2, 4), P("b", "s", None, None))],
                         ids=str)
def test_pooling_with_split_space_is_local(rng, mesh_shape, spec):
  """2x2 stride-2 windows tile space: shards holding whole windows pool locally, forward and backward."""
  mesh = gs.Mesh(mesh_shape, ("s",) if len(mesh_shape) == 1 else ("b", "s"))
  x = rng.standard_normal((4, 16, 8, 3)).astype(np.float32)

  def fn(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.reduce_sum(tf.nn.max_pool2d(x, 2, 2, "VALID") ** 2) + tf.reduce_sum(tf.nn.avg_pool2d(x, 2, 2, "VALID"))
    return y, tape.gradient(y, x)

  f = gs.function(fn, mesh=mesh, in_shardings=spec, out_shardings=(P(), spec))
  low = f.lower(tf.TensorSpec(x.shape))
  assert "all-gather" not in low.report.counts(), str(low.report)
  for got, want in zip(f(x), fn(tf.constant(x))):
    assert_close(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [3, 5, 2])
def test_conv_gradients_keep_rows_split_with_halos_only(rng, kernel):
  mesh = gs.Mesh((2, 4), ("data", "spatial"))
  x = rng.standard_normal((4, 16, 10, 3)).astype(np.float32)
  w = rng.standard_normal((kernel, 3, 3, 5)).astype(np.float32)

  def f(a, k):
    with tf.GradientTape() as tape:
      tape.watch([a, k])
      y = tf.nn.conv2d(a, k, 1, "SAME")
      loss = tf.reduce_sum(tf.tanh(y) * tf.cos(y))
    return tape.gradient(loss, [a, k])

  g = gs.function(f, mesh=mesh, in_shardings=(P("data", "spatial", None, None), P()))
  low = g.lower(tf.TensorSpec(x.shape), tf.TensorSpec(w.shape))
  kinds = low.report.counts()
  # the forward halos (reused by the filter gradient) and d_out's halos for the input gradient: a 2-row window
  # has one halo each way, wider ones two
  assert set(kinds) == {"collective-permute", "all-reduce"}, str(low.report)
  assert kinds["collective-permute"] == (2 if kernel == 2 else 4) and kinds["all-reduce"] == 1, str(low.report)
  assert low.out_shardings[0].spec == P("data", "spatial", None, None)
  for got, want in zip(g(x, w), f(tf.constant(x), tf.constant(w))):
    assert_close(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", [P(None, None, "b"), P(None, "a", "b")], ids=["width", "height_and_width"])
def test_same_avg_pool_with_split_width_scales_its_edge_windows(rng, spec):
  """Regression: the per-device count of a SAME average's edge windows along a split width lies along the width
  (it was laid along the height, a shape error)."""
  mesh = gs.Mesh((2, 4), ("a", "b"))
  x = rng.uniform(-1, 1, (2, 9, 6, 2)).astype(np.float32)
  g = rng.uniform(-1, 1, (2, 9, 6, 2)).astype(np.float32)

  def fn(x, g):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.nn.avg_pool2d(x, 3, 1, "SAME")
      loss = tf.reduce_sum(y * g)
    return y, tape.gradient(loss, x)

  f = gs.function(fn, mesh=mesh, in_shardings=(spec, spec))
  for got, want in zip(f(x, g), fn(tf.constant(x), tf.constant(g))):
    assert_close(got.numpy(), want.numpy())
