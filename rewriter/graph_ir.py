"""A read-only view of a TF GraphDef with static shapes, in topological order.

Tensor references are "node:index". Public sharding keys drop ":0" (the tensor `h` is "h", its second
output "h:1"), matching how users name tensors with tf.identity(..., name="h").
"""

import dataclasses
import re
from typing import Dict, Optional, Tuple

import tensorflow as tf
from tensorflow.python.framework import tensor_util

from tf_gspmd.errors import ShapeError

_SHAPELESS = (tf.resource, tf.variant, tf.string)


def ref(name, index=0):
  return f"{name}:{index}"


def split_ref(r):
  name, _, idx = r.rpartition(":")
  if not name or not idx.isdigit():
    return r, 0
  return name, int(idx)


def public_key(r):
  name, idx = split_ref(r)
  return name if idx == 0 else f"{name}:{idx}"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  shape: Optional[Tuple[int, ...]]
  dtype: tf.DType
  value_shape: Optional[Tuple[int, ...]] = None   # for a variable handle: the shape of the variable's value
  value_dtype: Optional[tf.DType] = None           # ... and its element type

  @property
  def partitionable(self):
    """False for opaque values (resources, variants, strings, unknown rank): they stay as produced."""
    return self.shape is not None and self.dtype not in _SHAPELESS

  @property
  def sharding_rank(self):
    """Rank of the layout this tensor can carry: its own, its variable's value rank, or None (opaque)."""
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
    # variables). A rewrite may have left one that no longer fits its node: drop it and import again.
    hinted = tf.compat.v1.GraphDef()
    hinted.CopyFrom(graph_def)
    by_name = {n.name: n for n in hinted.node}
    while True:
      tf_graph = tf.Graph()
      try:
        with tf_graph.as_default():
          tf.graph_util.import_graph_def(hinted, name="")
        break
      except ValueError as e:
        stale = re.search(r"Node '([^']+)' has an _output_shapes attribute inconsistent", str(e))
        if not stale or "_output_shapes" not in by_name.get(stale.group(1), tf.compat.v1.NodeDef()).attr:
          raise
        del by_name[stale.group(1)].attr["_output_shapes"]
    traced = {n.name: n.attr["_output_shapes"].list.shape for n in hinted.node if "_output_shapes" in n.attr}
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
    order = _topological(graph_def)
    for nd in order:  # the first dynamic tensor in data-flow order is the cause
      if nd.name in dynamic:
        t, op = dynamic[nd.name]
        raise ShapeError(f"tensor {t.name} produced by {op.type} has dynamic shape {t.shape}; tf_gspmd needs static "
                         "shapes: trace with fully defined TensorSpecs and avoid ops with data-dependent shapes",
                         node=op.name, op_type=op.type)
    for nd in order:
      data = [i for i in nd.input if not i.startswith("^")]
      ctrl = [i[1:] for i in nd.input if i.startswith("^")]
      node = Node(nd, [_norm_ref(i) for i in data], ctrl, infos[nd.name], self)
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
      self._consts[r] = tensor_util.MakeNdarray(node.node_def.attr["value"].tensor)
    return self._consts[r]

  def tensors(self):
    for node in self.nodes:
      for i in range(len(node.outputs)):
        yield node.ref(i)


_READS = {"ReadVariableOp": 0, "AssignVariableOp": 1, "AssignAddVariableOp": 1, "AssignSubVariableOp": 1}


def _attach_variable_shapes(tf_graph, infos):
  """Give every variable handle the shape of its value, read off the ops that read or write it."""
  for op in tf_graph.get_operations():
    pairs = []
    if op.type == "VarHandleOp":
      shape = tf.TensorShape(op.get_attr("shape"))
      if shape.is_fully_defined():
        old = infos[op.name][0]
        infos[op.name][0] = TensorInfo(old.shape, old.dtype, tuple(shape.as_list()), op.get_attr("dtype"))
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


def prune(graph_def, roots):
  """A copy of `graph_def` with only the nodes that `roots` (node names) depend on."""
  by_name = {n.name: n for n in graph_def.node}
  live, stack = set(), list(roots)
  while stack:
    name = stack.pop()
    if name in live or name not in by_name:
      continue
    live.add(name)
    stack.extend(split_ref(i.lstrip("^"))[0] for i in by_name[name].input)
  out = tf.compat.v1.GraphDef()
  out.versions.CopyFrom(graph_def.versions)
  out.node.extend(n for n in graph_def.node if n.name in live)
  # Only the functions the kept nodes use (directly or through other functions).
  funcs = {f.signature.name: f for f in graph_def.library.function}
  used, stack = set(), [name for n in out.node for name in _func_names(n)]
  while stack:
    name = stack.pop()
    if name in used or name not in funcs:
      continue
    used.add(name)
    stack.extend(x for nd in funcs[name].node_def for x in _func_names(nd))
  out.library.function.extend(f for f in graph_def.library.function if f.signature.name in used)
  out.library.gradient.extend(g for g in graph_def.library.gradient if g.function_name in used)
  return out


def _func_names(node_def):
  """Names of the functions a NodeDef refers to (func attrs, lists of funcs, and function-call op types)."""
  names = [node_def.op]
  for v in node_def.attr.values():
    if v.HasField("func"):
      names.append(v.func.name)
    elif v.HasField("list"):
      names.extend(f.name for f in v.list.func)
  return names


def side_effect_nodes(graph_def):
  """Nodes run for their effect: stateful ops whose outputs nobody needs to see (e.g. variable writes)."""
  from tensorflow.python.framework import op_def_registry  # pylint: disable=g-import-not-at-top
  out = []
  for n in graph_def.node:
    op_def = op_def_registry.get(n.op)
    if op_def is not None and op_def.is_stateful and not op_def.output_arg and n.op != "NoOp":
      out.append(n.name)
  return out


def _norm_ref(r):
  name, idx = split_ref(r)
  return ref(name, idx)


def _topological(graph_def):
  """Kahn's algorithm, stable in GraphDef order (deterministic)."""
  nodes = list(graph_def.node)
  index = {n.name: k for k, n in enumerate(nodes)}
  deps = {n.name: set() for n in nodes}
  users = {n.name: [] for n in nodes}
  for n in nodes:
    for i in n.input:
      src = split_ref(i.lstrip("^"))[0]
      if src in index and src not in deps[n.name]:
        deps[n.name].add(src)
        users[src].append(n.name)
  import heapq  # pylint: disable=g-import-not-at-top
  ready = [index[n.name] for n in nodes if not deps[n.name]]
  heapq.heapify(ready)
  out = []
  remaining = {k: len(v) for k, v in deps.items()}
  while ready:
    k = heapq.heappop(ready)
    n = nodes[k]
    out.append(n)
    for u in users[n.name]:
      remaining[u] -= 1
      if remaining[u] == 0:
        heapq.heappush(ready, index[u])
  if len(out) != len(nodes):
    raise ShapeError("the traced graph has a cycle outside functional control flow")
  return out
