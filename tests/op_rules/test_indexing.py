"""Concat/stack/split, slices, pad, tile, broadcast, scans, arg/top-k, one-hot, gather, segment sums."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))
SPECS = [P(), P("data", "model"), P("model", None), P(None, ("data", "model"))]


def check(fn, args, specs, out=None, mesh=MESH):
  f = gs.function(fn, mesh=mesh, in_shardings=specs, out_shardings=out)
  got = f(*args)
  want = fn(*[tf.constant(a) for a in args])
  for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
    assert_close(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5)
  return f.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])


def _x(rng, shape=(8, 12)):
  return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_concat_stack_unstack_split(rng, spec):
  def fn(a, b):
    c = tf.concat([a, b], axis=1)
    s = tf.stack([a, b], axis=1)
    u = tf.unstack(a[:4], axis=0)
    p, q = tf.split(c, 2, axis=0)
    r, t = tf.split(c, [5, 19], axis=1)
    return c, s, u[1], p, q, r, t

  check(fn, [_x(rng), _x(rng)], (spec, spec))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_slices_pad_tile(rng, spec):
  def fn(a):
    return (tf.slice(a, [0, 2], [8, 5]), a[:, 3:9], a[1], a[2:6, :], tf.pad(a, [[1, 2], [0, 0]]),
            tf.pad(a, [[0, 0], [3, 1]], constant_values=2.0), tf.tile(a, [1, 2]), tf.tile(a, [3, 1]))

  check(fn, [_x(rng)], (spec,))


def test_slices_and_pads_keep_the_operand_layout():
  def fn(a):
    return tf.identity(a[:, 3:9], name="s"), tf.identity(tf.pad(a, [[1, 1], [0, 0]]), name="p")

  low = gs.function(fn, mesh=MESH, in_shardings=P("data", "model")).lower(tf.TensorSpec([8, 12]))
  # GSPMD's rule: slices and pads keep the operand's layout (split dims take windows with halos).
  assert low.shardings["s"].spec == P("data", "model")
  assert low.shardings["p"].spec == P("data", "model")


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_broadcast_scan_arg_topk(rng, spec):
  def fn(a, v):
    return (tf.broadcast_to(v, [8, 12]) + a, tf.math.cumsum(a, axis=1), tf.math.cumsum(a, axis=0, reverse=True),
            tf.argmax(a, axis=1), tf.argmin(a, axis=0), tf.math.top_k(a, k=3).values,
            tf.reduce_all(a > -1.0, axis=1), tf.reduce_any(a > 1.0))

  check(fn, [_x(rng), _x(rng, (12,))], (spec, None))


@pytest.mark.parametrize("spec", [P(), P("data"), P("model")], ids=str)
def test_one_hot_and_segment_sum(rng, spec):
  ids = rng.integers(0, 6, size=(8,)).astype(np.int32)
  data = _x(rng, (8, 12))

  def fn(i, d):
    return tf.one_hot(i, 6), tf.math.unsorted_segment_sum(d, i, 6), tf.one_hot(i, 6, axis=0)

  check(fn, [ids, data], (spec, P(spec[0] if spec else None, None)))


def test_segment_sum_over_split_ids_is_partial_sum_all_reduce(rng):
  ids = rng.integers(0, 5, size=(17,)).astype(np.int32)
  data = _x(rng, (17, 6))
  low = check(lambda i, d: tf.math.unsorted_segment_sum(d, i, 5), [ids, data], (P("data"), P("data", None)))
  assert low.report.counts() == {"all-reduce": 1}


@pytest.mark.parametrize("table_spec,ids_spec", [
    (P("model", None), P("data", None)),      # workload 6's layout: vocabulary split
    (P(None, "model"), P("data", None)),      # embedding dim split
    (P(), P(("data", "model"), None)),
    (P(("data", "model"), None), P()),
])
def test_gather(rng, table_spec, ids_spec):
  table = _x(rng, (50, 16))
  ids = rng.integers(0, 50, size=(4, 6)).astype(np.int32)
  low = check(lambda t, i: tf.gather(t, i), [table, ids], (table_spec, ids_spec))
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


@pytest.mark.parametrize("mesh_shape,spec,shape", [((4,), P("d", None), (17, 6)), ((8,), P("d", None), (16, 6)),
                                                   ((2, 4), P("b", "a"), (12, 6)), ((8,), P(None, "d"), (5, 24))],
                         ids=str)
def test_windowed_pad_and_slices_match(rng, mesh_shape, spec, shape):
  """Pad / Slice / StridedSlice along a split dim: halos from neighbours, or a gather when too far."""
  mesh = gs.Mesh(mesh_shape, ("d",) if len(mesh_shape) == 1 else ("a", "b"))
  x = rng.standard_normal(shape).astype(np.float32)
  n0, n1 = shape

  def fn(t):
    e = tf.exp(t)
    return (tf.pad(e, [[1, 2], [0, 1]], constant_values=3.0), tf.slice(e, [2, 1], [n0 - 3, n1 - 1]), e[1:-1],
            e[:, 2:], tf.concat([e, e * 2.0], 0), e[2:n0 - 1, 1:3])

  f = gs.function(fn, mesh=mesh, in_shardings=spec, out_shardings=spec)
  for got, want in zip(f(x), fn(tf.constant(x))):
    assert_close(got.numpy(), want, rtol=1e-6, atol=1e-6)


def test_pad_and_slice_along_split_dim_exchange_halos_only():
  mesh = gs.Mesh((4,), ("d",))
  f = gs.function(lambda t: (tf.pad(t, [[1, 1], [0, 0]]), t[1:15] * 2.0), mesh=mesh, in_shardings=P("d", None),
                  out_shardings=P("d", None))
  low = f.lower(tf.TensorSpec([16, 8]))
  assert set(low.report.counts()) == {"collective-permute"}
  # pad: 1 row from the previous shard, up to 3 from the next (18 rows re-split 5 per device); slice: 1 row
  assert sorted(c.shape[0] for c in low.report.collectives) == [1, 1, 3]


@pytest.mark.parametrize("op", [tf.argmax, tf.argmin])
@pytest.mark.parametrize("cols", [64, 61])
def test_arg_reduce_over_a_split_dim_gathers_only_the_winners(rng, op, cols):
  mesh = gs.Mesh((2, 4), ("data", "model"))
  x = rng.standard_normal((8, 6, cols)).astype(np.float32)
  x[0, 0, :] = 1.0   # ties: the lowest index wins, as in TF
  f = gs.function(lambda a: op(a, axis=2, output_type=tf.int32), mesh=mesh, in_shardings=P("data", None, "model"))
  low = f.lower(tf.TensorSpec(x.shape))
  gathers = [c for c in low.report.collectives if c.kind == "all-gather"]
  assert gathers and all(c.shape[0] == 4 and c.shape[1:] == (4, 6) for c in gathers)   # winners only
  np.testing.assert_array_equal(f(x).numpy(), op(x, axis=2, output_type=tf.int32).numpy())


@pytest.mark.parametrize("index", ["ellipsis_new", "new_middle", "ellipsis_shrink", "new_and_range"])
def test_strided_slice_with_new_axes_and_ellipsis_keeps_the_split(rng, index):
  mesh = gs.Mesh((2, 4), ("data", "model"))
  x = rng.standard_normal((8, 12, 6)).astype(np.float32)
  fn = {"ellipsis_new": lambda a: a[..., None], "new_middle": lambda a: a[:, None, :, :],
        "ellipsis_shrink": lambda a: a[..., 2], "new_and_range": lambda a: a[:, :, None, 1:4]}[index]
  f = gs.function(fn, mesh=mesh, in_shardings=P("data", "model", None))
  low = f.lower(tf.TensorSpec(x.shape))
  assert low.report.collectives == [], str(low.report)   # no gather: the split dims pass through
  np.testing.assert_array_equal(f(x).numpy(), fn(tf.constant(x)).numpy())
