"""Static shapes TF's import leaves unknown where the program determines them.

A while-loop gradient reads back what its forward loop stacked: the accumulator TensorLists start with an unknown
element shape, learn it only inside the forward body (the value it pushes), and a value popped from them in the
gradient body then has unknown rank, as has everything computed from it (an unknown-shape gradient of a known
forward value). These steps give such tensors their shapes:

1. A loop's list variable takes the element shape its body pushes onto it (read off the body function).
2. An element a list op reads (TensorListPopBack, TensorListGetItem) takes its list's element shape.
3. An op whose operands now have known shapes is asked again: TF's own shape function, run on a scratch copy of
   the op whose operands have those shapes (constants, and shapes of fully known tensors, as values; a variable
   handle whose value's shape is known as a VarHandleOp of that shape, so an op reading it, e.g. the
   ResourceGather of `tf.nn.embedding_lookup`, gets its output's shape).
4. A loop whose outputs have unknown rank (a gradient loop that a graph optimizer rebuilt with an unknown
   `output_shapes`) gives each output its initial value's shape when its body, run on parameters of the initial
   values' shapes, returns every loop variable of known shape in that same shape: the shapes then hold in every
   iteration, so on exit.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.ops.tensor_list import LIST_OPS
from tf_gspmd.rewriter.graph import functions

_WHILE = ("While", "StatelessWhile")
_VALUES = ("Shape", "Size", "Rank")   # known from the shape of their operand alone


def loop_list_shapes(tf_graph, graph_def):
  """{(While op name, loop variable index): (element shape, dtype)} of the TensorList loop variables whose
  element shape the loop's body determines (the value it pushes or sets), for the loops of `tf_graph`."""
  library = {f.signature.name: f for f in graph_def.library.function}
  found = {}
  for op in tf_graph.get_operations():
    if op.type not in _WHILE or not any(t.dtype == tf.variant for t in op.inputs):
      continue
    fdef = library.get(op.get_attr("body").name)
    if fdef is None:
      continue
    try:
      with tf_graph.as_default():
        body = _compat.function_def_to_graph(fdef, [t.shape for t in op.inputs])
    except (ValueError, TypeError, KeyError, tf.errors.OpError):
      continue   # a body TF cannot import on its own: its lists keep what the graph says
    for k, t in enumerate(body.outputs):
      if k < len(op.inputs) and op.inputs[k].dtype == tf.variant:
        shape = _pushed_element(t)
        if shape is not None:
          found[(op.name, k)] = shape
  return found


def _pushed_element(t):
  """(shape, dtype) of the elements list handle `t` last had written, when a list op in its history shows them."""
  for _ in range(10000):
    op = t.op
    if op.type in LIST_OPS:
      known = list_element_shape(op)
      if known is not None:
        return known
      handles_in = LIST_OPS[op.type].handles_in
      if not handles_in:
        return None
      t = op.inputs[handles_in[0]]
    elif op.type == "Identity":
      t = op.inputs[0]
    else:
      return None
  return None


def refine(tf_graph, infos, make_info, unknown_rank, graph_def=None):
  """Steps 2 to 4 on `infos` ({op name: [TensorInfo]}) in the graph's op order (a topological order); returns the
  names of the ops whose outputs got shapes. Step 4 reads loop bodies from `graph_def`'s library."""
  refined = set()
  for op in tf_graph.get_operations():
    outs = infos[op.name]
    missing = [k for k, info in enumerate(outs) if unknown_rank(info)]
    if not missing:
      continue
    shapes = None
    if op.type in LIST_OPS and LIST_OPS[op.type].element is not None and LIST_OPS[op.type].element[0] == "out":
      handle = LIST_OPS[op.type].handles_in
      k = LIST_OPS[op.type].element[1]
      info = infos[op.inputs[handle[0]].op.name][op.inputs[handle[0]].value_index] if handle else None
      if info is not None and info.value_shape is not None and k in missing:
        shapes = {k: info.value_shape}
    elif op.type in _VALUES + ("BroadcastGradientArgs",) and all(
        _known_value(op.outputs[k], infos) is not None for k in missing):
      shapes = {k: tuple(np.shape(_known_value(op.outputs[k], infos))) for k in missing}
    elif op.type in _WHILE and graph_def is not None:
      shapes = _loop_invariant_shapes(op, infos, graph_def.library)
    elif any(x.op.name in refined or _known_value(x, infos) is not None or _variable_value(x, infos) is not None
             for x in op.inputs) and not _calls_function(op):
      shapes = _infer(op, infos)
    for k, shape in (shapes or {}).items():
      if k in missing and shape is not None:
        outs[k] = make_info(outs[k], shape)
        refined.add(op.name)
  return refined


