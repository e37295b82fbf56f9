"""Variables: a handle carries the layout of its variable's value; every device holds one shard.

Reads produce the local shard in the variable's layout; writes reshard the new value to that layout
first (a variable is never resharded in place). Gathers from a variable split along its first dim use the
masked local lookup of `GatherV2`.
"""

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_gspmd._sharding import Sharding
from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.indexing import Gather
from tf_gspmd.ops.registry import Rule, register


def _value_labels(node, i=0):
  return tuple(f"d{k}" for k in range(len(node.input_info(i).value_shape or ())))


def _handle_sharding(ctx, node):
  s = ctx.current(0)
  rank = len(node.input_info(0).value_shape or ())
  return Sharding(ctx.mesh, ((),) * rank) if s is None or s.is_maximal else s.with_rank(rank)


@register("VarHandleOp")
class VarHandle(Rule):
  """A variable created inside the function: each device creates its own shard (shape attr = shard shape)."""

  priority = 0

  def partition(self, ctx, node):
    layout = ctx.target(0)
    local = layout.shard_shape(node.outputs[0].value_shape or ())
    shape = attr_value_pb2.AttrValue(shape=tf.TensorShape(local).as_proto())
    (handle,) = ctx.clone(node, {}, attrs={"shape": shape})
    ctx.set_output(0, handle, layout)


@register("ReadVariableOp")
class ReadVariable(FactorRule):
  """value = read(handle): the value is laid out like the variable."""

  priority = 0

  def factors(self, node):
    labels = _value_labels(node)
    return Factors((labels,), (labels,))

  def partition(self, ctx, node):
    (value,) = ctx.clone(node, {0: ctx.operand(0, None)})
    ctx.set_output(0, value, _handle_sharding(ctx, node))


