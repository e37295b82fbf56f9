"""ScatterNd, TensorScatter*, UnsortedSegmentSum (split ids: partial sums and one all-reduce)."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close, check_partitioned
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))


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


@pytest.mark.parametrize("spec", [P(), P("data"), P("model")], ids=str)
def test_segment_sum(rng, spec):
  ids = rng.integers(0, 6, size=(8,)).astype(np.int32)
  data = rng.standard_normal((8, 12)).astype(np.float32)
  check_partitioned(lambda i, d: tf.math.unsorted_segment_sum(d, i, 6), [ids, data],
                    (spec, P(spec[0] if spec else None, None)), MESH)


def test_segment_sum_over_split_ids_is_partial_sum_all_reduce(rng):
  ids = rng.integers(0, 5, size=(17,)).astype(np.int32)
  data = rng.standard_normal((17, 6)).astype(np.float32)
  low = check_partitioned(lambda i, d: tf.math.unsorted_segment_sum(d, i, 5), [ids, data],
                          (P("data"), P("data", None)), MESH)
  assert low.report.counts() == {"all-reduce": 1}


def _steps(x, k):
  """Lingvo's Recurrent accumulators: an Empty [steps, ...] seeded row by row with InplaceUpdate, then rows added
  to and subtracted from."""
  acc = tf.raw_ops.Empty(shape=[4, 8, 16], dtype=tf.float32, init=k == 0)
  for t in range(4):
    acc = tf.raw_ops.InplaceUpdate(x=acc, i=[t], v=tf.expand_dims(tf.tanh(x * (t + 1.0)), 0))
  acc = tf.raw_ops.InplaceAdd(x=acc, i=[1, 3], v=tf.stack([x, 2.0 * x]))
  return tf.raw_ops.InplaceSub(x=acc, i=[0], v=tf.expand_dims(x * x, 0))


@pytest.mark.parametrize("spec,result", [(P("data", "model"), P(None, "data", "model")),
                                         (P(None, "model"), P(None, None, "model")), (P(), P())], ids=str)
@pytest.mark.parametrize("init", [0, 1], ids=["init", "uninitialised"])
def test_empty_and_inplace_updates_keep_the_step_dims_split(rng, spec, result, init):
  x = rng.standard_normal((8, 16)).astype(np.float32)
  low = check_partitioned(lambda t: _steps(t, init), [x], spec, MESH, tol=1e-6)
  assert low.report.fallbacks == ()
  assert low.report.collectives == ()   # every device writes its own shard of every row
  assert low.out_shardings[0].spec in (result, P(None, None, None) if result == P() else result)


def test_inplace_update_in_a_loop_at_the_step_index(rng):
  """The accumulator written at the loop counter (Recurrent's forward loop): rows whole, others split."""
  def fn(x):
    def body(i, acc):
      row = tf.expand_dims(tf.nn.relu(x * tf.cast(i + 1, tf.float32)), 0)
      return i + 1, tf.raw_ops.InplaceUpdate(x=acc, i=tf.reshape(i, [1]), v=row)
    acc = tf.raw_ops.Empty(shape=[3, 8, 16], dtype=tf.float32, init=True)
    return tf.while_loop(lambda i, acc: i < 3, body, [0, acc])[1]

  x = rng.standard_normal((8, 16)).astype(np.float32)
  low = check_partitioned(fn, [x], P("data", "model"), MESH, tol=1e-6)
  assert low.report.fallbacks == () and low.report.collectives == ()
  assert low.out_shardings[0].spec == P(None, "data", "model")


@pytest.mark.parametrize("method", ["scatter_add", "scatter_sub", "scatter_max", "scatter_update"])
def test_scatter_into_a_row_split_variable(method):
  """var.scatter_*(rows) into a variable split by rows: each device writes its own rows, equal to plain TF's; an
  index outside the variable raises InvalidArgumentError as TF's does (a padding row or no row would be written)
  and leaves the variable as it was."""
  start = np.arange(30, dtype=np.float32).reshape(10, 3)
  updates = np.full((2, 3), 5.0, np.float32)
  w = gs.variable(gs.initializers.zeros(), (10, 3), mesh=MESH, spec=P("model", None))
  plain = tf.Variable(start)

  def step(v, i):
    return getattr(v, method)(tf.IndexedSlices(tf.constant(updates), i)).read_value()

  f = gs.function(lambda i: step(w, i), mesh=MESH)
  for bad in ([1, 10], [-1, 2]):
    with pytest.raises(tf.errors.InvalidArgumentError):
      step(plain, tf.constant(bad, tf.int32))
    w.assign(start)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices must be in \[0, 10\)"):
      f(np.array(bad, np.int32))
    assert_close(w.numpy(), start)
  w.assign(start)
  plain.assign(start)   # (TF's own scatter may have written rows before it raised)
  assert_close(f(np.array([1, 9], np.int32)).numpy(), step(plain, tf.constant([1, 9])).numpy())
