"""A read-only view of a TF GraphDef with static shapes, in topological order.

Tensor references are "node:index" (see graph_view, which this module's ref helpers come from).
"""

import dataclasses
from typing import Dict, Optional, Tuple

import tensorflow as tf

from tf_gspmd.errors import ShapeError
from tf_gspmd.ops.registry import unknown_rank
from tf_gspmd.ops.tensor_list import LIST_OPS, ListShape
from tf_gspmd.rewriter.graph import shape_refine
from tf_gspmd.rewriter.graph.graph_view import GraphView, ref, split_ref

_SHAPELESS = (tf.resource, tf.variant, tf.string)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  shape: Optional[Tuple[int, ...]]
  dtype: tf.DType
  value_shape: Optional[Tuple[int, ...]] = None   # variable handle: its value's shape; TensorList: its elements'
  value_dtype: Optional[tf.DType] = None           # ... and their element type

  @property
  def partitionable(self):
    """False for opaque values (resources, variants, strings, unknown rank): they stay as produced."""
    return self.shape is not None and self.dtype not in _SHAPELESS

  @property
  def is_list(self):
    """A TensorList handle whose element shape is known (it carries its elements' layout)."""
    return self.dtype == tf.variant and self.value_shape is not None

  @property
  def sharding_rank(self):
    """Rank of the layout this tensor can carry: its own, its variable's value rank or its list's element rank,
    or None (opaque)."""
    if self.partitionable:
      return len(self.shape)
    return None if self.value_shape is None else len(self.value_shape)


class Node:
  """One op: its NodeDef, data inputs as refs, control inputs, output infos, and its graph."""

  def __init__(self, node_def, inputs, control, outputs, graph):
    self.node_def = node_def
    self.name = node_def.name
    self.op = node_def.op
    self.inputs = tuple(inputs)
    self.control = tuple(control)
    self.outputs = tuple(outputs)
    self.graph = graph
    self.memo = {}    # facts a rule derives once per node (ops/context.NodeView)

  @property
  def attrs(self):
    return self.node_def.attr

  def attr(self, key, default=None):
    if key not in self.node_def.attr:
      return default
    v = self.node_def.attr[key]
    kind = v.WhichOneof("value")
    if kind == "list":
      return v.list
    if kind == "type":
      return tf.as_dtype(v.type)
    return getattr(v, kind) if kind else default

  def ref(self, index=0):
    return ref(self.name, index)

  def input_info(self, i) -> TensorInfo:
    return self.graph.info(self.inputs[i])

  def input_shape(self, i):
    return self.input_info(i).shape

  def const_input(self, i):
    """The numpy value of input i when it is produced by a Const node, else None."""
    return self.graph.const_value(self.inputs[i])

  def __repr__(self):
    return f"Node({self.name}: {self.op})"


