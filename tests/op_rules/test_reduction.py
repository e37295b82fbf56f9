"""Logical reductions, arg-max/min (over a split dim: only the winners move), top-k and cumulative scans."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import check_partitioned
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))
SPECS = [P(), P("data", "model"), P("model", None), P(None, ("data", "model"))]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_scan_arg_top_k_and_logical_reductions(rng, spec):
  def fn(a):
    return (tf.math.cumsum(a, axis=1), tf.math.cumsum(a, axis=0, reverse=True), tf.argmax(a, axis=1),
            tf.argmin(a, axis=0), tf.math.top_k(a, k=3).values, tf.reduce_all(a > -1.0, axis=1),
            tf.reduce_any(a > 1.0))

  check_partitioned(fn, [rng.standard_normal((8, 12)).astype(np.float32)], (spec,), MESH)


@pytest.mark.parametrize("op", [tf.argmax, tf.argmin])
@pytest.mark.parametrize("cols", [64, 61])
def test_arg_reduce_over_a_split_dim_gathers_only_the_winners(rng, op, cols):
  x = rng.standard_normal((8, 6, cols)).astype(np.float32)
  x[0, 0, :] = 1.0   # ties: the lowest index wins, as in TF
  f = gs.function(lambda a: op(a, axis=2, output_type=tf.int32), mesh=MESH, in_shardings=P("data", None, "model"))
  low = f.lower(tf.TensorSpec(x.shape))
  gathers = [c for c in low.report.collectives if c.kind == "all-gather"]
  assert gathers and all(c.shape[0] == 4 and c.shape[1:] == (4, 6) for c in gathers)   # winners only
  np.testing.assert_array_equal(f(x).numpy(), op(x, axis=2, output_type=tf.int32).numpy())


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("cols,k", [(64, 5), (61, 5), (12, 7)], ids=str)
def test_top_k_over_a_split_dim_gathers_only_each_shard_s_top_k(rng, dtype, cols, k):
  """Values and indices as TF's kernel gives them, ties to the lower index (many ties in the int case), uneven
  shards, and k more than a shard holds (3 columns a shard, k=7)."""
  x = (rng.standard_normal((8, 6, cols)) * (3 if dtype == np.int32 else 1)).astype(dtype)
  x[0, 0, :] = 1   # a row of ties
  f = gs.function(lambda a: tf.math.top_k(a, k), mesh=MESH, in_shardings=P("data", None, "model"))
  got, want = f(x), tf.math.top_k(x, k)
  np.testing.assert_array_equal(got.values.numpy(), want.values.numpy())
  np.testing.assert_array_equal(got.indices.numpy(), want.indices.numpy())
  low = f.lower(tf.TensorSpec(x.shape, tf.as_dtype(dtype)))
  gathers = [c for c in low.report.collectives if c.kind == "all-gather"]
  c = -(-cols // 4)
  assert gathers and all(g.shape == (4, 4, 6, min(k, c)) for g in gathers), str(low.report)   # candidates only


@pytest.mark.parametrize("cols", [64, 61])
@pytest.mark.parametrize("op,x_of", [(tf.reduce_all, lambda a: a > -3.0), (tf.reduce_any, lambda a: a > 3.0)],
                         ids=["all", "any"])
def test_logical_reduction_over_a_split_dim_all_reduces_its_result(rng, op, x_of, cols):
  """All and Any over a split dim reduce each shard and all-reduce the small result (Min / Max of the booleans
  carried as int32): nothing of the operand's size moves. Uneven shards are padded with the identity."""
  x = rng.standard_normal((8, 6, cols)).astype(np.float32)
  x[1, 2, cols - 1] = 9.0 if op is tf.reduce_any else -9.0   # one row flips, in the last (padded) shard
  f = gs.function(lambda a: (op(x_of(a), axis=2), op(x_of(a))), mesh=MESH, in_shardings=P("data", None, "model"))
  got, want = f(x), (op(x_of(x), axis=2), op(x_of(x)))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g.numpy(), w.numpy())
  assert want[0].numpy().any() and not want[0].numpy().all()   # both values occur
  low = f.lower(tf.TensorSpec(x.shape))
  assert not [c for c in low.report.collectives if c.kind == "all-gather"], str(low.report)
  reduces = [c for c in low.report.collectives if c.kind == "all-reduce"]
  assert reduces and all(c.bytes <= 4 * 6 for c in reduces), str(low.report)
