"""Joining and splitting along one dim: ConcatV2, Pack (stack), Unpack (unstack), Split, SplitV, Roll
(a rotation: the concatenation of a dim's two ends swapped) and ReverseV2 (a dim read backwards).

The dim an op joins or splits along carries no factor: it is whole on every device, so the op runs
unchanged on the local shards while every other dim passes its split through. A concatenation whose result
is split along the concat dim instead assembles each device's window from its neighbours (halo exchange).
Split pieces of an operand split along the split dim are narrowings of it: only the pieces read move.
A rotation along an evenly split dim moves whole shards between devices: each device's result shard is made of
at most two other devices' shards (exactly one when the shift is a multiple of the shard size, as a pipeline's
stage shift is), so it is one or two exact collective-permutes, never a gather. A reversal along a split dim
swaps mirrored shards (shard t and shard n-1-t), one collective-permute; an uneven split then rotates the
padding back to the end like a Roll.
"""

import math

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

  stacked = "concat"

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

  stacked = "pack"

  priority = 0

  def factors(self, node):
    rank = len(node.input_shape(0))
    axis = node.attr("axis") % (rank + 1)
    labels = dim_labels(rank)
    return Factors(tuple(labels for _ in node.inputs), (labels[:axis] + (None,) + labels[axis:],))


@register("Unpack")
class Unpack(FactorRule):
  """unstack: the unpacked dim is whole on every device."""

  stacked = "unpack"

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
  stacked = "split"

  data = (1,)

  def fixed_dims(self, node):
    return {const_axis(node, 0, len(node.outputs[0].shape))}


@register("SplitV")
class SplitV(_SplitAlong):
  stacked = "split_v"

  data = (0,)

  def fixed_dims(self, node):
    return {const_axis(node, 2, len(node.outputs[0].shape))}


@register("Roll")
class Roll(FactorRule):
  """tf.roll: every dim keeps its split. A rolled dim split evenly over mesh axes rotates by collective-permutes
  of whole shards (the GSPMD pipeline's stage shift: with one row per device and shift 1, each device sends its
  shard to the next one along the axes, the last to the first, and nothing else moves). Rolled dims that are
  whole roll locally; a rotation read at run time, or along an unevenly split dim, rolls whole dims."""

  priority = 0

  data = (0,)

  def shifts(self, node):
    """{dim: shift in [0, size)} (repeated axes add up, as in tf.roll), or None when not constant."""
    shift, axis = node.const_input(1), node.const_input(2)
    if shift is None or axis is None:
      return None
    shape = node.input_shape(0)
    out = {}
    for s, a in zip(np.broadcast_to(np.asarray(shift).reshape(-1), np.asarray(axis).reshape(-1).shape),
                    np.asarray(axis).reshape(-1)):
      d = int(a) % len(shape)
      out[d] = (out.get(d, 0) + int(s)) % max(shape[d], 1)
    return out

  def factors(self, node, rotatable=True):
    rank = len(node.input_shape(0))
    shifts = self.shifts(node)
    if rotatable:
      labels = dim_labels(rank)
    else:
      labels = unsplit(dim_labels(rank), set(range(rank)) if shifts is None else set(shifts))
    return Factors((labels,), (labels,))

  def partition(self, ctx, node):
    target = ctx.target(0)
    shape = node.input_shape(0)
    shifts = self.shifts(node)
    if target.is_maximal or shifts is None:
      return self.partition_with(ctx, node, self.factors(node, rotatable=False))
    target = target.with_rank(len(shape))
    split = {d: s for d, s in shifts.items() if target.dims[d] and s}
    if any(shape[d] % target.tiles(d) for d in split):
      return self.partition_with(ctx, node, self.factors(node, rotatable=False))
    x = ctx.operand(0, target)
    local = {d: s for d, s in shifts.items() if not target.dims[d] and s}
    with ctx.helper_scope():
      if local:
        x = tf.roll(x, list(local.values()), list(local))
      for d, s in split.items():
        x = _rotate_shards(ctx, node, x, d, s, shape[d] // target.tiles(d), target.dims[d])
    ctx.set_output(0, ctx.identity(x), target)


def _rotate_shards(ctx, node, x, dim, shift, c, axes):
  """Local shards (`c` rows of `dim`, split over `axes`) of the rotation by `shift` rows of the whole dim.

  With shift = q*c + r, shard t of the result is the last r rows of shard t-q-1 followed by the first c-r rows
  of shard t-q (cyclically): one collective-permute of whole shards when r = 0, else two, each moving only the
  rows it serves; a permute by a multiple of the group size is local."""
  q, r = divmod(shift, c)
  reason = f"{node.name} ({node.op}) rotates dim {dim} by {shift} row(s) over {','.join(axes)}"
  tiles = math.prod(ctx.mesh.axis_size(a) for a in axes)

  def moved(part, by, what):
    if by % tiles == 0:
      return part
    return ctx.backend.collective_permute(part, axes, shift=by % tiles, cyclic=True, source=node.name,
                                          reason=f"{reason} ({what})")

  if not r:
    return moved(x, q, f"each shard to the one {q} further")
  rank = x.shape.rank
  begin = [0] * rank
  head = [-1] * rank
  head[dim] = c - r
  tail_begin = list(begin)
  tail_begin[dim] = c - r
  tail = moved(tf.slice(x, tail_begin, [-1] * rank), q + 1, f"last {r} row(s) of each shard")
  front = moved(tf.slice(x, begin, head), q, f"first {c - r} row(s) of each shard")
  return tf.concat([tail, front], axis=dim)


@register("ReverseV2")
class Reverse(FactorRule):
  """tf.reverse: every dim keeps its split. A reversed dim that is whole reverses locally; a reversed dim split
  over mesh axes reverses each shard locally and swaps mirrored shards (device t takes shard n-1-t): one
  collective-permute of whole shards. With an uneven split the mirrored shards hold the padding first, so the
  result is then rotated by the padding's length (`_rotate_shards`, at most two more permutes of some rows).
  Reversed dims read at run time stay whole."""

  priority = 0

  data = (0,)

  def reversed_dims(self, node):
    """The dims reversed (a set), or None when the axes are not constant."""
    axis = node.const_input(1)
    if axis is None:
      return None
    rank = len(node.input_shape(0))
    return {int(a) % rank for a in np.asarray(axis).reshape(-1)}

  def factors(self, node):
    labels = dim_labels(len(node.input_shape(0)))
    if self.reversed_dims(node) is None:
      labels = unsplit(labels, set(range(len(labels))))
    return Factors((labels,), (labels,))

  def partition(self, ctx, node):
    dims = self.reversed_dims(node)
    target = ctx.target(0)
    if dims is None or target.is_maximal:
      return super().partition(ctx, node)
    shape = node.input_shape(0)
    target = target.with_rank(len(shape))
    x = ctx.operand(0, target)
    with ctx.helper_scope():
      if dims:
        x = tf.reverse(x, sorted(dims))
      for d in sorted(dims):
        axes = target.dims[d]
        if not axes:
          continue
        n = target.tiles(d)
        c = -(-shape[d] // n)
        x = ctx.backend.collective_permute(x, axes, pairs=[(t, n - 1 - t) for t in range(n)], source=node.name,
                                           reason=f"{node.name} (ReverseV2) reverses dim {d}, split over "
                                                  f"{','.join(axes)}: each shard to its mirror")
        pad = n * c - shape[d]
        if pad:   # the mirrored padded dim starts with the padding: rotate it back to the end
          x = _rotate_shards(ctx, node, x, d, n * c - pad, c, axes)
    ctx.set_output(0, ctx.identity(x), target)