@register("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
class AssignVariable(FactorRule):
  """write(handle, value): the value is resharded to the variable's layout, then written locally."""

  priority = 0

  def factors(self, node):
    labels = _value_labels(node)
    return Factors((labels, labels), ())

  def partition(self, ctx, node):
    value = ctx.operand(1, _handle_sharding(ctx, node))
    ctx.clone(node, {0: ctx.operand(0, None), 1: value})


@register("ResourceGather")
class ResourceGather(Gather):
  """table[ids] with the table a variable: like GatherV2 along dim 0, the table never resharded."""

  def _axis(self, node):
    return 0

  def _params_shape(self, node):
    return node.input_info(0).value_shape

  def factors(self, node):
    p_rank, i_rank = len(self._params_shape(node)), len(node.input_shape(1))
    p = tuple(f"p{d}" for d in range(p_rank))
    idx = tuple(f"i{d}" for d in range(i_rank))
    return Factors((("v",) + p[1:], idx), (idx + p[1:],))

  def partition(self, ctx, node):
    table = _handle_sharding(ctx, node)
    target = ctx.target(0)
    i_rank = len(node.input_shape(1))
    # Index dims follow the output's layout where the table does not already use those mesh axes.
    ids_dims = tuple(() if target.is_maximal or set(target.dims[d]) & set(table.used_axes) else target.dims[d]
                     for d in range(i_rank))
    ids = ctx.operand(1, Sharding(ctx.mesh, ids_dims))
    natural = Sharding(ctx.mesh, ids_dims + table.dims[1:])
    handle = ctx.operand(0, None)
    v_axes = table.dims[0] if table.dims else ()
    if not v_axes:
      (rows,) = ctx.clone(node, {0: handle, 1: ids})
      return ctx.set_output(0, rows, natural)
    size = self._params_shape(node)[0]
    with ctx.helper_scope():
      params = tf.raw_ops.ReadVariableOp(resource=handle, dtype=node.attr("dtype"), name="read")
    rows = self.masked_lookup(ctx, params, ids, table, 0, size)
    ctx.set_output(0, rows, natural, partial=(v_axes, "Add"))


_APPLY_OPS = ("ResourceApplyGradientDescent", "ResourceApplyMomentum", "ResourceApplyKerasMomentum",
              "ResourceApplyAdagrad", "ResourceApplyAdagradV2", "ResourceApplyAdam", "ResourceApplyAdamWithAmsgrad",
              "ResourceApplyAdaMax", "ResourceApplyRMSProp", "ResourceApplyCenteredRMSProp", "ResourceApplyAdadelta",
              "ResourceApplyFtrl", "ResourceApplyFtrlV2", "ResourceApplyProximalGradientDescent",
              "ResourceApplyProximalAdagrad", "ResourceApplyAddSign", "ResourceApplyPowerSign")


@register(*_APPLY_OPS)
class ResourceApply(FactorRule):
  """Fused optimizer updates: the variable, its slots and the gradient share one layout; scalars replicated."""

  priority = 0

  def _grad_index(self, node):
    from tensorflow.python.framework import op_def_registry  # pylint: disable=g-import-not-at-top
    names = [a.name for a in op_def_registry.get(node.op).input_arg]
    return names.index("grad") if "grad" in names else names.index("delta")

  def factors(self, node):
    labels = _value_labels(node)
    g = self._grad_index(node)
    per_input = []
    for i in range(len(node.inputs)):
      info = node.input_info(i)
      per_input.append(labels if (i == g or info.value_shape is not None) else (None,) * len(info.shape or ()))
    return Factors(tuple(per_input), ())

  def partition(self, ctx, node):
    layout = _handle_sharding(ctx, node)
    g = self._grad_index(node)
    inputs = {i: ctx.operand(i, layout if i == g else Sharding(ctx.mesh)) for i in range(len(node.inputs))}
    ctx.clone(node, inputs)


# var[ids] (op)= updates, for a variable split along its first dim: each device folds the updates of the rows it
# owns into one dense delta (the ids of other rows map to the dropped segment -1) and combines it locally.
_SCATTER_COMBINE = {
    "ResourceScatterAdd": (tf.math.unsorted_segment_sum, lambda old, d, hit: old + d),
    "ResourceScatterSub": (tf.math.unsorted_segment_sum, lambda old, d, hit: old - d),
    "ResourceScatterMul": (tf.math.unsorted_segment_prod, lambda old, d, hit: old * d),
    "ResourceScatterDiv": (tf.math.unsorted_segment_prod, lambda old, d, hit: old / d),
    "ResourceScatterMin": (tf.math.unsorted_segment_min, lambda old, d, hit: tf.minimum(old, d)),
    "ResourceScatterMax": (tf.math.unsorted_segment_max, lambda old, d, hit: tf.maximum(old, d)),
    "ResourceScatterUpdate": (tf.math.unsorted_segment_max, lambda old, d, hit: tf.where(hit, d, old)),
}


@register(*_SCATTER_COMBINE)
class ResourceScatter(FactorRule):
  """var[ids] op= updates: the variable's other dims pass their split to the updates; ids are replicated.

  A variable split along its first dim takes on each device only the updates of its own rows (masked, summed
  per row into a dense local delta); nothing is communicated.
  """

  priority = 0

  def factors(self, node):
    labels = _value_labels(node)
    ids = tuple(f"i{k}" for k in range(len(node.input_shape(1))))
    return Factors((labels, ids, ids + labels[1:]), ())

  def partition(self, ctx, node):
    layout = _handle_sharding(ctx, node)
    k = len(node.input_shape(1))
    handle = ctx.operand(0, None)
    ids = ctx.operand(1, Sharding(ctx.mesh))
    updates = ctx.operand(2, Sharding(ctx.mesh, ((),) * k + layout.dims[1:]))
    if not layout.dims or not layout.dims[0]:
      ctx.clone(node, {0: handle, 1: ids, 2: updates})
      return
    size = node.input_info(0).value_shape[0]
    c = -(-size // layout.tiles(0))
    lo = np.array([layout.tile_index(p, 0) * c for p in range(ctx.mesh.size)], ids.dtype.as_numpy_dtype)
    segment, combine = _SCATTER_COMBINE[node.op]
    dtype = node.attr("dtype")
    with ctx.helper_scope(), ctx.after_control_inputs():
      local = tf.reshape(ids, [-1]) - ctx.lookup(lo, f"row_offset_{c}")
      local = tf.where((local >= 0) & (local < c), local, -tf.ones_like(local))
      flat = tf.reshape(updates, [-1] + updates.shape.as_list()[k:])
      delta = segment(flat, local, c)
      hit = tf.math.unsorted_segment_max(tf.ones_like(local), local, c) > 0
      hit = tf.reshape(hit, [c] + [1] * (flat.shape.rank - 1))
      old = tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
      new = tf.where(hit, combine(old, delta, hit), old)
    ctx.record(tf.raw_ops.AssignVariableOp(resource=handle, value=new, name=node.name))
