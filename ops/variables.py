"""Variables: a handle carries the layout of its variable's value; every device holds one shard.

Reads produce the local shard in the variable's layout; writes reshard the new value to that layout
first (a variable is never resharded in place). Gathers from and scatters into a variable (ResourceGather,
ResourceScatter*) are in `gather` and `scatter`, with the other lookups and scatters.
"""

import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.registry import Rule, register


def value_labels(node, i=0):
  """One factor label per dim of the value of the variable that input i is the handle of."""
  return tuple(f"d{k}" for k in range(len(node.input_info(i).value_shape or ())))


def handle_sharding(ctx, node):
  """The layout of the variable behind input 0 (replicated when it has none, or a maximal one)."""
  s = ctx.current(0)
  rank = len(node.input_info(0).value_shape or ())
  return Sharding(ctx.mesh, ((),) * rank) if s is None else s.tiled(rank)


@register("VarHandleOp")
class VarHandle(Rule):
  """A variable created inside the function: each device creates its own shard (shape attr = shard shape)."""

  priority = 0

  def partition(self, ctx, node):
    layout = ctx.target(0)
    if node.outputs[0].value_shape is None:   # a variable of unknown shape is whole on every device
      (handle,) = ctx.clone(node, {})
    else:
      local = layout.shard_shape(node.outputs[0].value_shape)
      shape = tf.compat.v1.AttrValue(shape=tf.TensorShape(local).as_proto())
      (handle,) = ctx.clone(node, {}, attrs={"shape": shape})
    ctx.set_output(0, handle, layout)


@register("ReadVariableOp")
class ReadVariable(FactorRule):
  """value = read(handle): the value is laid out like the variable."""

  priority = 0

  def factors(self, node):
    labels = value_labels(node)
    return Factors((labels,), (labels,))

  def partition(self, ctx, node):
    (value,) = ctx.clone(node, {0: ctx.operand(0, None)})
    ctx.set_output(0, value, handle_sharding(ctx, node))


@register("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
class AssignVariable(FactorRule):
  """write(handle, value): the value is resharded to the variable's layout, then written locally."""

  priority = 0

  def factors(self, node):
    labels = value_labels(node)
    return Factors((labels, labels), ())

  def partition(self, ctx, node):
    value = ctx.operand(1, handle_sharding(ctx, node))
    ctx.clone(node, {0: ctx.operand(0, None), 1: value})


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
    names = [a.name for a in _compat.op_def(node.op).input_arg]
    return names.index("grad") if "grad" in names else names.index("delta")

  def factors(self, node):
    labels = value_labels(node)
    g = self._grad_index(node)
    per_input = []
    for i in range(len(node.inputs)):
      info = node.input_info(i)
      per_input.append(labels if (i == g or info.value_shape is not None) else (None,) * len(info.shape or ()))
    return Factors(tuple(per_input), ())

  def partition(self, ctx, node):
    layout = handle_sharding(ctx, node)
    g = self._grad_index(node)
    inputs = {i: ctx.operand(i, layout if i == g else Sharding(ctx.mesh)) for i in range(len(node.inputs))}
    ctx.clone(node, inputs)
