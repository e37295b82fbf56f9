"""The trace pass: the user's Python function -> a global GraphDef with static input shapes.

Captured variables stay parameters of the graph (resource handles, recorded with their tf.Variable);
other captured tensors become constants. Results are dense tensors: an `IndexedSlices` result (the gradient of
a gather with respect to its table) is densified in the graph, as `tf.convert_to_tensor` would; other composite
results (SparseTensor, RaggedTensor, ...) are refused with the conversion that makes them dense.

Colocation constraints (`_class: loc:@...`, which tf.nn.embedding_lookup and colocated gradients add) are dropped:
tf_gspmd places every op itself.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.annotations import mesh_scope, recording_schedules
from tf_gspmd.errors import InputError, ShapeError, ShardingError
from tf_gspmd.rewriter.graph.graph_view import (drop_colocation, function_names, functions_holding, node_def, ref,
                                               split_ref)

_CONVERSIONS = {
    "SparseTensor": "tf.sparse.to_dense(x), or x.indices, x.values and x.dense_shape as separate results",
    "RaggedTensor": "x.to_tensor() (padded), or x.flat_values and x.nested_row_splits as separate results",
}


class UserCodeError(Exception):
  """The user's function raised `error` while it was traced: the pass manager re-raises `error` itself (its type
  and message, as a plain tf.function would), not a PartitionError about this pass."""

  def __init__(self, error):
    super().__init__(str(error))
    self.error = error


def run(program):
  fn = program.fn
  if not hasattr(fn, "get_concrete_function"):
    fn = tf.function(fn)
  try:
    with mesh_scope(program.mesh), recording_schedules() as schedules:
      cf = fn.get_concrete_function(*program.arg_specs)
  except ShardingError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise UserCodeError(e) from e
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
  gd, outputs, structure = _dense_results(gd, cf, getattr(program.fn, "__name__", "the function"))
  _mark_variable_shapes(gd, variables)
  drop_colocation(gd)   # its traced static shapes then survive the grappler pass (e.g. embedding_lookup's)
  return program.replace(graph_def=gd, input_names=tuple(inputs), output_refs=tuple(outputs),
                         output_structure=structure, variable_names=tuple(n for n, _ in variables),
                         variables=tuple(v for _, v in variables), pipelines=tuple(schedules),
                         checks=_checks(cf.graph, gd))


def _mark_variable_shapes(gd, variables):
  """Each captured variable's handle Placeholder states its value's shape and dtype (TF's `_handle_shapes` and
  `_handle_dtypes` attributes): a variable the program only gathers from (`tf.gather` on it is ResourceGather)
  has no read or write to tell them."""
  known = {name: v for name, v in variables if v is not None and v.shape.is_fully_defined()}
  for node in gd.node:
    v = known.get(node.name)
    if v is not None and node.op == "Placeholder" and "_handle_shapes" not in node.attr:
      node.attr["_handle_shapes"].list.shape.add().CopyFrom(v.shape.as_proto())
      node.attr["_handle_dtypes"].list.type.append(v.dtype.as_datatype_enum)


# Ops a program runs to check or show values (TF's debug ops): they run whenever the function runs, as in a
# tf.function, though no result reads them. The failing ones raise InvalidArgumentError when their check fails.
FAILING_CHECK_OPS = frozenset(("Assert", "CheckNumerics", "CheckNumericsV2"))
CHECK_OPS = FAILING_CHECK_OPS | {"PrintV2", "Print"}


def _checks(graph, gd):
  """Names of the function's control outputs (the ops tf.function runs though no result reads them) that check or
  print values: an op of CHECK_OPS, or a call or control-flow op whose functions run one (an `AssertGuard` If)."""
  holding = functions_holding({f.signature.name: f for f in gd.library.function}, lambda n: n.op in CHECK_OPS)
  names = []
  for op in graph.control_outputs:
    nd = op.node_def
    if nd.op in CHECK_OPS or set(function_names(nd)) & holding:
      names.append(op.name)
  return tuple(names)


def _dense_results(gd, cf, fname):
  """(graph, one tensor ref per result, the results' structure with each result's index in place of it).

  A result left None stays None (it has no tensor). An IndexedSlices becomes one dense tensor, summed over
  repeated indices (UnsortedSegmentSum, what tf.convert_to_tensor builds).
  """
  leaves = tf.nest.flatten(cf.structured_outputs, expand_composites=False)
  flat = [ref(*split_ref(t.name)) for t in cf.outputs]
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(gd)
  refs, slots, pos = [], [], 0
  for k, leaf in enumerate(leaves):
    if leaf is None:
      slots.append(None)
      continue
    n = len(tf.nest.flatten(leaf, expand_composites=True))
    parts, pos = flat[pos:pos + n], pos + n
    if isinstance(leaf, tf.IndexedSlices):
      parts = [_densify(out, leaf, parts, k, fname)]
    elif not isinstance(leaf, tf.Tensor):
      kind = type(leaf).__name__
      fix = _CONVERSIONS.get(kind, "a dense tf.Tensor in its place")
      raise InputError(f"a {kind} cannot be returned: a gs.function returns dense tensors; return {fix}",
                       node=f"result {k} of {fname}")
    slots.append(len(refs))
    refs.append(parts[0])
  return out, refs, tf.nest.pack_sequence_as(cf.structured_outputs, slots, expand_composites=False)


def _densify(gd, slices, parts, k, fname):
  """Append the dense value of IndexedSlices result `k` to `gd`; returns its ref."""
  dense_shape = None if slices.dense_shape is None else tf.get_static_value(slices.dense_shape)
  if dense_shape is None:
    raise ShapeError("an IndexedSlices without a static dense shape cannot be returned densified; return "
                     "x.values and x.indices as separate results", node=f"result {k} of {fname}")
  values, indices = parts[0], parts[1]
  name = f"gspmd/result_{k}/dense"
  count = tf.compat.v1.AttrValue(tensor=tf.make_tensor_proto(np.int32(dense_shape[0])))
  gd.node.extend([
      node_def(f"{name}/rows", "Const", attrs={"dtype": tf.compat.v1.AttrValue(type=tf.int32.as_datatype_enum),
                                                  "value": count}),
      node_def(name, "UnsortedSegmentSum", [values, indices, f"{name}/rows"],
               {"T": tf.compat.v1.AttrValue(type=slices.values.dtype.as_datatype_enum),
                "Tindices": tf.compat.v1.AttrValue(type=slices.indices.dtype.as_datatype_enum),
                "Tnumsegments": tf.compat.v1.AttrValue(type=tf.int32.as_datatype_enum)}),
  ])
  return ref(name)


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
