"""The trace pass: the user's Python function -> a global GraphDef with static input shapes."""

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from tf_gspmd._annotations import mesh_scope
from tf_gspmd.errors import ShapeError, ShardingError
from tf_gspmd.rewriter.graph_ir import ref, split_ref


def run(program):
  fn = program.fn
  if not hasattr(fn, "get_concrete_function"):
    fn = tf.function(fn)
  with mesh_scope(program.mesh):
    cf = fn.get_concrete_function(*program.arg_specs)
  graph = cf.graph
  gd = graph.as_graph_def()
  n_args = len(program.arg_specs)
  inputs = [t.op.name for t in cf.inputs[:n_args]]
  captured = list(zip(cf.inputs[n_args:], cf.captured_inputs))
  if captured:
    gd = _inline_captures(gd, captured)
  for op in graph.get_operations():  # creation order: the first dynamic tensor is the cause
    for t in op.outputs:
      if t.dtype not in (tf.resource, tf.variant) and t.shape.rank is not None and not t.shape.is_fully_defined():
        raise ShapeError(f"tensor {t.name} produced by {op.type} has dynamic shape {t.shape}; tf_gspmd needs static "
                         "shapes: trace with fully defined TensorSpecs and avoid ops with data-dependent shapes",
                         node=op.name, op_type=op.type)
  outputs = [ref(*split_ref(t.name)) for t in cf.outputs]
  return program.replace(graph_def=gd, input_names=tuple(inputs), output_refs=tuple(outputs),
                         output_structure=cf.structured_outputs)


def _inline_captures(gd, captured):
  """Captured eager tensors become constants of the graph (captured variables need sharded state)."""
  values = {}
  for placeholder, value in captured:
    if value.dtype == tf.resource:
      raise ShardingError("the function captures a variable; pass its value as an argument instead",
                          node=placeholder.op.name)
    values[placeholder.op.name] = np.asarray(value)
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(gd)
  for node in out.node:
    if node.name in values:
      dtype = node.attr["dtype"]
      node.op = "Const"
      for k in list(node.attr):
        del node.attr[k]
      node.attr["dtype"].CopyFrom(dtype)
      node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(values[node.name]))
  return out
