"""The combine pass: independent all-reduces become one collective; dependent ones stay apart."""

import numpy as np
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))


def _emitted(low):
  return sum(1 for n in low.graph_def.node if n.op == "CollectiveReduceV2")


def test_independent_all_reduces_are_combined_and_results_match(rng):
  def f(x, w1, w2, w3):
    # Three contractions over the split dim: three independent partial sums.
    return x @ w1, x @ w2, tf.reduce_sum(x @ w3, axis=1)

  args = [rng.standard_normal((8, 16)).astype(np.float32)] + [
      rng.standard_normal((16, n)).astype(np.float32) for n in (4, 6, 5)]
  g = gs.function(f, mesh=MESH, in_shardings=(P(None, "model"), P("model", None), P("model", None),
                                               P("model", None)), out_shardings=P())
  low = g.lower(*[tf.TensorSpec(a.shape) for a in args])
  assert low.report.counts() == {"all-reduce": 3}      # the logical collectives stay reported one by one
  assert _emitted(low) == 1 and low.report.combined == [(3, 4 * 8 * (4 + 6 + 5))]
  assert "3 independent all-reduces combined into 1" in str(low.report)
  for got, want in zip(g(*args), f(*args)):
    assert_close(got.numpy(), want, rtol=1e-5)


def test_dependent_all_reduces_stay_separate(rng):
  def f(x, w1, w2):
    h = x @ w1                      # all-reduce 1
    return tf.tanh(h) @ w2          # needs all-reduce 1's result, then all-reduce 2

  args = [rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 16)).astype(np.float32),
          rng.standard_normal((16, 4)).astype(np.float32)]
  g = gs.function(f, mesh=MESH, in_shardings=(P(None, "model"), P("model", None), P("model", None)),
                  out_shardings=P())
  low = g.lower(*[tf.TensorSpec(a.shape) for a in args])
  assert low.report.combined == [] and _emitted(low) == low.report.counts()["all-reduce"]
  assert_close(g(*args).numpy(), f(*args), rtol=1e-5)
