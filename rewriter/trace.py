"""The trace pass: the user's Python function -> a global GraphDef with static input shapes.

Captured variables stay parameters of the graph (resource handles, recorded with their tf.Variable);
other captured tensors become constants.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd._annotations import mesh_scope
from tf_gspmd.rewriter.graph_view import ref, split_ref


def run(program):
  fn = program.fn
  if not hasattr(fn, "get_concrete_function"):
    fn = tf.function(fn)
  with mesh_scope(program.mesh):
    cf = fn.get_concrete_function(*program.arg_specs)
  graph = cf.graph
  gd = graph.as_graph_def(add_shapes=True)   # static shapes survive re-import (e.g. of variable reads)
  n_args = len(program.arg_specs)
  inputs = [t.op.name for t in cf.inputs[:n_args]]
  captured = list(zip(cf.inputs[n_args:], cf.captured_inputs))
  by_handle = {id(v.handle): v for v in graph.variables}
  variables = [(ph.op.name, by_handle.get(id(value))) for ph, value in captured if value.dtype == tf.resource]
  tensors = [(ph, value) for ph, value in captured if value.dtype != tf.resource]
  if tensors:
    gd = _inline_captures(gd, tensors)
  outputs = [ref(*split_ref(t.name)) for t in cf.outputs]
  return program.replace(graph_def=gd, input_names=tuple(inputs), output_refs=tuple(outputs),
                         output_structure=cf.structured_outputs, variable_names=tuple(n for n, _ in variables),
                         variables=tuple(v for _, v in variables))


def _inline_captures(gd, captured):
  """Captured eager tensors (not variables) become constants of the graph."""
  values = {placeholder.op.name: np.asarray(value) for placeholder, value in captured}
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(gd)
  for node in out.node:
    if node.name in values:
      dtype = node.attr["dtype"]
      node.op = "Const"
      for k in list(node.attr):
        del node.attr[k]
      node.attr["dtype"].CopyFrom(dtype)
      node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(values[node.name]))
  return out
