"""Graph plumbing: IdentityN passes several independent values through, each in its own layout."""

import numpy as np
import tensorflow as tf

from conftest import check_partitioned
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))


def test_identity_n_keeps_every_value_split_on_the_same_axes(rng):
  """Independent values may share mesh axes (a custom gradient's IdentityN over all gradients)."""
  a = rng.standard_normal((8, 12)).astype(np.float32)
  b = rng.standard_normal((12, 16)).astype(np.float32)
  c = rng.standard_normal((16, 8)).astype(np.float32)

  def fn(x, y, z):
    return tf.raw_ops.IdentityN(input=[x * 2.0, y + 1.0, z])

  specs = (P(None, "model"), P("model", None), P("data", "model"))
  low = check_partitioned(fn, [a, b, c], specs, MESH, out=specs)
  assert low.report.counts() == {}   # nothing moves: every value stays where it is
  for k, spec in enumerate(specs):
    assert low.shardings["IdentityN" if k == 0 else f"IdentityN:{k}"].spec == spec


def test_custom_gradient_with_split_operands_moves_nothing(rng):
  """tf.custom_gradient wraps its inputs and results in IdentityN ops: every split operand stays split."""
  @tf.custom_gradient
  def pair(a, b, c, d):
    return (a * b, c * d), lambda g1, g2: (g1 * b, g1 * a, g2 * d, g2 * c)

  def fn(a, b, c, d):
    with tf.GradientTape() as tape:
      tape.watch([a, b, c, d])
      y1, y2 = pair(a, b, c, d)
      prod = y1 * y2   # (a non-scalar target: its gradient starts from ones, no reduction over split dims)
    return (prod,) + tuple(tape.gradient(prod, [a, b, c, d]))

  args = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(4)]
  low = check_partitioned(fn, args, (P("data", "model"),) * 4, MESH)
  assert low.report.counts() == {}   # forward and backward: every operand stays where it is
