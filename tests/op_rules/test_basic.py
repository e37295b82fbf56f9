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
