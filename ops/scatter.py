"""Scatters and the gradient of a strided slice.

ScatterNd sums updates into a zero tensor: the update rows are summed factors (partial sums + one
all-reduce when split), the indexed output dims are whole, trailing dims pass. TensorScatter* start from
an existing tensor, so their update rows are whole on every device. StridedSliceGrad is the transpose of a
plain strided slice: dims read whole pass their split.
"""

import numpy as np

from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.indexing import StridedSlice
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


@register("StridedSliceGrad")
class StridedSliceGrad(FactorRule):
  """d_input of a plain strided slice: dims read whole pass their split; others are whole."""

  def data_inputs(self, node):
    return [4]

  def factors(self, node):
    shape = [int(s) for s in np.asarray(node.const_input(0)).reshape(-1)] if node.const_input(0) is not None else None
    rank = len(node.outputs[0].shape)
    if shape is None or any(node.const_input(i) is None for i in (1, 2, 3)) or node.attr("new_axis_mask") or \
        node.attr("ellipsis_mask"):
      return Factors(((None,) * len(node.input_shape(4)),), ((None,) * rank,))
    full = StridedSlice.full_dims(shape, *(np.asarray(node.const_input(i)).reshape(-1) for i in (1, 2, 3)),
                                  node.attr("begin_mask"), node.attr("end_mask"), node.attr("shrink_axis_mask"))
    out = tuple(f"d{d}" if d in full else None for d in range(rank))
    sm = node.attr("shrink_axis_mask")
    return Factors((tuple(l for d, l in enumerate(out) if not sm >> d & 1),), (out,))

  def emit(self, ctx, node, local_inputs, axes_of):
    return ctx.clone(node, {0: self.local_shape_input(ctx, node, axes_of, 0), 4: local_inputs[0]})


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
