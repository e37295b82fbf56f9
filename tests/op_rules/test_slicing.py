"""Slice, StridedSlice (new axes, ellipsis, shrunk dims), its gradient, and pads: split dims take windows."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close, check_partitioned
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))
SPECS = [P(), P("data", "model"), P("model", None), P(None, ("data", "model"))]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_slices_and_pads(rng, spec):
  def fn(a):
    return (tf.slice(a, [0, 2], [8, 5]), a[:, 3:9], a[1], a[2:6, :], tf.pad(a, [[1, 2], [0, 0]]),
            tf.pad(a, [[0, 0], [3, 1]], constant_values=2.0))

  check_partitioned(fn, [rng.standard_normal((8, 12)).astype(np.float32)], (spec,), MESH)


def test_slices_and_pads_keep_the_operand_layout():
  def fn(a):
    return tf.identity(a[:, 3:9], name="s"), tf.identity(tf.pad(a, [[1, 1], [0, 0]]), name="p")

  low = gs.function(fn, mesh=MESH, in_shardings=P("data", "model")).lower(tf.TensorSpec([8, 12]))
  # GSPMD's rule: slices and pads keep the operand's layout (split dims take windows with halos).
  assert low.shardings["s"].spec == P("data", "model")
  assert low.shardings["p"].spec == P("data", "model")


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
            e[:, 2:], e[2:n0 - 1, 1:3])

  f = gs.function(fn, mesh=mesh, in_shardings=spec, out_shardings=spec)
  for got, want in zip(f(x), fn(tf.constant(x))):
    assert_close(got.numpy(), want, rtol=1e-6, atol=1e-6)


def test_pad_and_slice_along_split_dim_exchange_halos_only():
  mesh = gs.Mesh((4,), ("d",))
  f = gs.function(lambda t: (tf.pad(t, [[1, 1], [0, 0]]), t[1:15] * 2.0), mesh=mesh, in_shardings=P("d", None),
                  out_shardings=P("d", None))
  low = f.lower(tf.TensorSpec([16, 8]))
  assert set(low.report.counts()) == {"collective-permute"}
  # pad: 18 rows re-split 5 per device; device 1 takes 1 row from the next shard, device 2 takes 2 (rows before
  # the first and past the last are padding, so nothing is sent for them); slice: 1 row
  assert sorted(c.shape[0] for c in low.report.collectives) == [1, 2]


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


@pytest.mark.parametrize("spec", [P(), P("data", "model"), P(None, "model")], ids=str)
def test_strided_slice_gradient(rng, spec):
  def fn(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.reduce_sum(x[:, 2:7] ** 2) + tf.reduce_sum(x[3] * 2.0) + tf.reduce_sum(x[:, ::2])
    return tape.gradient(y, x)

  x = rng.standard_normal((8, 12)).astype(np.float32)
  f = gs.function(fn, mesh=MESH, in_shardings=spec)
  assert_close(f(x).numpy(), fn(tf.constant(x)), rtol=1e-5)
