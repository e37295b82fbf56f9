"""Function bodies (While/If branches) as graphs of their own, and per-device graphs back as functions.

Completion (`completion.CompletionContext.complete_function`) turns a body into a program completed with its
parameters and results pinned to the layouts the enclosing op gives them; partitioning makes it a per-device
FunctionDef whose last parameter is the partition id (so per-device tables work inside loops).
"""

import contextlib

import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.rewriter.graph.graph_view import function_names, ref, split_ref


def _fdef(library, fname):
  for f in library.function:
    if f.signature.name == fname:
      return f
  raise KeyError(f"function {fname} is not in the graph's library")


def body_graph_def(library, fname, arg_shapes):
  """(GraphDef of function `fname` with parameters shaped `arg_shapes`, parameter names, result refs).

  The enclosing op's shapes rule the parameters (a FunctionDef's argument attributes may be stale).
  """
  fdef = _fdef(library, fname)
  shapes = [tf.TensorShape(s) if s is not None else None for s in arg_shapes]
  with _functions_known(library, fdef):
    gd, names = _compat.function_def_to_graph_def(fdef, shapes)
  gd.library.CopyFrom(library)
  inputs = tuple(a.name for a in fdef.signature.input_arg)
  for node in gd.node:
    if node.name in inputs:
      node.attr.pop("_output_shapes", None)
      shape = shapes[inputs.index(node.name)]
      if shape is not None and node.attr["dtype"].type != tf.resource.as_datatype_enum:
        node.attr["shape"].shape.CopyFrom(shape.as_proto())
  outputs = tuple(ref(*split_ref(names[fdef.ret[a.name]])) for a in fdef.signature.output_arg)
  return gd, inputs, outputs


def _functions_known(library, fdef):
  """A context in which the functions `fdef`'s ops refer to (a loop's body and condition inside a loop body) are
  known to TF, which converts such an op only when its functions are in the default graph: a graph holding
  `library`, or nothing to do when `fdef` refers to none."""
  known = {f.signature.name for f in library.function}
  if not any(name in known for nd in fdef.node_def for name in function_names(nd)):
    return contextlib.nullcontext()
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(tf.compat.v1.GraphDef(library=library), name="")
  return graph.as_default()


def to_function_def(graph, name, inputs, outputs):
  """A FunctionDef named `name` from the ops of `graph` (inputs: placeholders, outputs: tensors)."""
  fdef = _compat.graph_to_function_def(graph, graph.get_operations(), inputs, outputs)
  fdef.signature.name = name
  return fdef
