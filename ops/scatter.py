"""Scatters and GatherNd.

ScatterNd sums updates into a zero tensor: the update rows are summed factors (partial sums + one
all-reduce when split), the indexed output dims are whole, trailing dims pass. TensorScatter* start from
an existing tensor, so their update rows are whole on every device.
"""

from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.registry import register


@register("ScatterNd")
class ScatterNd(FactorRule):
  """scatter_nd(indices[r..., K], updates[r..., rest], shape): r summed, rest pass."""

  def data_inputs(self, node):
    return [0, 1]

  def factors(self, node):
    idx = node.input_shape(0)
    k = idx[-1]
    r = tuple(f"r{i}" for i in range(len(idx) - 1))
    rest = tuple(f"d{i}" for i in range(k, len(node.outputs[0].shape)))
    return Factors((r + (None,), r + rest), ((None,) * k + rest,))

  def emit(self, ctx, node, local_inputs, axes_of):
    shape = self.local_shape_input(ctx, node, axes_of, 2)
    return ctx.clone(node, {0: local_inputs[0], 1: local_inputs[1], 2: shape})


@register("TensorScatterUpdate", "TensorScatterAdd", "TensorScatterSub", "TensorScatterMax", "TensorScatterMin")
class TensorScatter(FactorRule):
  """tensor with rows replaced/combined: indexed dims and update rows whole, trailing dims pass."""

  def factors(self, node):
    idx = node.input_shape(1)
    k = idx[-1]
    rank = len(node.outputs[0].shape)
    rest = tuple(f"d{i}" for i in range(k, rank))
    t = (None,) * k + rest
    return Factors((t, (None,) * len(idx), (None,) * (len(idx) - 1) + rest), (t,))


@register("GatherNd")
class GatherNd(FactorRule):
  """params[indices[..., :K]]: indexed params dims whole, trailing params dims and index batch dims pass."""

  def factors(self, node):
    p_rank = len(node.input_shape(0))
    idx = node.input_shape(1)
    k = idx[-1]
    batch = tuple(f"i{d}" for d in range(len(idx) - 1))
    rest = tuple(f"p{d}" for d in range(k, p_rank))
    return Factors(((None,) * k + rest, batch + (None,)), (batch + rest,))
