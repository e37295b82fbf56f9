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
  from tf_gspmd.rewriter.graph_ir import Graph, ref, split_ref  # pylint: disable=g-import-not-at-top
  cf = tf.function(fn).get_concrete_function(*[tf.TensorSpec(s) for s in shapes])
  return Graph(cf.graph.as_graph_def(), [t.op.name for t in cf.inputs],
               [ref(*split_ref(t.name)) for t in cf.outputs])


def first_node(ir, op_type):
  return next(n for n in ir.nodes if n.op == op_type)
