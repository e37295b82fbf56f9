"""Partial sums added before they are reduced (rewriter/partition/sums.py): the terms of an add reduced once."""

import numpy as np
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))
ROWS = P(None, "model")   # an activation split on its contracted dim: a matmul of it is a sum pending over model
COLS = P("model", None)
RNG = np.random.default_rng(0)


def _run(fn, in_shardings, args, out_shardings=None):
  """The report of `fn` partitioned, after checking its results against the unpartitioned function's."""
  f = gs.function(fn, mesh=MESH, in_shardings=in_shardings, out_shardings=out_shardings)
  low = f.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])
  got = tf.nest.flatten(f(*args))
  want = tf.nest.flatten(tf.function(fn)(*[tf.constant(a) for a in args]))
  for g, w in zip(got, want):
    assert_close(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-4)
  return low.report


def _normal(*shape):
  return RNG.standard_normal(shape).astype(np.float32)


def _terms(n):
  """n activations split on their contracted dim and n weights: each a @ w a sum pending over model."""
  return [_normal(16, 32) for _ in range(n)] + [_normal(32, 24) for _ in range(n)], (ROWS,) * n + (COLS,) * n


def _reductions(report):
  return [c for c in report.collectives if c.kind in ("all-reduce", "reduce-scatter")]


def test_qkv_like_terms_are_added_then_reduced_once():
  args, ins = _terms(3)
  report = _run(lambda a, b, c, wa, wb, wc: tf.add_n([a @ wa, b @ wb, c @ wc]), ins, args)
  (one,) = _reductions(report)
  assert one.kind == "all-reduce" and one.axes == ("model",) and one.shape == (16, 24)
  assert "sum of 3 partial terms reduced once" in one.reason
  assert report.bytes_per_device() == 16 * 24 * 4   # one all-reduce's payload, where three were sent


def test_a_chain_of_adds_subtractions_negations_and_copies_reduces_once():
  args, ins = _terms(3)
  report = _run(lambda a, b, c, wa, wb, wc: tf.identity(-(a @ wa) + (b @ wb - c @ wc)), ins, args)
  (one,) = _reductions(report)
  assert "sum of 3 partial terms reduced once" in one.reason


def test_tied_embedding_gradient_is_reduced_once():
  """A table read by the lookup and the output projection, the batch split over data: its two gradients (a
  segment sum and a matmul's) are partial over data, added, and all-reduced once."""
  table, ids, h = _normal(40, 8), RNG.integers(0, 40, size=(16,)).astype(np.int32), _normal(16, 8)

  def grad(table, ids, h):
    with tf.GradientTape() as tape:
      tape.watch(table)
      logits = tf.matmul(tf.gather(table, ids) + h, table, transpose_b=True)
      loss = tf.reduce_sum(tf.square(logits))
    return tf.convert_to_tensor(tape.gradient(loss, table))

  report = _run(grad, (P(), P("data"), P("data", None)), [table, ids, h], out_shardings=P())
  table_sums = [c for c in _reductions(report) if c.shape == (40, 8)]
  assert len(table_sums) == 1 and table_sums[0].axes == ("data",)
  assert "sum of 2 partial terms reduced once" in table_sums[0].reason


def test_reduced_to_a_split_result_as_one_reduce_scatter():
  args, ins = _terms(2)
  report = _run(lambda a, b, wa, wb: a @ wa + b @ wb, ins, args, out_shardings=P("model", None))
  (one,) = _reductions(report)
  assert one.kind == "reduce-scatter" and "sum of 2 partial terms" in one.reason


def test_a_term_added_to_a_whole_value_is_reduced_first():
  args, ins = _terms(1)
  x = _normal(16, 24)
  report = _run(lambda a, wa, x: a @ wa + x, ins + (P(),), args + [x])
  (one,) = _reductions(report)
  assert "partial terms" not in one.reason


def test_a_term_also_read_otherwise_is_reduced_once_and_reused():
  args, ins = _terms(2)

  def fn(a, b, wa, wb):
    t = a @ wa
    return t + b @ wb, tf.exp(t), t

  report = _run(fn, ins, args)
  assert len(_reductions(report)) == 2   # t once (read by exp and returned), b @ wb once: as without adding first
  assert not any("partial terms" in c.reason for c in report.collectives)


def test_terms_over_different_axes_are_reduced_apart():
  a, wa, b, wb = _normal(16, 32), _normal(32, 24), _normal(16, 32), _normal(32, 24)
  report = _run(lambda a, wa, b, wb: a @ wa + b @ wb, (ROWS, COLS, P(None, "data"), P("data", None)),
                [a, wa, b, wb])
  assert sorted(c.axes for c in _reductions(report)) == [("data",), ("model",)]


def test_a_sum_read_inside_a_loop_is_reduced_before_it():
  args, ins = _terms(2)

  def fn(a, b, wa, wb):
    s = a @ wa + b @ wb
    return tf.while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 0.5), (0, s))[1]

  report = _run(fn, ins, args)
  (one,) = _reductions(report)
  assert "sum of 2 partial terms" in one.reason and not one.loops


def test_terms_inside_a_loop_body_are_added_then_reduced_once_per_iteration():
  args, ins = _terms(2)

  def fn(a, b, wa, wb):
    body = lambda i, x: (i + 1, tf.tanh(a @ wa + b @ wb + x))
    return tf.while_loop(lambda i, x: i < 3, body, (0, tf.zeros([16, 24])))[1]

  report = _run(fn, ins, args)
  (one,) = _reductions(report)
  assert "sum of 2 partial terms" in one.reason and one.loops and one.times == 3
