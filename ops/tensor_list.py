"""TensorLists (TF2's loop accumulators for gradients, tf.TensorArray): a list handle carries its elements' layout.

Each device's list holds its shards of the elements. A handle (a variant) cannot be resharded, so all handles
of one list -- from its creation through pushes, pops and the While loop variables it travels in -- share one
element layout: every list op passes the layout between its handles and its elements, elements going in are
resharded to the list's layout, and element-shape inputs become the local element shape. Stacked tensors
(stack, gather, from-tensor, scatter) carry the elements on dims 1.. and keep their leading dim whole.
"""

import collections

import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.errors import PartitionError
from tf_gspmd.ops.registry import Rule, register

# handles_in / handles_out: input / output indices that are list handles; element: where the element shape shows,
# ("in", i) an element input, ("out", o) an element output, ("in_stacked", i) / ("out_stacked", o) elements
# stacked on dim 0, ("shape_in", i) a constant element-shape input; shape_inputs: element-shape inputs.
ListOp = collections.namedtuple("ListOp", "handles_in handles_out element shape_inputs")
LIST_OPS = {
    "EmptyTensorList": ListOp((), (0,), ("shape_in", 0), (0,)),
    "TensorListReserve": ListOp((), (0,), ("shape_in", 0), (0,)),
    "TensorListPushBack": ListOp((0,), (0,), ("in", 1), ()),
    "TensorListPopBack": ListOp((0,), (0,), ("out", 1), (1,)),
    "TensorListGetItem": ListOp((0,), (), ("out", 0), (2,)),
    "TensorListSetItem": ListOp((0,), (0,), ("in", 2), ()),
    "TensorListStack": ListOp((0,), (), ("out_stacked", 0), (1,)),
    "TensorListGather": ListOp((0,), (), ("out_stacked", 0), (2,)),
    "TensorListFromTensor": ListOp((), (0,), ("in_stacked", 0), (1,)),
    "TensorListScatterV2": ListOp((), (0,), ("in_stacked", 0), (2,)),
    "TensorListScatterIntoExistingList": ListOp((0,), (0,), ("in_stacked", 1), ()),
    "TensorListLength": ListOp((0,), (), None, ()),
}


class ListShape(collections.namedtuple("ListShape", "element_shape element_dtype")):
  """What a function body is told of a TensorList argument in place of its shape (the handle is a scalar): its
  elements' shape and dtype, so that a list a loop body only carries along keeps its element rank there."""

  __slots__ = ()

  ATTRS = ("_gspmd_list_element_shape", "_gspmd_list_element_dtype")   # where the body's parameter holds it

  def attrs(self):
    """The body parameter's node attributes that say it (see rewriter/graph/graph_ir.py)."""
    return {self.ATTRS[0]: tf.compat.v1.AttrValue(shape=tf.TensorShape(self.element_shape).as_proto()),
            self.ATTRS[1]: tf.compat.v1.AttrValue(type=self.element_dtype.as_datatype_enum)}


def _element_ports(kind):
  """(element inputs, element outputs, stacked inputs, stacked outputs) of a list op."""
  ports = ([], [], [], [])
  if kind.element is not None and kind.element[0] != "shape_in":
    where, i = kind.element
    ports[{"in": 0, "out": 1, "in_stacked": 2, "out_stacked": 3}[where]].append(i)
  return ports


def _unstacked(s):
  return None if s is None or s.is_maximal else Sharding(s.mesh, tuple(s.dims[1:]))


def _stacked(s):
  return Sharding(s.mesh, ((),) + tuple(s.dims))


