"""Softmax, LogSoftmax and cross-entropy, including a split class dim (small all-reduces, no gather)."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))


@pytest.mark.parametrize("spec", [P(), P("data", None), P("data", "model"), P(None, ("data", "model"))], ids=str)
@pytest.mark.parametrize("classes", [32, 30])
def test_softmax_family(rng, spec, classes):
  x = rng.standard_normal((8, classes)).astype(np.float32) * 3
  f = gs.function(lambda t: (tf.nn.softmax(t), tf.nn.log_softmax(t)), mesh=MESH, in_shardings=spec)
  a, b = f(x)
  assert_close(a.numpy(), tf.nn.softmax(x), rtol=1e-5, atol=1e-6)
  assert_close(b.numpy(), tf.nn.log_softmax(x), rtol=1e-5, atol=1e-5)
  low = f.lower(tf.TensorSpec(x.shape))
  assert all(c.kind == "all-reduce" for c in low.report.collectives)


def _xent(logits, labels):
  return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


@pytest.mark.parametrize("classes", [64, 61])
def test_sparse_cross_entropy_split_classes(rng, classes):
  logits = rng.standard_normal((16, classes)).astype(np.float32) * 2
  labels = rng.integers(0, classes, size=(16,)).astype(np.int32)

  def fn(l, y):
    with tf.GradientTape() as tape:
      tape.watch(l)
      loss = tf.reduce_mean(_xent(l, y))
    return loss, tape.gradient(loss, l)

  f = gs.function(fn, mesh=MESH, in_shardings=(P("data", "model"), P("data")), out_shardings=(P(), P("data", "model")))
  loss, grad = f(logits, labels)
  want_loss, want_grad = fn(tf.constant(logits), tf.constant(labels))
  assert_close(loss.numpy(), want_loss, rtol=1e-5)
  assert_close(grad.numpy(), want_grad, rtol=1e-5, atol=1e-6)
  low = f.lower(tf.TensorSpec(logits.shape), tf.TensorSpec(labels.shape, tf.int32))
  assert set(low.report.counts()) == {"all-reduce"}
  assert max(c.bytes for c in low.report.collectives) <= 16 * 4


@pytest.mark.parametrize("classes", [64, 61])
def test_sparse_cross_entropy_with_masked_classes(rng, classes):
  """-inf logits (masked classes) and -inf in the padding of the split class dim: the label logit is selected,
  never multiplied by a one-hot (0 * -inf = NaN)."""
  p = rng.uniform(0.1, 1.0, (16, classes)).astype(np.float32)
  p[:, ::3] = 0.0                                   # masked classes: log(0) = -inf
  labels = (3 * rng.integers(0, classes // 3, size=(16,)) + 1).astype(np.int32)

  def fn(q, y):
    return tf.reduce_mean(_xent(tf.math.log(q), y))   # the padding of q is 0 too: -inf there

  f = gs.function(fn, mesh=MESH, in_shardings=(P("data", "model"), P("data")))
  got = f(p, labels).numpy()
  assert np.isfinite(got)
  assert_close(got, fn(tf.constant(p), tf.constant(labels)), rtol=1e-5)


def test_dense_cross_entropy_split_classes(rng):
  logits = rng.standard_normal((8, 24)).astype(np.float32)
  labels = tf.nn.softmax(rng.standard_normal((8, 24)).astype(np.float32)).numpy()
  fn = lambda l, y: tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=l)
  f = gs.function(fn, mesh=MESH, in_shardings=(P("data", "model"), P("data", "model")))
  assert_close(f(logits, labels).numpy(), fn(logits, labels), rtol=1e-5)


def test_softmax_xent_workload_is_small_all_reduces():
  """Workload 10: softmax cross-entropy over logits[64,32000] P('data','model'): only small all-reduces."""

  def fn(logits, labels):
    return tf.reduce_mean(_xent(logits, labels))

  f = gs.function(fn, mesh=MESH, in_shardings=(P("data", "model"), P("data")), out_shardings=P())
  low = f.lower(tf.TensorSpec([64, 32000]), tf.TensorSpec([64], tf.int32))
  assert set(low.report.counts()) == {"all-reduce"}
  assert all(c.bytes <= 32 * 4 for c in low.report.collectives)


def _nonfinite_rows(rng, rows, classes, dtype):
  x = rng.standard_normal((rows, classes)).astype(dtype)
  x[0, 3] = np.nan              # a NaN on the first device's shard of the class dim
  x[1, 5] = np.inf              # +inf on the second device's
  x[2, classes - 1] = -np.inf   # -inf: a masked class, finite elsewhere
  x[3, :] = -np.inf             # every class masked
  x[4, 2] = x[4, classes - 2] = np.inf   # +inf on two shards
  x[5, 1] = np.nan
  x[5, classes - 3] = np.inf
  return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("classes", [32, 30])
def test_softmax_over_split_classes_with_nan_and_inf_equals_tf(rng, dtype, classes):
  """NaN, +inf and -inf logits with the class dim split over "model": the same values and NaNs as TF's kernels
  (float32: NaN only where the row holds NaN or +inf, 0 elsewhere in that row; float64 and log-softmax: the whole
  row NaN; -inf gives 0 / -inf; a row of -inf only is NaN)."""
  x = _nonfinite_rows(rng, 8, classes, dtype)
  fn = lambda t: (tf.nn.softmax(t, 1), tf.nn.log_softmax(t, 1))
  f = gs.function(fn, mesh=MESH, in_shardings=P("data", "model"))
  got = [g.numpy() for g in f(x)]
  want = [w.numpy() for w in fn(tf.constant(x))]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    assert_close(g, w, rtol=1e-5, atol=1e-6)   # (equal_nan, and -inf where TF has -inf)
  assert np.isnan(want[0][:2]).sum() == (2 if dtype == np.float32 else 2 * classes)   # the kernels' rules above
  low = f.lower(tf.TensorSpec(x.shape, tf.as_dtype(dtype)))
  assert set(low.report.counts()) == {"all-reduce"}
