"""How a step's loss combines over microbatches (`rewriter.stages.microbatch_loss`): a mean or a sum over the batch
rows is proven from the step's graphs at two batch sizes; anything else -- a reduction that mixes rows, a term
scaled by the batch size, a sum plus a term free of the batch -- is refused, naming the node."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gspmd.errors import InputError
from tf_gspmd.rewriter.stages.microbatch_loss import reduction

W = {"w1": tf.TensorSpec((8, 16)), "w2": tf.TensorSpec((16, 4))}
BATCH = (tf.TensorSpec((16, 8)), tf.TensorSpec((16, 4)))


def _err(p, x, y):
  return tf.square(tf.nn.relu(x @ p["w1"]) @ p["w2"] - y)   # [rows, 4], row r from row r alone


PROVEN = {
    "mean": (lambda p, x, y: tf.reduce_mean(_err(p, x, y)), "mean"),
    "sum": (lambda p, x, y: tf.reduce_sum(_err(p, x, y)), "sum"),
    "mean plus a regularizer": (lambda p, x, y: tf.reduce_mean(_err(p, x, y)) + tf.nn.l2_loss(p["w1"]), "mean"),
    "mean of per-row sums, scaled by a constant": (
        lambda p, x, y: 16.0 * tf.reduce_mean(tf.reduce_sum(_err(p, x, y), axis=1)), "mean"),
    "sum of rows flattened with -1": (lambda p, x, y: tf.reduce_sum(tf.reshape(_err(p, x, y), [-1])), "sum"),
    "x^T x, a sum of per-row outer products": (lambda p, x, y: tf.reduce_sum(tf.transpose(x) @ x @ p["w1"]), "sum"),
    "two means added": (lambda p, x, y: tf.reduce_mean(_err(p, x, y)) + tf.reduce_mean(tf.abs(x)), "mean"),
    "softmax, slices and repeats of the rows' own entries": (
        lambda p, x, y: tf.reduce_mean(tf.nn.log_softmax(tf.repeat(x[:, :4], 2, axis=1) @ p["w1"])), "mean"),
    "no batch at all": (lambda p, x, y: tf.nn.l2_loss(p["w2"]), "mean"),
    "a mean times the batch size (a sum)": (lambda p, x, y: tf.reduce_mean(_err(p, x, y)) * x.shape[0], "sum"),
    "a sum over the count of entries, as Keras's losses divide (a mean)": (
        lambda p, x, y: tf.math.divide_no_nan(tf.reduce_sum(_err(p, x, y)), tf.cast(tf.reduce_prod(
            tf.convert_to_tensor(_err(p, x, y).shape.as_list(), tf.int32)), tf.float32)), "mean"),
    "Keras's MeanSquaredError": (lambda p, x, y: _keras_loss("MeanSquaredError")(y, x @ p["w1"] @ p["w2"]), "mean"),
}

REFUSED = {
    "a mean plus a term scaled by the batch size": (
        lambda p, x, y: tf.reduce_mean(_err(p, x, y)) + tf.nn.l2_loss(p["w1"]) * x.shape[0], r"\(AddV2\)"),
    # (a mean, but the batch size is read from tf.shape through a slice the proof does not evaluate)
    "a sum over the batch size from tf.shape": (
        lambda p, x, y: tf.reduce_sum(_err(p, x, y)) / tf.cast(tf.shape(x)[0], tf.float32), r"\(RealDiv\)"),
    "a sum plus a regularizer, over the batch size": (
        lambda p, x, y: (tf.reduce_sum(_err(p, x, y)) + tf.nn.l2_loss(p["w1"])) / tf.cast(tf.shape(x)[0],
                                                                                          tf.float32), "term"),
    "a sum plus a regularizer": (lambda p, x, y: tf.reduce_sum(_err(p, x, y)) + tf.nn.l2_loss(p["w1"]),
                                 "plus a term that does not depend on the batch"),
    "a sum added to a mean": (lambda p, x, y: tf.reduce_sum(_err(p, x, y)) + tf.reduce_mean(x),
                              "adds a sum over the batch rows to a mean"),
    "the largest row": (lambda p, x, y: tf.reduce_max(_err(p, x, y)), r"\(Max\) reduces the batch rows by Max"),
    "rows centred on the batch mean": (
        lambda p, x, y: tf.reduce_mean(tf.square(x - tf.reduce_mean(x, axis=0)) @ p["w1"]), r"\(Sub\)"),
    "the square of a sum": (lambda p, x, y: tf.square(tf.reduce_sum(_err(p, x, y))), r"\(Square\) is not linear"),
    "a Gram matrix of the rows": (lambda p, x, y: tf.reduce_mean(x @ tf.transpose(x)),
                                  "multiplies entries of different batch rows"),
    "rows reshaped into one another": (lambda p, x, y: tf.reduce_mean(tf.reduce_max(tf.reshape(x, [8, -1]), 0)),
                                       r"\(Reshape\) reshapes the batch rows together"),
    "a random draw": (lambda p, x, y: tf.reduce_mean(tf.nn.dropout(x, 0.5) @ p["w1"]), "stateful"),
    "the first row": (lambda p, x, y: tf.reduce_sum(_err(p, x, y)[0]), r"\(StridedSlice\) slices the batch rows"),
}


def _keras_loss(name):
  import keras  # pylint: disable=g-import-not-at-top
  return getattr(keras.losses, name)()


@pytest.mark.parametrize("name", sorted(PROVEN))
def test_sums_and_means_over_the_rows_are_proven(name):
  fn, want = PROVEN[name]
  assert reduction(fn, W, BATCH, 4) == want


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_losses_are_refused_naming_the_node(name):
  fn, match = REFUSED[name]
  with pytest.raises(InputError, match=match):
    reduction(fn, W, BATCH, 4)


def test_one_microbatch_combines_nothing_and_the_proof_matches_the_values():
  fn, _ = REFUSED["the largest row"]
  assert reduction(fn, W, BATCH, 1) == "mean"
  # What "sum" promises, on values: the microbatches' losses add up to the batch's.
  rng = np.random.default_rng(0)
  p = {k: tf.constant(rng.standard_normal(s.shape), tf.float32) for k, s in W.items()}
  x, y = (tf.constant(rng.standard_normal(s.shape), tf.float32) for s in BATCH)
  fn, _ = PROVEN["sum"]
  parts = sum(fn(p, x[i:i + 4], y[i:i + 4]) for i in range(0, 16, 4))
  np.testing.assert_allclose(parts.numpy(), fn(p, x, y).numpy(), rtol=1e-5)