def _loop_invariant_shapes(op, infos, library):
  """{output index: shape} of While `op` whose loop variables keep their initial values' shapes (step 4)."""
  initial = []
  for x in op.inputs:
    info = infos[x.op.name][x.value_index]
    if x.dtype in (tf.variant, tf.resource):
      initial.append(None)   # a handle: no shape of its own
    elif info.shape is None:
      return {}   # the body would read that parameter's shape off its (possibly stale) signature
    else:
      initial.append(info.shape)
  try:
    gd, _, results = functions.body_graph_def(library, op.get_attr("body").name, initial)
    for node in gd.node:   # shapes recorded when the body was traced or optimized; TF's own inference decides here
      node.attr.pop("_output_shapes", None)
    with tf.Graph().as_default() as body:
      tf.graph_util.import_graph_def(gd, name="")
    results = [body.get_tensor_by_name(r) for r in results]
  except (ValueError, TypeError, KeyError, tf.errors.OpError):
    return {}   # a body TF cannot import on its own: the loop keeps what the graph says
  if len(results) != len(initial):
    return {}
  for shape, result in zip(initial, results):
    if shape is not None and (not result.shape.is_fully_defined() or tuple(result.shape.as_list()) != shape):
      return {}   # a loop variable changes shape (or the body does not say): no output is known
  return {k: shape for k, shape in enumerate(initial) if shape is not None}


def _calls_function(op):
  return any(isinstance(v, tf.compat.v1.NameAttrList) or (isinstance(v, list) and v and
                                                           isinstance(v[0], tf.compat.v1.NameAttrList))
             for v in (_attr(op, a.name) for a in op.op_def.attr))


def _attr(op, name):
  try:
    return op.get_attr(name)
  except ValueError:
    return None


def _infer(op, infos):
  """{output index: fully known shape} TF's shape function gives `op` on operands of the shapes in `infos`."""
  scratch = tf.Graph()
  with scratch.as_default():
    inputs = []
    for x in op.inputs:
      info = infos[x.op.name][x.value_index]
      value = _known_value(x, infos)
      variable = _variable_value(x, infos)
      if value is not None:
        inputs.append(tf.constant(value, dtype=x.dtype))
      elif variable is not None:   # its handle data (the value's shape and dtype) reaches the op's shape function
        inputs.append(tf.raw_ops.VarHandleOp(dtype=variable[1], shape=variable[0]))
      elif x.dtype in (tf.variant, tf.resource) or info.shape is None:
        inputs.append(tf.compat.v1.placeholder(x.dtype, shape=None))
      else:
        inputs.append(tf.compat.v1.placeholder(x.dtype, shape=info.shape))
    try:
      made = scratch.create_op(op.type, inputs, [t.dtype for t in op.outputs],
                               attrs={k: v for k, v in op.node_def.attr.items() if not k.startswith("_")},
                               compute_device=False)
    except (ValueError, TypeError, tf.errors.OpError):
      return {}
  return {k: tuple(t.shape.as_list()) for k, t in enumerate(made.outputs) if t.shape.is_fully_defined()}


def _variable_value(x, infos):
  """(shape, dtype) of the value behind variable handle `x` when its info knows them (graph_ir attaches them from
  the handle's VarHandleOp, a captured variable's `_handle_shapes`, or a read or write of it); else None."""
  if x.dtype != tf.resource:
    return None
  info = infos[x.op.name][x.value_index]
  if info.value_shape is None or info.value_dtype is None:
    return None
  return info.value_shape, info.value_dtype


def _known_value(x, infos):
  """The value of tensor `x` when it is a constant, the shape of a tensor of known shape or a gradient's
  broadcast reduction indices between two such shapes; else None."""
  op = x.op
  if op.type == "Const":
    return tf.make_ndarray(op.get_attr("value"))
  if op.type in _VALUES and op.inputs:
    shape = infos[op.inputs[0].op.name][op.inputs[0].value_index].shape
    if shape is None or op.inputs[0].dtype in (tf.variant, tf.resource):
      return None
    if op.type == "Shape":
      return list(shape)
    if op.type == "Size":
      n = 1
      for d in shape:
        n *= d
      return n
    return len(shape)
  if op.type == "BroadcastGradientArgs":   # a gradient's reduction indices, from two known shapes
    s0, s1 = (_known_value(i, infos) for i in op.inputs)
    if s0 is None or s1 is None:
      return None
    with _compat.eager_mode():   # evaluated by TF's kernel
      return tf.raw_ops.BroadcastGradientArgs(s0=s0, s1=s1)[x.value_index].numpy()
  return None


def list_element_shape(op):
  """(shape, dtype) of the elements of the TensorList op `op` touches, when its graph says so statically."""
  where = LIST_OPS[op.type].element
  if where is None:
    return None
  kind, i = where
  if kind == "shape_in":
    value = tf.get_static_value(op.inputs[i])
    if value is None or np.ndim(value) != 1 or np.any(np.asarray(value) < 0):
      return None
    return tuple(int(v) for v in value), op.get_attr("element_dtype")
  t = op.inputs[i] if kind.startswith("in") else op.outputs[i]
  if not t.shape.is_fully_defined():
    return None
  shape = tuple(t.shape.as_list())
  return (shape[1:] if kind.endswith("stacked") else shape), t.dtype