class Graph:
  """Nodes of a GraphDef in topological order, with shapes; `inputs` are the function's parameters."""

  def __init__(self, graph_def, inputs, outputs):
    self.graph_def = graph_def
    self.inputs = tuple(inputs)      # Placeholder node names, in argument order
    self.outputs = tuple(outputs)    # output tensor refs, in flattened output order
    # Traced shapes (`_output_shapes`) let the import see what shape inference cannot (e.g. reads of
    # variables). Passes keep them only on nodes they left unchanged; should one still not fit its node, the
    # graph is imported without any and static shapes come from inference (merged with the traced ones below).
    # A captured variable's handle is imported as a VarHandleOp of its value's stated shape (`_with_handle_data`):
    # TF's shape functions of the ops reading it (ResourceGather, ResourceGatherNd, ...) then see that shape.
    imported = _with_handle_data(graph_def)
    tf_graph = tf.Graph()
    try:
      with tf_graph.as_default():
        tf.graph_util.import_graph_def(imported, name="")
    except ValueError:
      bare = tf.compat.v1.GraphDef()
      bare.CopyFrom(imported)
      for n in bare.node:
        n.attr.pop("_output_shapes", None)
      tf_graph = tf.Graph()
      with tf_graph.as_default():
        tf.graph_util.import_graph_def(bare, name="")
    traced = {n.name: n.attr["_output_shapes"].list.shape for n in graph_def.node if "_output_shapes" in n.attr}
    self.nodes = []
    self.by_name: Dict[str, Node] = {}
    infos, dynamic = {}, {}
    for op in tf_graph.get_operations():
      outs = []
      for t in op.outputs:
        static = t.shape
        if not static.is_fully_defined() and op.name in traced and t.value_index < len(traced[op.name]):
          hint = tf.TensorShape(traced[op.name][t.value_index])
          if static.is_compatible_with(hint):
            static = static.merge_with(hint)   # known when traced
        if t.dtype in _SHAPELESS or static.rank is None:   # opaque (e.g. a kernel's reserve space)
          shape = tuple(static.as_list()) if static.rank is not None and static.is_fully_defined() else None
        elif not static.is_fully_defined():
          dynamic.setdefault(op.name, (t, op))
          shape = None
        else:
          shape = tuple(static.as_list())
        outs.append(TensorInfo(shape, t.dtype))
      infos[op.name] = outs
    _attach_variable_shapes(tf_graph, infos)
    _attach_list_element_shapes(tf_graph, infos, shape_refine.loop_list_shapes(tf_graph, graph_def))
    opaque = {op.name for op in tf_graph.get_operations()   # computed from a value of unknown rank
              if any(unknown_rank(infos[x.op.name][x.value_index]) for x in op.inputs)}
    shape_refine.refine(tf_graph, infos, lambda old, shape: TensorInfo(shape, old.dtype, old.value_shape,
                                                                      old.value_dtype), unknown_rank, graph_def)
    try:
      order = GraphView(graph_def).order()
    except ValueError as e:
      raise ShapeError(f"the traced graph has a cycle outside functional control flow: {e}") from e
    for nd in order:  # the first dynamic tensor in data-flow order is the cause
      if nd.name in dynamic:
        t, op = dynamic[nd.name]
        if op.name in opaque:
          continue   # computed from a tensor of unknown rank (a loop gradient's, a call's): as opaque as it is
        raise ShapeError(f"tensor {t.name} produced by {op.type} has dynamic shape {t.shape}; tf_gspmd needs static "
                         "shapes: trace with fully defined TensorSpecs and avoid ops with data-dependent shapes",
                         node=op.name, op_type=op.type)
    for nd in order:
      node = Node(nd, GraphView.data_inputs(nd), GraphView.control_inputs(nd), infos[nd.name], self)
      self.nodes.append(node)
      self.by_name[nd.name] = node
    self.consumers = {}
    for node in self.nodes:
      for k, r in enumerate(node.inputs):
        self.consumers.setdefault(r, []).append((node, k))
    self._consts = {}

  def node(self, name) -> Node:
    return self.by_name[name]

  def info(self, r) -> TensorInfo:
    name, idx = split_ref(r)
    return self.by_name[name].outputs[idx]

  def producer(self, r) -> Node:
    return self.by_name[split_ref(r)[0]]

  def const_value(self, r) -> Optional[object]:
    node = self.producer(r)
    if node.op != "Const":
      return None
    if r not in self._consts:
      self._consts[r] = tf.make_ndarray(node.node_def.attr["value"].tensor)
    return self._consts[r]

  def tensors(self):
    for node in self.nodes:
      for i in range(len(node.outputs)):
        yield node.ref(i)


_READS = {"ReadVariableOp": 0, "AssignVariableOp": 1, "AssignAddVariableOp": 1, "AssignSubVariableOp": 1}


def _stated_value(op):
  """(shape, dtype) of the value behind handle op `op` as its attributes state them -- a VarHandleOp's, or those
  rewriter/frontend/trace.py gives a captured variable's Placeholder (`_handle_shapes`) -- or None."""
  if op.type == "VarHandleOp":
    return tf.TensorShape(op.get_attr("shape")), op.get_attr("dtype")
  attr = op.node_def.attr
  if op.type == "Placeholder" and "_handle_shapes" in attr:
    shapes, dtypes = attr["_handle_shapes"].list.shape, attr["_handle_dtypes"].list.type
    if len(shapes) == 1 and len(dtypes) == 1:
      return tf.TensorShape(shapes[0]), dtypes[0]
  return None


def _with_handle_data(graph_def):
  """`graph_def`, or a copy whose resource Placeholders stating their variable's value (`_handle_shapes` and
  `_handle_dtypes`, as rewriter/frontend/trace.py gives a captured variable's) are VarHandleOps of that shape and
  dtype: the shapes TF infers on import only (an imported Placeholder carries no handle data, so a gather from it
  had no shape, or failed to import: ResourceGatherNd). The Graph's nodes stay those of `graph_def`."""
  stated = [k for k, n in enumerate(graph_def.node) if n.op == "Placeholder" and _stated_handle(n.attr) is not None]
  if not stated:
    return graph_def
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(graph_def)
  for k in stated:
    n = out.node[k]
    shape, dtype = _stated_handle(n.attr)
    kept = {key: tf.compat.v1.AttrValue.FromString(n.attr[key].SerializeToString()) for key in n.attr
            if key.startswith("_")}
    n.op = "VarHandleOp"
    n.ClearField("attr")
    for key, value in kept.items():
      n.attr[key].CopyFrom(value)
    n.attr["dtype"].type = dtype
    n.attr["shape"].shape.CopyFrom(shape)
  return out


