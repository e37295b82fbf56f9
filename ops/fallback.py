"""The correct fallback for ops without a rule (XLA's DefaultAction): replicate, run whole, reshard.

Every use is reported by the partitioner and warned about once per op type; `strict=True` forbids it.
"""

from tf_gspmd._sharding import Sharding
from tf_gspmd.ops.registry import Rule


class Fallback(Rule):
  """Operands gathered to every device, the op run on full values, results treated as replicated."""

  name = "Fallback"
  priority = 3

  def partition(self, ctx, node):
    mesh = ctx.mesh
    inputs = {i: ctx.operand(i, Sharding(mesh)) for i in range(len(node.inputs))}
    outs = ctx.clone(node, inputs)
    for o, value in enumerate(outs):
      ctx.set_output(o, value, Sharding(mesh))


FALLBACK = Fallback()
