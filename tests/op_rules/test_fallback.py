"""The fallback (ops without a rule: replicated, run whole, warned, refused by strict=True) and the ops that run
whole by their own rule (`Whole`: assertions, prints, BroadcastGradientArgs)."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

from conftest import check_partitioned
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))


def _checked(x, w):
  tf.debugging.assert_less(x, 100.0, message="x too big")                 # Assert in its guard's false branch
  tf.print("norm", tf.norm(x), output_stream="file:///dev/null")         # StringFormat + PrintV2
  with tf.GradientTape() as tape:
    tape.watch(w)
    y = tf.reduce_sum(x[:, :, None] * w)                                 # a broadcast: BroadcastGradientArgs
  return y, tape.gradient(y, w)


def test_checks_and_prints_run_whole_by_their_rule_under_strict(rng):
  x = rng.standard_normal((8, 12)).astype(np.float32)
  w = rng.standard_normal((1, 12, 3)).astype(np.float32)
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*no partitioning rule")
    low = check_partitioned(_checked, [x, w], (P("data", "model"), P()), MESH)
  assert low.report.fallbacks == ()
  f = gs.function(_checked, mesh=MESH, in_shardings=(P("data", "model"), P()), strict=True)
  f.lower(tf.TensorSpec(x.shape), tf.TensorSpec(w.shape))   # strict allows them
  gathered = [c for c in low.report.collectives if c.kind == "all-gather"]
  # The assert's data is gathered only inside the branch that runs when the check fails.
  assert gathered and all(c.within for c in gathered), str(low.report)


def test_an_op_without_a_rule_falls_back_with_a_warning_and_strict_refuses_it(rng, monkeypatch):
  from tf_gspmd.rewriter.partition import partition  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(partition, "_warned_fallback", set())   # warned once per op type and process
  x = rng.standard_normal((8, 12)).astype(np.float32)

  def fn(a):
    return tf.raw_ops.MatrixDiagPartV3(input=tf.reshape(a, [8, 3, 4]), k=0, padding_value=0.0)

  assert gs.ops.lookup("MatrixDiagPartV3") is None
  with pytest.warns(UserWarning, match="MatrixDiagPartV3.*no partitioning rule"):
    low = check_partitioned(fn, [x], (P("data", "model"),), MESH)
  assert [op for _, op in low.report.fallbacks] == ["MatrixDiagPartV3"]
  with pytest.raises(gs.UnsupportedOpError, match="strict=True"):
    gs.function(fn, mesh=MESH, in_shardings=P("data", "model"), strict=True).lower(tf.TensorSpec(x.shape))
