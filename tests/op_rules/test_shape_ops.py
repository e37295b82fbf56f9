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


# Reshapes whose shard boundaries move: (input shape, input spec, output shape, output spec). Merges whose minor dim
# is split, merges of two split dims (a flattened [batch, rows, cols] as a per-pixel loss reads it), a batch split
# over more devices than it has rows (most shards padding), splits of an uneven dim and a split that moves from
# one group to another.
MOVING = [
    ((8, 12), P(None, "model"), (96,), P("model")),
    ((8, 12), P(None, "model"), (96,), None),
    ((4, 8, 6), P("data", "model", None), (192,), P(("data", "model"))),
    ((4, 8, 6), P("data", "model", None), (192,), P()),
    ((2, 8, 16), P("model", None, None), (16, 16), P()),
    ((3, 5, 7), P("model", None, "data"), (15, 7), P("model", "data")),
    ((6, 10), P("model", None), (3, 2, 10), P("model", None, None)),
    ((6, 10), P(None, "model"), (60,), P("model")),
    ((12, 10), P("model", None), (4, 30), P(None, "model")),
]


@pytest.mark.parametrize("shape,spec,out_shape,out_spec", MOVING, ids=[f"{a}{b}->{c}{d}" for a, b, c, d in MOVING])
def test_reshape_moving_shard_boundaries_matches_unpartitioned(rng, shape, spec, out_shape, out_spec):
  x = rng.standard_normal(shape).astype(np.float32)

  def f(x):
    return tf.reshape(x * 2.0, out_shape) + 1.0

  f_ = gs.function(f, mesh=MESH, in_shardings=spec, out_shardings=out_spec)
  assert_close(f_(x).numpy(), f(tf.constant(x)).numpy(), rtol=0, atol=0)


def _reshape_collectives(low):
  return [c for c in low.report.collectives if "Reshape" in c.source]


def test_reshape_moves_a_split_by_all_to_all_when_that_sends_less():
  """[8, 12] split on its minor dim flattened to [96] split over `model`: moving the split onto the major dim
  (one all-to-all of the shard) and reshaping locally sends less than gathering the input and slicing."""
  from tf_gspmd.rewriter.sharding import reshard  # pylint: disable=g-import-not-at-top
  from tf_gspmd._layout.sharding import Sharding  # pylint: disable=g-import-not-at-top
  x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
  f = gs.function(lambda x: tf.reshape(x, [96]), mesh=MESH, in_shardings=P(None, "model"), out_shardings=P("model"))
  assert_close(f(x).numpy(), x.reshape(-1), rtol=0, atol=0)
  low = f.lower(tf.TensorSpec([8, 12]))
  kinds = [c.kind for c in _reshape_collectives(low)]
  assert kinds == ["all-to-all"], str(low.report)
  gather = reshard.plan_bytes((8, 12), 4, Sharding.from_spec(MESH, P(None, "model")), Sharding.replicated(MESH, 2))
  moved = low.report.bytes_per_device()
  assert moved == 8 * 3 * 4 and moved < gather == 8 * 12 * 4


def test_reshape_keeps_the_gather_when_it_is_cheaper():
  """Replicating the result anyway: one gather of the input is the cheapest way; no extra all-to-all."""
  x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
  f = gs.function(lambda x: tf.reshape(x, [96]), mesh=MESH, in_shardings=P(None, "model"), out_shardings=P())
  assert_close(f(x).numpy(), x.reshape(-1), rtol=0, atol=0)
  low = f.lower(tf.TensorSpec([8, 12]))
  assert [c.kind for c in low.report.collectives] == ["all-gather"], str(low.report)
  assert low.report.bytes_per_device() == 8 * 12 * 4


def test_reshape_of_a_mostly_padded_split_moves_it_instead_of_gathering_the_padding():
  """A batch of 2 over 4 devices flattened with its tokens (the MoE loss's reshape on 2048 devices): gathering
  the batch dim sends every member's padded shard; moving the split to the class dim first sends less."""
  x = np.arange(2 * 8 * 16, dtype=np.float32).reshape(2, 8, 16)
  mesh = gs.Mesh((4,), ("e",))
  f = gs.function(lambda x: tf.reshape(x, [16, 16]), mesh=mesh, in_shardings=P("e", None, None), out_shardings=P())
  assert_close(f(x).numpy(), x.reshape(16, 16), rtol=0, atol=0)
  low = f.lower(tf.TensorSpec([2, 8, 16]))
  gathered = 4 * 1 * 8 * 16 * 4   # 4 members' [1, 8, 16] shards
  assert [c.kind for c in low.report.collectives] == ["all-to-all", "all-gather"], str(low.report)
  assert low.report.bytes_per_device() < gathered
