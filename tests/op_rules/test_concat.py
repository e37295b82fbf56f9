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
