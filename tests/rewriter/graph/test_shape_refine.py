"""shape_refine: an op reading a variable handle whose value's shape is known gets its output's shape, though the
graph states none (no `_output_shapes`), e.g. the ResourceGather of tf.nn.embedding_lookup."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd.rewriter.frontend import trace
from tf_gspmd.rewriter.graph.graph_ir import Graph
from tf_gspmd.rewriter.program import Options, Program

MESH = gs.Mesh((2, 4), ("data", "model"))


def _bare_ir(fn, spec, handle_shapes=True, unshaped=None):
  """The IR of `fn`'s traced graph with the traced shapes (`_output_shapes`) of the ops of types `unshaped` (default:
  all) removed; the captured variables' handle Placeholders keep what trace states about their values
  (`_handle_shapes`) unless `handle_shapes` is False."""
  program = trace.run(Program(fn=fn, mesh=MESH, options=Options(), arg_specs=(spec,), declared_in=(None,),
                              arriving_in=(None,)))
  gd = tf.compat.v1.GraphDef()
  gd.CopyFrom(program.graph_def)
  for n in gd.node:
    if unshaped is None or n.op in unshaped:
      n.attr.pop("_output_shapes", None)
    if not handle_shapes:
      n.attr.pop("_handle_shapes", None)
      n.attr.pop("_handle_dtypes", None)
  return Graph(gd, program.input_names, program.output_refs)


@pytest.mark.parametrize("lookup", [tf.nn.embedding_lookup, tf.gather], ids=["embedding_lookup", "gather"])
def test_a_gather_from_a_captured_variable_gets_its_shape(lookup):
  """The variable's handle Placeholder states its value's shape (trace): the IR imports it as a VarHandleOp of
  that shape, so TF's shape function of ResourceGather sees it."""
  w = tf.Variable(np.zeros((10, 4), np.float32))
  ir = _bare_ir(lambda i: lookup(w, i) * 2.0, tf.TensorSpec((2, 3), tf.int32))
  (handle,) = [n for n in ir.nodes if n.op == "Placeholder" and n.outputs[0].dtype == tf.resource]
  assert handle.outputs[0].value_shape == (10, 4)   # the IR's node stays the Placeholder
  (gather,) = [n for n in ir.nodes if n.op == "ResourceGather"]
  assert gather.outputs[0].shape == (2, 3, 4)
  assert [n for n in ir.nodes if n.op == "Mul"][0].outputs[0].shape == (2, 3, 4)   # and what reads it


def test_gather_nd_from_a_variable_of_known_shape_gets_its_shape():
  w = tf.Variable(np.zeros((10, 4, 5), np.float32))
  ir = _bare_ir(lambda i: tf.gather_nd(w, i), tf.TensorSpec((3, 2), tf.int32))
  (gather,) = [n for n in ir.nodes if n.op == "ResourceGatherNd"]
  assert gather.outputs[0].shape == (3, 5)


def test_a_gather_from_a_handle_whose_read_shows_its_value_gets_its_shape():
  """No stated value: a read of the variable shows its shape (graph_ir), and step 3 asks ResourceGather's shape
  function again with the handle as a VarHandleOp of that shape."""
  w = tf.Variable(np.zeros((10, 4), np.float32))
  ir = _bare_ir(lambda i: tf.gather(w, i) + tf.reduce_sum(w), tf.TensorSpec((2, 3), tf.int32), handle_shapes=False,
                unshaped=("ResourceGather",))
  (gather,) = [n for n in ir.nodes if n.op == "ResourceGather"]
  assert gather.outputs[0].shape == (2, 3, 4)


def test_a_gather_from_a_handle_of_unknown_value_keeps_its_unknown_rank():
  w = tf.Variable(np.zeros((10, 4), np.float32))
  ir = _bare_ir(lambda i: tf.nn.embedding_lookup(w, i), tf.TensorSpec((2,), tf.int32), handle_shapes=False)
  (gather,) = [n for n in ir.nodes if n.op == "ResourceGather"]
  assert gather.outputs[0].shape is None
