"""Test session set-up: 8 logical CPU devices before TensorFlow initialises, and shared helpers."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import tf_gspmd as gs  # noqa: E402

NUM_DEVICES = 8


gs.split_cpu_devices(NUM_DEVICES)


@pytest.fixture
def rng():
  return np.random.default_rng(0)


def assert_close(actual, expected, rtol=1e-5, atol=1e-5):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


def ir_of(fn, *shapes):
  """The IR graph of `fn` traced for float32 arguments of `shapes` (no partitioning, no devices)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_gspmd.rewriter.graph_ir import Graph  # pylint: disable=g-import-not-at-top
  from tf_gspmd.rewriter.graph_view import ref, split_ref  # pylint: disable=g-import-not-at-top
  cf = tf.function(fn).get_concrete_function(*[tf.TensorSpec(s) for s in shapes])
  return Graph(cf.graph.as_graph_def(), [t.op.name for t in cf.inputs],
               [ref(*split_ref(t.name)) for t in cf.outputs])


def first_node(ir, op_type):
  return next(n for n in ir.nodes if n.op == op_type)


def check_partitioned(fn, args, specs, mesh, out=None, tol=1e-5):
  """`fn` run partitioned on `mesh` (numpy `args` laid out as `specs`) agrees with `fn` unpartitioned.

  Returns the partitioned function's lowering for the same argument shapes (to inspect its report).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  f = gs.function(fn, mesh=mesh, in_shardings=specs, out_shardings=out)
  got = f(*args)
  want = fn(*[tf.constant(a) for a in args])
  for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
    assert_close(g.numpy(), w.numpy(), rtol=tol, atol=tol)
  return f.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])
