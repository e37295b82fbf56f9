"""Ops whose output does not depend on operand values: Fill, Range, the Shape family.

Fill is produced directly at its local shard shape (any split is free). Range is produced whole and sliced.
Shape, Size, Rank and ShapeN describe the *global* tensor: they become constants, never local shapes.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd._sharding import Sharding
from tf_gspmd.ops.registry import Rule, register


@register("Fill")
class Fill(Rule):
  """fill(dims, value): every device fills its own shard."""

  priority = 0

  def partition(self, ctx, node):
    target = ctx.target(0)
    local = target.shard_shape(node.outputs[0].shape)
    (y,) = ctx.clone(node, {0: tf.constant(local, node.input_info(0).dtype)})
    ctx.set_output(0, y, target)


@register("Range")
class Range(Rule):
  """A whole range on every device, sliced if its users want it split (no communication)."""

  priority = 0

  def partition(self, ctx, node):
    (y,) = ctx.clone(node, {})
    ctx.set_output(0, y, Sharding(ctx.mesh))


@register("Shape", "ShapeN", "Size", "Rank")
class ShapeOf(Rule):
  """Global shape facts as constants (a local Shape would see the shard shape)."""

  priority = 0

  data = ()   # no input carries data

  def partition(self, ctx, node):
    for o, out in enumerate(node.outputs):
      shape = node.input_shape(o)
      value = {"Size": int(np.prod(shape)), "Rank": len(shape)}.get(node.op, list(shape))
      with ctx.helper_scope():
        ctx.set_output(o, tf.constant(value, out.dtype), Sharding(ctx.mesh))
