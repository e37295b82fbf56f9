"""Concat, stack, unstack and split; a concat along a split dim assembles each device's window."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close, check_partitioned
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))
SPECS = [P(), P("data", "model"), P("model", None), P(None, ("data", "model"))]


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

  check_partitioned(fn, [_x(rng), _x(rng)], (spec, spec), MESH)


@pytest.mark.parametrize("mesh_shape,spec,shape", [((4,), P("d", None), (17, 6)), ((8,), P("d", None), (16, 6)),
                                                   ((2, 4), P("b", "a"), (12, 6)), ((8,), P(None, "d"), (5, 24))],
                         ids=str)
def test_concat_along_a_split_dim_matches(rng, mesh_shape, spec, shape):
  """Concat along a split dim: windows from neighbours, or a gather when too far."""
  mesh = gs.Mesh(mesh_shape, ("d",) if len(mesh_shape) == 1 else ("a", "b"))
  x = rng.standard_normal(shape).astype(np.float32)

  def fn(t):
    e = tf.exp(t)
    return tf.concat([e, e * 2.0], 0)

  f = gs.function(fn, mesh=mesh, in_shardings=spec, out_shardings=spec)
  assert_close(f(x).numpy(), fn(tf.constant(x)), rtol=1e-6, atol=1e-6)


def test_concat_along_a_split_dim_keeps_signed_zeros_and_nans():
  """Each row of the result is selected from the operand it comes from (no sum of zero-filled windows)."""
  mesh = gs.Mesh((4,), ("d",))
  a = np.array([[-0.0, np.nan]], np.float32)
  b = np.array([[-0.0, np.inf], [3.0, -0.0], [np.nan, -1.0]], np.float32)
  fn = lambda x, y: tf.concat([x, y], 0)
  f = gs.function(fn, mesh=mesh, in_shardings=(P("d", None), P("d", None)), out_shardings=P("d", None))
  assert "all-gather" not in f.lower(tf.TensorSpec(a.shape), tf.TensorSpec(b.shape)).report.counts()   # windows
  got, want = f(a, b).numpy(), fn(a, b).numpy()
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _permutes(low):
  return [c for c in low.report.collectives if c.kind == "collective-permute"]


@pytest.mark.parametrize("mesh_shape,spec,shape,shift,axis", [
    ((4, 2), P("a", "b"), (4, 6, 3), 1, 0),        # one row per device: the pipeline's stage shift
    ((4, 2), P("a", "b"), (4, 6, 3), -1, 0),
    ((4, 2), P("a", "b"), (8, 6, 3), 2, 0),        # a whole shard of 2 rows
    ((4, 2), P("a", "b"), (8, 6, 3), 3, 0),        # shard boundaries move: two permutes
    ((4, 2), P("a", "b"), (8, 6, 3), [1, 2], [0, 1]),
    ((8,), P("a", None), (8, 5), 9, 0),
    ((2, 4), P(("a", "b"), None), (8, 5), 1, 0),   # a dim split over two axes
    ((4, 2), P("a", "b"), (4, 6, 3), 1, 2),        # a whole dim rolls locally
], ids=str)
def test_roll_along_a_split_dim_is_exact_permutes(rng, mesh_shape, spec, shape, shift, axis):
  """A rotation along a split dim moves whole shards (or the two parts of them each device needs) by
  collective-permutes: never a gather, and one permute of the local buffer when the shift is one shard."""
  mesh = gs.Mesh(mesh_shape, ("a", "b")[:len(mesh_shape)])
  x = rng.standard_normal(shape).astype(np.float32)

  def fn(t):
    return tf.roll(t * 2.0, shift, axis)

  low = check_partitioned(fn, [x], spec, mesh, out=spec, tol=0)
  counts = low.report.counts()
  assert set(counts) <= {"collective-permute"}, counts
  tiles = np.prod([mesh.axis_size(a) for d in spec for a in ((d,) if isinstance(d, str) else d or ())])
  shard = x.nbytes // tiles
  permutes = _permutes(low)
  if shape == (8, 6, 3) and shift == 3:
    assert len(permutes) == 2 and sum(p.bytes for p in permutes) == shard
  elif axis == 2:
    assert not permutes
  elif isinstance(shift, int):
    assert len(permutes) == 1 and permutes[0].bytes == shard


def test_roll_stage_shift_sends_the_local_buffer_once(rng):
  """The GSPMD pipeline's shift: buffer [stages, microbatch, d] split over `stage`, one stage per device:
  exactly one collective-permute, whose bytes (logical and on the wire) are one stage's buffer."""
  mesh = gs.Mesh((4, 2), ("stage", "data"))
  buf = rng.standard_normal((4, 6, 8)).astype(np.float32)
  low = check_partitioned(lambda b: tf.roll(b, 1, 0), [buf], P("stage", "data"), mesh, out=P("stage", "data"), tol=0)
  (p,) = low.report.collectives
  local = 1 * 3 * 8 * 4
  assert p.kind == "collective-permute" and p.axes == ("stage",) and p.bytes == local
  assert low.report.bytes_per_device() == local


