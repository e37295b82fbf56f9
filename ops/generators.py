"""Ops whose output does not depend on operand values: Fill, Empty, Range, the Shape family.

Fill and Empty are produced directly at its local shard shape (any split is free); so is a split Range, each device computing
its own piece from its offset. Replicated, a Range is produced whole.
Shape, Size, Rank and ShapeN describe the *global* tensor: they become constants, never local shapes.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.registry import Rule, register


@register("Fill", "Empty")
class Fill(Rule):
  """fill(dims, value), empty(shape) (uninitialised, or zeros with init=True): every device makes its own
  shard, the shape input being the shard's shape."""

  priority = 0

  def partition(self, ctx, node):
    target = ctx.target(0)
    local = target.shard_shape(node.outputs[0].shape)
    (y,) = ctx.clone(node, {0: tf.constant(local, node.input_info(0).dtype)})
    ctx.set_output(0, y, target)


@register("Range")
class Range(Rule):
  """range(start, limit, delta): replicated, the whole range on every device. Split, each device computes its own
  piece, start + (offset + i) * delta for i < ceil(n / tiles) (the values TF's kernel gives, start + i * delta),
  the padding past the end of an uneven split set to 0 (what slicing the whole range gives)."""

  priority = 0

  def partition(self, ctx, node):
    target = ctx.target(0)
    if target.is_maximal or not node.outputs[0].partitionable or target.tiles(0) == 1:
      (y,) = ctx.clone(node, {})
      ctx.set_output(0, y, Sharding(ctx.mesh))
      return
    (n,) = node.outputs[0].shape
    c = -(-n // target.tiles(0))
    dtype = node.outputs[0].dtype
    start, delta = (ctx.operand(i, Sharding(ctx.mesh)) for i in (0, 2))
    index = tf.int64 if n >= 2**31 else tf.int32
    offsets = np.array([target.tile_index(p, 0) * c for p in range(ctx.mesh.size)], index.as_numpy_dtype)
    with ctx.helper_scope():
      first = ctx.lookup(offsets, f"range_offset_{c}")
      steps = tf.cast(tf.range(c, dtype=index) + first, dtype)
    with ctx.after_control_inputs():
      y = tf.add(start, steps * delta, name=node.name)
    ctx.record(y)
    if c * target.tiles(0) != n:
      y = ctx.mask(y, (n,), target, 0, 0)
    ctx.set_output(0, y, target)


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
