"""The correct fallback for ops without a rule (XLA's DefaultAction): replicate, run whole, reshard.

Every use is reported by the partitioner and warned about once per op type; `strict=True` forbids it. The ops whose
meaning is the whole value (`Whole`) run so by their own rule: no warning, and `strict=True` allows them.
"""

import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.errors import UnsupportedOpError
from tf_gspmd.ops.registry import Rule, register


class Fallback(Rule):
  """Operands gathered to every device, the op run on full values, results treated as replicated."""

  name = "Fallback"
  priority = 3
  rank_free = True

  def partition(self, ctx, node):
    mesh = ctx.mesh
    for i in range(len(node.inputs)):
      layout = ctx.current(i)
      if node.input_info(i).dtype == tf.resource and layout is not None and not layout.is_replicated:
        raise UnsupportedOpError(
            f"op type {node.op} has no partitioning rule and writes or reads variable input {i} "
            f"({node.inputs[i]}), which is stored split as {layout}; a replicated fallback cannot run on a shard. "
            "Annotate that variable replicated (gs.replicate) or use ops with rules", node=node.name, op_type=node.op)
      if node.input_info(i).is_list and layout is not None and not layout.is_replicated:
        raise UnsupportedOpError(
            f"op type {node.op} has no partitioning rule and reads TensorList input {i} ({node.inputs[i]}), whose "
            f"elements are split as {layout}; a replicated fallback cannot run on them. Annotate the tensors put "
            "into the list replicated (gs.replicate) or use list ops with rules", node=node.name, op_type=node.op)
    inputs = {i: ctx.operand(i, Sharding(mesh)) for i in range(len(node.inputs))}
    outs = ctx.clone(node, inputs)
    for o, value in enumerate(outs):
      if node.outputs[o].partitionable:   # the whole value (TF may not know it from operands of unknown rank)
        value.set_shape(node.outputs[o].shape)
      ctx.set_output(o, value, Sharding(mesh))


FALLBACK = Fallback()


@register("Assert", "PrintV2", "StringFormat", "BroadcastGradientArgs")
class Whole(Fallback):
  """Ops whose meaning is the whole value, run whole on every device by design. An Assert and a print show their
  data as TF shows it, the global values; the data is gathered where the op runs, which for tf.debugging's checks is
  the branch of their guard that runs only when the check fails (the condition itself is computed as any tensor:
  an All over a split dim all-reduces one boolean). BroadcastGradientArgs reads two shape vectors, replicated by
  nature."""
