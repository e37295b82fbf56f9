"""GatherV2 (a vocabulary-split table is never gathered), ResourceGather, GatherNd and its gradient, OneHot."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close, assert_report_counts_program, check_partitioned
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))


@pytest.mark.parametrize("table_spec,ids_spec", [
    (P("model", None), P("data", None)),      # workload 6's layout: vocabulary split
    (P(None, "model"), P("data", None)),      # embedding dim split
    (P(), P(("data", "model"), None)),
    (P(("data", "model"), None), P()),
])
def test_gather(rng, table_spec, ids_spec):
  table = rng.standard_normal((50, 16)).astype(np.float32)
  ids = rng.integers(0, 50, size=(4, 6)).astype(np.int32)
  low = check_partitioned(lambda t, i: tf.gather(t, i), [table, ids], (table_spec, ids_spec), MESH)
  for c in low.report.collectives:
    assert c.kind != "all-gather" or c.shape[0] < 50, "the table must never be gathered"


def test_embedding_workload_matches_xla(rng):
  """Workload 6: table[32000,512] P('model',None), ids[64,128] P('data',None): masked local gather + one
  all-reduce f32[32,128,512] over `model` = 8,388,608 bytes; the table is never gathered."""
  f = gs.function(lambda t, i: tf.gather(t, i), mesh=MESH, in_shardings=(P("model", None), P("data", None)),
                  out_shardings=P("data", None, None))
  low = f.lower(tf.TensorSpec([32000, 512]), tf.TensorSpec([64, 128], tf.int32))
  assert low.report.counts() == {"all-reduce": 1}
  (c,) = low.report.collectives
  assert c.shape == (32, 128, 512) and c.axes == ("model",) and low.report.bytes_per_device() == 8388608


def test_resource_gather_from_a_row_split_variable(rng):
  """A variable split by rows is looked up where it is (masked local rows), then one all-reduce."""
  w0 = rng.standard_normal((10, 3)).astype(np.float32)
  w = tf.Variable(w0)
  ids = np.array([[0, 9, 4], [4, 7, 2]], np.int32)

  def fn(i):
    gs.shard(w, P("model", None))
    return tf.gather(w, i)

  f = gs.function(fn, mesh=MESH, in_shardings=P("data", None))
  assert_close(f(ids).numpy(), w0[ids])
  low = f.lower(tf.TensorSpec(ids.shape, tf.int32))
  assert low.report.counts() == {"all-reduce": 1}


@pytest.mark.parametrize("table_spec,ids_spec", [
    (P("model", None), P()),
    (P("model", None), P("data", None)),       # only the devices holding the bad id see it
    (P(("data", "model"), None), P()),
])
@pytest.mark.parametrize("bad", [[[0, 12], [1, 2]], [[-1, 3], [0, 1]], [[10, 2], [3, 4]]], ids=str)
def test_gather_out_of_range_raises_like_tf(table_spec, ids_spec, bad):
  """An id outside the table raises TF's InvalidArgumentError on every layout, as tf.gather does on CPU; a row of
  the table (a clamped id) is never returned. The function runs again afterwards."""
  table = np.arange(40, dtype=np.float32).reshape(10, 4)
  bad = np.array(bad, np.int32)
  with pytest.raises(tf.errors.InvalidArgumentError):
    tf.gather(tf.constant(table), bad)
  f = gs.function(lambda t, i: tf.gather(t, i), mesh=MESH, in_shardings=(table_spec, ids_spec))
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices must be in \[0, 10\)"):
    f(table, bad)
  good = np.array([[0, 9], [5, 3]], np.int32)
  assert_close(f(table, good).numpy(), table[good])


def test_gather_from_a_split_variable_out_of_range_raises():
  """The same for ResourceGather from a variable stored split by rows."""
  w = gs.variable(gs.initializers.zeros(), (10, 3), mesh=MESH, spec=P("model", None))
  w.assign(np.arange(30, dtype=np.float32).reshape(10, 3))
  f = gs.function(lambda i: tf.gather(w, i), mesh=MESH)
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices must be in \[0, 10\)"):
    f(np.array([2, 10], np.int32))
  assert_close(f(np.array([2, 9], np.int32)).numpy(), np.arange(30, dtype=np.float32).reshape(10, 3)[[2, 9]])


def test_resource_gather_from_a_variable_nothing_else_reads(rng):
  """tf.gather is the captured variable's only use (ResourceGather, no read or write states its shape): the shape
  comes from the variable the function captured."""
  w0 = rng.standard_normal((10, 3)).astype(np.float32)
  w = tf.Variable(w0)
  ids = np.array([[0, 9, 4], [4, 7, 2]], np.int32)
  f = gs.function(lambda i: tf.gather(w, i) * 2.0, mesh=MESH, in_shardings=P("data", None))
  assert_close(f(ids).numpy(), w0[ids] * 2.0)
  assert f.lower(tf.TensorSpec(ids.shape, tf.int32)).report.counts() == {}   # w replicated: no collective


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


@pytest.mark.parametrize("spec", [P(), P("data"), P("model")], ids=str)
def test_one_hot(rng, spec):
  ids = rng.integers(0, 6, size=(8,)).astype(np.int32)
  check_partitioned(lambda i: (tf.one_hot(i, 6), tf.one_hot(i, 6, axis=0)), [ids], (spec,), MESH)


M8 = gs.Mesh((8,), ("m",))


@pytest.mark.parametrize("out", [None, P(None, "m", None)], ids=["replicated_out", "split_out"])
@pytest.mark.parametrize("axis_size", [30, 1024])
def test_gather_a_few_indices_of_a_split_axis(rng, axis_size, out):
  """tf.gather(x, [3, 17, ...], axis=1) with axis 1 split (30: uneven over 8): each device looks up the indices it
  holds, zeros the others; one result-sized all-reduce (a reduce-scatter into a split result)."""
  x = rng.standard_normal((4, axis_size, 6)).astype(np.float32)
  ids = np.array([3, 17, axis_size - 1, 17, 0, 9, 28, 21], np.int32)
  low = check_partitioned(lambda t: tf.gather(t, ids, axis=1), [x], (P(None, "m", None),), M8, out=out)
  assert_report_counts_program(low)
  result = x[:, ids].nbytes
  assert low.report.bytes_per_device() <= result, str(low.report)
  assert not any(c.kind == "all-gather" for c in low.report.collectives), str(low.report)


@pytest.mark.parametrize("stored", ["gs_variable_split", "shard_annotated", "replicated"])
def test_embedding_lookup_from_a_variable(rng, recwarn, stored):
  """tf.nn.embedding_lookup is a ResourceGather under a colocation constraint (`_class: loc:@`): its output keeps
  its shape, so the ResourceGather rule runs -- a row-split table is looked up where it is (masked local rows,
  one all-reduce), a replicated one locally -- with no replicated fallback and no unknown rank."""
  w0 = rng.standard_normal((10, 4)).astype(np.float32)
  if stored == "gs_variable_split":
    w = gs.variable(gs.initializers.zeros(), (10, 4), mesh=MESH, spec=P("model", None))
    w.assign(w0)
  else:
    w = tf.Variable(w0)
  ids = np.array([[0, 9, 4], [4, 7, 2]], np.int32)

  def fn(i):
    if stored == "shard_annotated":
      gs.shard(w, P("model", None))
    return tf.nn.embedding_lookup(w, i)

  f = gs.function(fn, mesh=MESH, in_shardings=P("data", None))
  assert_close(f(ids).numpy(), tf.nn.embedding_lookup(tf.constant(w0), ids).numpy())
  low = f.lower(tf.TensorSpec(ids.shape, tf.int32))
  assert low.report.counts() == ({} if stored == "replicated" else {"all-reduce": 1}), str(low.report)
  assert low.report.fallbacks == () and not [m for m in low.report.warnings if "unknown rank" in m], str(low.report)
  assert not [r for r in recwarn if "unknown rank" in str(r.message)]