def test_roll_gradient_is_the_opposite_rotation(rng):
  mesh = gs.Mesh((4, 2), ("stage", "data"))
  x = rng.standard_normal((4, 6)).astype(np.float32)

  def fn(t):
    with tf.GradientTape() as tape:
      tape.watch(t)
      y = tf.roll(tf.sin(t), 1, 0)
      loss = tf.reduce_sum(y * tf.range(4, dtype=tf.float32)[:, None])
    return tape.gradient(loss, t)

  low = check_partitioned(fn, [x], P("stage", "data"), mesh, out=P("stage", "data"))
  assert set(low.report.counts()) <= {"collective-permute", "all-reduce"}, low.report.counts()
  assert "all-gather" not in low.report.counts()


@pytest.mark.parametrize("mesh_shape,spec,shape,axis", [
    ((4, 2), P("a", "b"), (8, 6, 3), [0]),         # each shard to its mirror: one permute
    ((4, 2), P("a", "b"), (8, 6, 3), [0, 1]),      # two split dims, one permute each
    ((4, 2), P("a", "b"), (8, 6, 3), [2]),         # a whole dim reverses locally
    ((4, 2), P("a", "b"), (8, 6, 3), [-1, 0]),
    ((2, 4), P(("a", "b"), None), (8, 5), [0]),    # a dim split over two axes
    ((8,), P("a", None), (13, 5), [0]),            # uneven: mirror, then the padding rotated to the end
    ((4, 2), P("a", "b"), (6, 7, 3), [0, 1]),
], ids=str)
def test_reverse_along_a_split_dim_swaps_mirrored_shards(rng, mesh_shape, spec, shape, axis):
  mesh = gs.Mesh(mesh_shape, ("a", "b")[:len(mesh_shape)])
  x = rng.standard_normal(shape).astype(np.float32)
  fn = lambda t: tf.reverse(t * 2.0, axis)
  low = check_partitioned(fn, [x], spec, mesh, out=spec, tol=0)
  assert low.report.fallbacks == ()
  counts = low.report.counts()
  assert set(counts) <= {"collective-permute"}, counts
  split = [d % len(shape) for d in axis if d % len(shape) < len(spec) and spec[d % len(shape)]]
  even = all(shape[d] % np.prod([mesh.axis_size(a) for a in ((spec[d],) if isinstance(spec[d], str)
                                                              else spec[d])]) == 0 for d in split)
  if even:
    assert counts.get("collective-permute", 0) == len(split)
  else:
    assert counts.get("collective-permute", 0) >= len(split)


def test_reverse_with_axes_read_at_run_time_keeps_reversed_dims_whole(rng):
  x = rng.standard_normal((8, 6)).astype(np.float32)
  fn = lambda t, k: tf.reverse(t, tf.reshape(k, [1]))
  mesh = gs.Mesh((2, 4), ("a", "b"))
  check_partitioned(fn, [x, np.array(1, np.int32)], (P("a", "b"), P()), mesh, tol=0)
