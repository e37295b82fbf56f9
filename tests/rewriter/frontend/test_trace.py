"""The trace pass: colocation constraints are dropped, so the traced static shapes survive the grappler pass."""

import numpy as np
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd.rewriter.frontend import grappler, trace
from tf_gspmd.rewriter.graph.graph_ir import Graph
from tf_gspmd.rewriter.program import Options, Program

MESH = gs.Mesh((2, 4), ("data", "model"))


def _traced(fn, *specs):
  program = Program(fn=fn, mesh=MESH, options=Options(), arg_specs=specs, declared_in=(None,) * len(specs),
                    arriving_in=(None,) * len(specs))
  return trace.run(program)


def _colocations(gd):
  nodes = list(gd.node) + [nd for f in gd.library.function for nd in f.node_def]
  return [(nd.name, c) for nd in nodes if "_class" in nd.attr for c in nd.attr["_class"].list.s
          if c.startswith(b"loc:@")]


def test_embedding_lookup_keeps_its_traced_shape_through_grappler():
  """embedding_lookup's ResourceGather is built under `colocate_with(table)`; trace drops the `loc:@` constraint,
  so the node Grappler leaves unchanged matches its traced self and gets its traced shape back."""
  w = tf.Variable(np.zeros((10, 4), np.float32))
  program = _traced(lambda i: tf.nn.embedding_lookup(w, i), tf.TensorSpec((2, 3), tf.int32))
  cf = tf.function(lambda i: tf.nn.embedding_lookup(w, i)).get_concrete_function(tf.TensorSpec((2, 3), tf.int32))
  assert _colocations(cf.graph.as_graph_def()), "embedding_lookup no longer colocates: the test proves nothing"
  assert _colocations(program.graph_def) == []
  optimized = grappler.run(program)
  (gather,) = [n for n in optimized.graph_def.node if n.op == "ResourceGather"]
  assert "_output_shapes" in gather.attr
  ir = Graph(optimized.graph_def, optimized.input_names, optimized.output_refs)
  assert ir.node(gather.name).outputs[0].shape == (2, 3, 4)


def test_colocation_constraints_are_dropped_from_the_graph_and_its_functions():
  """Every `loc:@` constraint a `colocate_with` block adds goes, from the graph and its functions' bodies."""
  def fn(x):
    with tf.compat.v1.colocate_with(x):
      y = tf.tanh(x) * 2.0
    return tf.cond(tf.reduce_sum(y) > 0, lambda: _colocated(y), lambda: y)

  def _colocated(y):
    with tf.compat.v1.colocate_with(y):
      return y + 1.0

  spec = tf.TensorSpec((4, 4))
  assert _colocations(tf.function(fn).get_concrete_function(spec).graph.as_graph_def())
  assert _colocations(_traced(fn, spec).graph_def) == []
