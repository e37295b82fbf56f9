"""Reshape groups, Transpose, ExpandDims, Squeeze, Bitcast, Tile, BroadcastTo; completion and results."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close, check_partitioned
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.ops.shape_ops import reshape_groups

MESH = gs.Mesh((2, 4), ("data", "model"))


@pytest.mark.parametrize("src,dst,groups", [
    ((4, 1, 8), (4, 8), [([0], [0]), ([1, 2], [1])]),
    ((16, 32, 64), (16, 2048), [([0], [0]), ([1, 2], [1])]),
    ((6, 4), (4, 6), [([0, 1], [0, 1])]),
    ((4,), (4, 1), [([0], [0]), ([], [1])]),
    ((2, 3, 4), (24,), [([0, 1, 2], [0])]),
    ((24,), (2, 3, 4), [([0], [0, 1, 2])]),
])
def test_reshape_groups(src, dst, groups):
  assert reshape_groups(src, dst) == groups


def test_reshape_transpose_workload():
  """Workload 8: transpose(reshape(x,[16,2048])) @ w on (4,): one all-reduce f32[2048,8] = 65,536 bytes."""
  mesh = gs.Mesh((4,), ("data",))

  def f(x, w):
    return tf.transpose(tf.reshape(x, [16, 2048])) @ w

  g = gs.function(f, mesh=mesh, in_shardings=(P("data", None, None), P()))
  low = g.lower(tf.TensorSpec([16, 32, 64]), tf.TensorSpec([16, 8]))
  assert low.report.counts() == {"all-reduce": 1} and low.report.bytes_per_device() == 65536
  assert low.shardings["Reshape"].spec == P("data", None)
  rng = np.random.default_rng(1)
  x = rng.standard_normal((16, 32, 64), np.float32)
  w = rng.standard_normal((16, 8), np.float32)
  assert_close(g(x, w).numpy(), f(x, w), rtol=1e-4, atol=1e-4)


def _views(x):
  y = tf.reshape(x, [4, 6, 8])
  z = tf.expand_dims(tf.transpose(y, [2, 0, 1]), 1)
  return tf.squeeze(z * 2.0, [1]), tf.reshape(x, [24, 8]), tf.reshape(y, [2, 2, 48])


@pytest.mark.parametrize("spec", [P("data", "model"), P(None, "model"), P("model", "data"), P(("data", "model")),
                                  P()], ids=str)
def test_views_match_unpartitioned(rng, spec):
  x = rng.standard_normal((24, 8), np.float32)
  f = gs.function(_views, mesh=MESH, in_shardings=spec)
  for got, want in zip(f(x), _views(x)):
    assert_close(got.numpy(), want, rtol=0, atol=0)


def test_split_reshape_is_local():
  f = gs.function(lambda x: tf.reshape(x, [8, 4, 6]) + 1.0, mesh=MESH, in_shardings=P(("data", "model"), None))
  low = f.lower(tf.TensorSpec([32, 6]))
  assert low.report.collectives == ()
  assert low.out_shardings[0].spec == P(("data", "model"), None, None)


def test_transpose_and_expand_dims_completion():
  def f(x):
    t = tf.identity(tf.transpose(x, [1, 0]), name="t")
    return tf.identity(tf.expand_dims(t, 0), name="e")

  low = gs.function(f, mesh=MESH, in_shardings=P("data", "model")).lower(tf.TensorSpec([8, 8]))
  assert low.shardings["t"].spec == P("model", "data")
  assert low.shardings["e"].spec == P(None, "model", "data")


@pytest.mark.parametrize("dtype", [tf.int32, tf.uint8, tf.float64])
def test_bitcast_keeps_the_dims_it_does_not_resize(rng, dtype):
  mesh = gs.Mesh((2, 4), ("data", "model"))
  x = rng.standard_normal((8, 12)).astype(np.float32)

  def fn(v):
    if dtype == tf.float64:
      v = tf.reshape(v, [8, 6, 2])
    return tf.bitcast(v, dtype)

  f = gs.function(fn, mesh=mesh, in_shardings=P("data", "model"))
  low = f.lower(tf.TensorSpec(x.shape))
  assert low.report.fallbacks == ()
  assert low.out_shardings[0].dims[0] == ("data",)
  if dtype == tf.int32:
    assert low.out_shardings[0].spec == P("data", "model")
  np.testing.assert_array_equal(f(x).numpy(), fn(x).numpy())


@pytest.mark.parametrize("spec", [P(), P("data", "model"), P("model", None), P(None, ("data", "model"))], ids=str)
def test_tile_and_broadcast_to(rng, spec):
  def fn(a, v):
    return tf.tile(a, [1, 2]), tf.tile(a, [3, 1]), tf.broadcast_to(v, [8, 12]) + a

  args = [rng.standard_normal((8, 12)).astype(np.float32), rng.standard_normal((12,)).astype(np.float32)]
  check_partitioned(fn, args, (spec, None), MESH)
