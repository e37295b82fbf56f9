"""Cleanup of the per-device program: dead nodes pruned, repeated variable reads merged (cleanup.merge_reads)."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close, keras_adam_step
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.backend import cleanup
from tf_gspmd.rewriter.graph import graph_view

MESH = gs.Mesh((2, 4), ("data", "model"))


def _reads(gd):
  return collections.Counter(graph_view.node_of(n.input[0]) for n in gd.node if n.op == "ReadVariableOp")


def _traced(fn, *specs):
  cf = tf.function(fn, autograph=False).get_concrete_function(*specs)
  return cf, cf.graph.as_graph_def()


def _run(gd, cf, *args):
  """`gd`, a rewrite of `cf`'s graph, run on `args` and `cf`'s captured variables."""
  inputs = [t.name for t in cf.inputs]
  outputs = [t.name for t in cf.outputs]

  def body(*xs):
    return tf.graph_util.import_graph_def(gd, input_map=dict(zip(inputs, xs)), return_elements=outputs)
  specs = [tf.TensorSpec(t.shape, t.dtype) for t in cf.inputs]
  fn = tf.compat.v1.wrap_function(body, specs)
  return [t.numpy() for t in fn(*(list(args) + list(cf.captured_inputs)))]


def test_reads_with_the_same_inputs_merge_and_reads_ordered_after_a_write_do_not_join_earlier_ones():
  v, w = tf.Variable(3.0), tf.Variable(1.0)

  def fn(x):
    a = v.read_value() * x
    b = v.read_value() + x          # the same read as a's: no write of v between them
    w.assign(a + b)
    c = w.read_value() * 2.0        # after the write: a read of its own ...
    d = w.read_value() - 1.0        # ... which d's repeats
    return a + b + c + d
  cf, gd = _traced(fn, tf.TensorSpec([], tf.float32))
  before = _reads(gd)
  merged = cleanup.merge_reads(gd)
  after = _reads(merged)
  assert sorted(before.values()) == [2, 2] and sorted(after.values()) == [1, 1]
  # The merged reads' consumers read the kept ones; the graph still imports and computes the same values.
  names = {n.name for n in merged.node}
  assert all(graph_view.node_of(i) in names for n in merged.node for i in n.input)
  w.assign(1.0)
  want = fn(tf.constant(2.0)).numpy()
  w.assign(1.0)
  assert_close(_run(merged, cf, tf.constant(2.0))[0], want)
  assert w.numpy() == 11.0   # 3 * 2 + (3 + 2)


def test_reads_a_caller_keeps_and_reads_with_other_control_inputs_stay():
  v = tf.Variable(3.0)

  def fn(x):
    first = v.read_value()
    with tf.control_dependencies([x]):
      later = v.read_value()        # another control input: not merged with `first`
    return first + later, v.read_value()
  _, gd = _traced(fn, tf.TensorSpec([], tf.float32))
  reads = [n.name for n in gd.node if n.op == "ReadVariableOp"]
  assert len(reads) == 3
  assert len(_reads(cleanup.merge_reads(gd)).keys()) == 1
  assert sum(_reads(cleanup.merge_reads(gd)).values()) == 2
  assert sum(_reads(cleanup.merge_reads(gd, keep=set(reads))).values()) == 3


@pytest.mark.parametrize("exchange", ["auto", "collectives"])
def test_an_optimizers_step_counter_is_read_once_per_device_and_trains_as_unpartitioned(monkeypatch, exchange):
  """Keras's Adam reads its step counter (and learning rate) once per weight; the per-device program reads each
  once, and the partitioned steps give the unpartitioned weights."""
  keras = pytest.importorskip("keras")
  rng = np.random.default_rng(0)
  x, y = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((8, 16)).astype(np.float32)

  step, model, _ = keras_adam_step(keras, 3)
  ref_step, ref, _ = keras_adam_step(keras, 3)
  specs = (tf.TensorSpec([8, 16]),) * 2
  f = gs.function(step, mesh=MESH, in_shardings=(P("data", None),) * 2, exchange=exchange)
  counts = _reads(f.lower(*specs).program.local_graph_def)
  with monkeypatch.context() as m:
    m.setattr(cleanup, "merge_reads", lambda gd, keep=(): gd)
    unmerged = _reads(gs.function(step, mesh=MESH, in_shardings=(P("data", None),) * 2,
                                  exchange=exchange).lower(*specs).program.local_graph_def)
  weights = len(model.trainable_variables)
  # Unmerged, the step counter is read once per weight; merged, no variable is read more than twice (a weight and
  # its moments: before and after their update) and every variable keeps a read.
  assert weights == 6 and max(unmerged.values()) >= weights and max(counts.values()) <= 2
  assert counts.keys() == unmerged.keys() and sum(counts.values()) <= sum(unmerged.values()) - weights + 1
  ref_step = tf.function(ref_step)
  for _ in range(3):
    assert_close(f(x, y).numpy(), ref_step(x, y).numpy(), rtol=1e-5)
  for got, want in zip(model.get_weights(), ref.get_weights()):
    assert_close(got, want, rtol=1e-4, atol=1e-5)
