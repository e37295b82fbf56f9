"""Function bodies (While/If branches): completed and partitioned as programs of their own.

A body is turned back into a GraphDef, completed with its parameters and results pinned to the layouts the
enclosing op gives them, and partitioned into a per-device FunctionDef whose last parameter is the
partition id (so per-device tables work inside loops).
"""

import tensorflow as tf
from tensorflow.python.framework import function_def_to_graph
from tensorflow.python.framework import graph_to_function_def

from tf_gspmd.rewriter.graph_ir import ref, split_ref


def _fdef(library, fname):
  for f in library.function:
    if f.signature.name == fname:
      return f
  raise KeyError(f"function {fname} is not in the graph's library")


def body_program(parent, fname, arg_shapes, param_shardings, out_shardings):
  """The completed Program of function `fname` with the given parameter and result layouts (None = free)."""
  from tf_gspmd.rewriter import completion, import_annotations  # pylint: disable=g-import-not-at-top
  key = (fname, tuple(arg_shapes), tuple(param_shardings), tuple(out_shardings) if out_shardings else None)
  cache = parent.function_cache
  if key in cache:
    return cache[key]
  library = parent.graph_def.library
  fdef = _fdef(library, fname)
  shapes = [tf.TensorShape(s) if s is not None else None for s in arg_shapes]
  gd, names = function_def_to_graph.function_def_to_graph_def(fdef, input_shapes=shapes)
  gd.library.CopyFrom(library)
  inputs = tuple(a.name for a in fdef.signature.input_arg)
  for node in gd.node:  # the enclosing op's shapes rule the parameters (arg attributes may be stale)
    if node.name in inputs:
      node.attr.pop("_output_shapes", None)
      shape = shapes[inputs.index(node.name)]
      if shape is not None and node.attr["dtype"].type != tf.resource.as_datatype_enum:
        node.attr["shape"].shape.CopyFrom(shape.as_proto())
  outputs = tuple(ref(*split_ref(names[fdef.ret[a.name]])) for a in fdef.signature.output_arg)
  program = parent.replace(
      fn=None, arg_specs=(), declared_in=tuple(param_shardings), arriving_in=tuple(param_shardings),
      declared_out=tuple(out_shardings) if out_shardings else None, graph_def=gd, input_names=inputs,
      output_refs=outputs, variable_names=(), variables=(), ir=None, annotations=None, shardings=None,
      local_graph_def=None, report=None)
  program = completion.run(import_annotations.run(program))
  cache[key] = program
  return program


def to_function_def(graph, name, inputs, outputs):
  """A FunctionDef named `name` from the ops of `graph` (inputs: placeholders, outputs: tensors)."""
  fdef = graph_to_function_def.graph_to_function_def(graph, graph.get_operations(), inputs, outputs)
  fdef.signature.name = name
  return fdef