def _stated_handle(attr):
  """(TensorShapeProto, DataType enum) of a resource Placeholder's stated value when fully known, else None."""
  if "dtype" not in attr or attr["dtype"].type != tf.resource.as_datatype_enum or not (
      "_handle_shapes" in attr and "_handle_dtypes" in attr):
    return None
  shapes, dtypes = attr["_handle_shapes"].list.shape, attr["_handle_dtypes"].list.type
  if len(shapes) != 1 or len(dtypes) != 1 or not tf.TensorShape(shapes[0]).is_fully_defined():
    return None
  return shapes[0], dtypes[0]


def _attach_variable_shapes(tf_graph, infos):
  """Give every variable handle the shape of its value, read off the ops that read or write it."""
  for op in tf_graph.get_operations():
    pairs = []
    stated = _stated_value(op)
    if stated is not None:   # a handle that states its value's shape: a VarHandleOp, a captured variable's
      shape, dtype = stated
      if shape.is_fully_defined():
        old = infos[op.name][0]
        infos[op.name][0] = TensorInfo(old.shape, old.dtype, tuple(shape.as_list()), tf.as_dtype(dtype))
      continue
    if op.type in _READS and op.inputs:
      pairs = [(op.inputs[0], op.outputs[0] if op.type == "ReadVariableOp" else op.inputs[_READS[op.type]])]
    elif op.type.startswith("ResourceApply"):   # variable and slots are shaped like the gradient
      names = [a.name for a in op.op_def.input_arg]
      grad = op.inputs[names.index("grad") if "grad" in names else names.index("delta")]
      pairs = [(t, grad) for t in op.inputs if t.dtype == tf.resource]
    for handle, value in pairs:
      if value.shape.is_fully_defined():
        outs = infos[handle.op.name]
        old = outs[handle.value_index]
        outs[handle.value_index] = TensorInfo(old.shape, old.dtype, tuple(value.shape.as_list()), value.dtype)


_PASS_THROUGH = ("Identity", "While", "StatelessWhile")
_SAME_ELEMENTS = ("AddN", "ZerosLike", "OnesLike")   # on lists (loop gradients): every list has the same elements
_HANDLES = (tf.variant, tf.resource)   # carry their lists' elements' or variables' value shape through loops


def _attach_list_element_shapes(tf_graph, infos, loop_lists=None):
  """Give every TensorList handle its elements' shape: read off the list ops, carried through loops (a loop's list
  variable also takes the element shape its body writes, `loop_lists`: {(While name, index): (shape, dtype)})."""
  def give(t, shape, dtype):
    outs = infos[t.op.name]
    old = outs[t.value_index]
    if old.dtype in _HANDLES and old.value_shape is None:
      outs[t.value_index] = TensorInfo(old.shape, old.dtype, shape, dtype)
      return True
    return False

  ops = tf_graph.get_operations()
  for op in ops:   # a function body's TensorList parameter, told its elements' shape (completion.body_program)
    if op.type == "Placeholder" and ListShape.ATTRS[0] in op.node_def.attr:
      element = tf.TensorShape(op.get_attr(ListShape.ATTRS[0]))
      if element.is_fully_defined():
        give(op.outputs[0], tuple(element.as_list()), op.get_attr(ListShape.ATTRS[1]))
  for (name, k), (shape, dtype) in (loop_lists or {}).items():
    op = tf_graph.get_operation_by_name(name)
    give(op.outputs[k], shape, dtype)
    give(op.inputs[k], shape, dtype)
  changed = True
  while changed:
    changed = False
    for op in ops:
      if op.type in LIST_OPS:
        known = shape_refine.list_element_shape(op)
        kind = LIST_OPS[op.type]
        handles = [op.inputs[i] for i in kind.handles_in] + [op.outputs[o] for o in kind.handles_out]
        if known is None:
          known = next(((infos[h.op.name][h.value_index].value_shape, infos[h.op.name][h.value_index].value_dtype)
                        for h in handles if infos[h.op.name][h.value_index].value_shape is not None), None)
        if known is not None:
          for h in handles:
            changed |= give(h, *known)
      elif op.type in _SAME_ELEMENTS and op.outputs[0].dtype == tf.variant:
        handles = list(op.inputs) + list(op.outputs)
        known = next(((infos[h.op.name][h.value_index].value_shape, infos[h.op.name][h.value_index].value_dtype)
                      for h in handles if infos[h.op.name][h.value_index].value_shape is not None), None)
        if known is not None:
          for h in handles:
            changed |= give(h, *known)
      elif op.type in _PASS_THROUGH:
        for t_in, t_out in zip(op.inputs, op.outputs):
          a, b = infos[t_in.op.name][t_in.value_index], infos[op.name][t_out.value_index]
          if a.value_shape is not None and a.dtype in _HANDLES:
            changed |= give(t_out, a.value_shape, a.value_dtype)
          elif b.value_shape is not None and b.dtype in _HANDLES:
            changed |= give(t_in, b.value_shape, b.value_dtype)
