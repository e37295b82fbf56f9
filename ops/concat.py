"""Joining and splitting along one dim: ConcatV2, Pack (stack), Unpack (unstack), Split, SplitV.

The dim an op joins or splits along carries no factor: it is whole on every device, so the op runs
unchanged on the local shards while every other dim passes its split through. A concatenation whose result
is split along the concat dim instead assembles each device's window from its neighbours (halo exchange).
Split pieces of an operand split along the split dim are narrowings of it: only the pieces read move.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd.ops.factors import const_axis, dim_labels, Factors, FactorRule, unsplit
from tf_gspmd.ops.registry import register
from tf_gspmd.ops.slicing import narrow, Pick, Selection


class AlongAxis(FactorRule):
  """Base: data inputs share labels except `fixed_dims` (whole on every device)."""

  priority = 1

  def fixed_dims(self, node):
    raise NotImplementedError

  def factors(self, node):
    rank = len(node.outputs[0].shape)
    labels = unsplit(dim_labels(rank), self.fixed_dims(node))
    return Factors(tuple(labels for _ in self.data_inputs(node)), tuple(labels for _ in node.outputs))


@register("ConcatV2")
class Concat(AlongAxis):
  """Concatenation. Split along the concat dim, each device assembles its window of the result from the
  operands' rows it owns and its neighbours' (each row selected from the operand it comes from); otherwise the
  concat dim is whole."""

  priority = 0

  def data_inputs(self, node):
    return list(range(len(node.inputs) - 1))

  def fixed_dims(self, node):
    return {const_axis(node, len(node.inputs) - 1, len(node.outputs[0].shape))}

  def factors(self, node, windowed=True):
    rank = len(node.outputs[0].shape)
    labels = dim_labels(rank) if windowed and None not in self.fixed_dims(node) else \
        unsplit(dim_labels(rank), self.fixed_dims(node))
    return Factors(tuple(labels for _ in self.data_inputs(node)), (labels,))

  def partition(self, ctx, node):
    target = ctx.target(0)
    (axis,) = self.fixed_dims(node)
    dtype = node.outputs[0].dtype
    if axis is None or target.is_maximal or not target.dims[axis] or not (dtype.is_floating or dtype.is_integer):
      return self.partition_with(ctx, node, self.factors(node, windowed=False))
    total = node.outputs[0].shape[axis]
    offsets = np.cumsum([0] + [node.input_shape(i)[axis] for i in self.data_inputs(node)])
    if not all(ctx.window_fits(i, target, axis, total, -int(o)) for i, o in zip(self.data_inputs(node), offsets)):
      return self.partition_with(ctx, node, self.factors(node, windowed=False))
    windows = [ctx.window(i, target, axis, total, -int(o), 0) for i, o in zip(self.data_inputs(node), offsets)]
    out = windows[-1]
    if len(windows) > 1:   # selects, not a sum of zero-filled windows (which would turn -0.0 into 0.0)
      c = target.shard_shape(node.outputs[0].shape)[axis]
      rows = np.array([[target.tile_index(p, axis) * c + k for k in range(c)] for p in range(ctx.mesh.size)])
      owner = np.searchsorted(offsets, rows, side="right").astype(np.int32) - 1
      with ctx.helper_scope():
        owner = tf.reshape(ctx.lookup(owner, f"concat_owner_{axis}_{c}"),
                           [c if d == axis else 1 for d in range(len(node.outputs[0].shape))])
        for k in range(len(windows) - 2, -1, -1):
          out = tf.where(tf.equal(owner, k), windows[k], out)
    ctx.set_output(0, ctx.identity(out), target)


@register("Pack")
class Pack(FactorRule):
  """stack: a new, unsplit dim at `axis`."""

  priority = 0

  def factors(self, node):
    rank = len(node.input_shape(0))
    axis = node.attr("axis") % (rank + 1)
    labels = dim_labels(rank)
    return Factors(tuple(labels for _ in node.inputs), (labels[:axis] + (None,) + labels[axis:],))


@register("Unpack")
class Unpack(FactorRule):
  """unstack: the unpacked dim is whole on every device."""

  priority = 0

  def factors(self, node):
    rank = len(node.input_shape(0))
    axis = node.attr("axis") % rank
    labels = dim_labels(rank)
    out = labels[:axis] + labels[axis + 1:]
    return Factors((unsplit(labels, {axis}),), tuple(out for _ in node.outputs))


class _SplitAlong(AlongAxis):
  """Split, SplitV: the split dim is whole in the pieces. An operand already split along it is not gathered:
  each piece is a narrowing of it (`slicing.narrow`), so only the pieces that are read move."""

  priority = 0

  def partition(self, ctx, node):
    (i,) = self.data_inputs(node)
    (axis,) = self.fixed_dims(node)
    cur = ctx.current(i)
    shape = node.input_shape(i)
    if axis is None or cur is None or cur.is_maximal or not node.input_info(i).partitionable or \
        not cur.with_rank(len(shape)).dims[axis]:
      return super().partition(ctx, node)
    sizes = [o.shape[axis] for o in node.outputs]
    starts = np.cumsum([0] + sizes[:-1])
    everything = tuple(range(len(shape)))
    narrow(ctx, node, i, [Selection({axis: Pick(n, int(b))} if n != shape[axis] else {}, everything)
                          for n, b in zip(sizes, starts)])


@register("Split")
class Split(_SplitAlong):

  def data_inputs(self, node):
    return [1]

  def fixed_dims(self, node):
    return {const_axis(node, 0, len(node.outputs[0].shape))}


@register("SplitV")
class SplitV(_SplitAlong):

  def data_inputs(self, node):
    return [0]

  def fixed_dims(self, node):
    return {const_axis(node, 2, len(node.outputs[0].shape))}