@register(*LIST_OPS)
class TensorList(Rule):
  """Handles and elements of one list share a layout; stacked tensors add a whole leading dim."""

  priority = 0
  rank_free = True

  def _layouts(self, node, ins, outs):
    """The element layouts the node's handles and elements already have (completion merges them)."""
    kind = LIST_OPS[node.op]
    e_in, e_out, s_in, s_out = _element_ports(kind)
    found = ([ins[i] for i in kind.handles_in] + [outs[o] for o in kind.handles_out] + [ins[i] for i in e_in] +
             [outs[o] for o in e_out] + [_unstacked(ins[i]) for i in s_in] + [_unstacked(outs[o]) for o in s_out])
    return [s for s in found if s is not None and not s.is_maximal]

  @staticmethod
  def _candidates(count, layouts, elements, stacked):
    """Candidate layouts for `count` tensors: `layouts` for the handles and elements, stacked ones for those."""
    cands = [[] for _ in range(count)]
    for k in elements:
      cands[k].extend(layouts)
    for k in stacked:
      cands[k].extend(_stacked(s) for s in layouts)
    return cands

  def forward(self, ctx, node, operands):
    kind = LIST_OPS[node.op]
    _, e_out, _, s_out = _element_ports(kind)
    layouts = self._layouts(node, operands, [None] * len(node.outputs))
    return self._candidates(len(node.outputs), layouts, list(kind.handles_out) + e_out, s_out)

  def backward(self, ctx, node, outputs, operands):
    kind = LIST_OPS[node.op]
    e_in, _, s_in, _ = _element_ports(kind)
    layouts = self._layouts(node, [None] * len(node.inputs), outputs)
    return self._candidates(len(node.inputs), layouts, list(kind.handles_in) + e_in, s_in)

  def partition(self, ctx, node):
    kind = LIST_OPS[node.op]
    e_in, e_out, s_in, s_out = _element_ports(kind)
    if kind.handles_in:
      layout = ctx.current(kind.handles_in[0])
    elif kind.handles_out:
      layout = ctx.target(kind.handles_out[0])
    else:
      layout = None
    info = node.input_info(kind.handles_in[0]) if kind.handles_in else node.outputs[kind.handles_out[0]]
    if not info.is_list:   # element shape unknown: the list is opaque and its elements are whole
      layout = Sharding(ctx.mesh)
    rank = len(info.value_shape) if info.is_list else 0
    layout = layout.with_rank(rank) if not layout.is_maximal else Sharding(ctx.mesh, ((),) * rank)
    inputs = {}
    for i in kind.handles_in:
      inputs[i] = ctx.operand(i, layout)
    for i in e_in:
      inputs[i] = ctx.operand(i, layout)
    for i in s_in:
      inputs[i] = ctx.operand(i, _stacked(layout))
    for i in kind.shape_inputs:
      inputs[i] = self._local_element_shape(ctx, node, i, info, layout)
    outs = ctx.clone(node, inputs)
    for o in range(len(node.outputs)):
      if o in kind.handles_out:
        ctx.set_output(o, outs[o], layout)
      elif o in e_out or o in s_out:   # (the ops' shape functions read the handle, which knows no shape here)
        natural = layout if o in e_out else _stacked(layout)
        if node.outputs[o].shape is not None:   # (an element of unknown rank stays as the kernel makes it)
          outs[o].set_shape(natural.shard_shape(node.outputs[o].shape))
        ctx.set_output(o, outs[o], natural)
      else:
        ctx.set_output(o, outs[o], Sharding(ctx.mesh))

  @staticmethod
  def _local_element_shape(ctx, node, i, info, layout):
    """Element-shape input i as the shard's shape (the whole element's shape is known statically)."""
    if not info.is_list:
      if layout.is_replicated:
        return ctx.operand(i, Sharding(ctx.mesh))
      raise PartitionError(f"the element shape of the list at {node.name} ({node.op}) is not known statically, "
                           f"but its elements are split as {layout}; give the list a static element shape",
                           node=node.name, op_type=node.op)
    with ctx.helper_scope():
      return tf.constant(layout.shard_shape(info.value_shape), dtype=node.input_info(i).dtype,
                         name="local_element_shape")


@register("TensorListElementShape")
class TensorListElementShape(Rule):
  """The elements' shape of a list (a gradient's accumulator is reserved with it): the whole element's shape,
  a replicated value; the ops that take it as an element-shape input make it the shard's shape themselves."""

  priority = 0
  rank_free = True

  def partition(self, ctx, node):
    info = node.input_info(0)
    layout = ctx.current(0)
    if info.is_list:
      with ctx.helper_scope():
        value = tf.constant(info.value_shape, dtype=node.attr("shape_type"), name="element_shape")
      ctx.record(value.op)
    elif layout is None or layout.is_maximal or layout.is_replicated:
      (value,) = ctx.clone(node, {0: ctx.operand(0, Sharding(ctx.mesh))})
    else:
      raise PartitionError(f"the element shape of the list read by {node.name} (TensorListElementShape) is not known "
                           f"statically, but its elements are split as {layout}; give the list a static element "
                           "shape", node=node.name, op_type=node.op)
    ctx.set_output(0, value, Sharding(ctx.mesh))
