"""Ops that move, regroup or repeat dimensions: Transpose, ExpandDims, Squeeze, Bitcast, Reshape, Tile,
BroadcastTo.

Transpose/ExpandDims/Squeeze are pure dimension mappings; Tile and BroadcastTo keep repeated dims whole
and produce broadcast dims locally at their shard size. Reshape is GSPMD's group rule: input and output
dims are cut into minimal groups of equal size; a 1:1 group passes its split; a split or merge group keeps
the split on the major dim when its size divides by the number of shards (so the local reshape of the
shards is exact); any other group is replicated before the reshape and re-split after (local slices). Partitioning
picks the input layout by cost: the one the completed output maps back to, the whole value, or the operand's
own layout with one dim's split moved onto another dim (one all-to-all), whichever sends the fewest bytes per
device in all (the operand's reshard plus the result's).
"""

import math

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.factors import dim_labels, Factors, FactorRule, unsplit
from tf_gspmd.ops.registry import Rule, register


@register("Transpose")
class Transpose(FactorRule):
  """out[i] = in[perm[i]]: the split of each dim moves with it."""

  stacked = "transpose"
  linear = (0,)   # (a rearrangement of the elements)

  priority = 0

  data = (0,)

  def factors(self, node):
    rank = len(node.input_shape(0))
    perm = node.const_input(1)
    labels = dim_labels(rank)
    if perm is None:
      return Factors(((None,) * rank,), ((None,) * rank,))
    return Factors((labels,), (tuple(labels[int(p)] for p in np.atleast_1d(perm)),))


@register("ExpandDims")
class ExpandDims(FactorRule):
  """A new size-1 dim: never split; the others keep theirs."""

  stacked = "expand_dims"
  linear = (0,)   # (a rearrangement of the elements)

  priority = 0

  data = (0,)

  def factors(self, node):
    labels = dim_labels(len(node.input_shape(0)))
    out_rank = len(node.outputs[0].shape)
    axis = int(np.asarray(node.const_input(1)).reshape(-1)[0]) % out_rank
    return Factors((labels,), (labels[:axis] + (None,) + labels[axis:],))


@register("Squeeze")
class Squeeze(FactorRule):
  """Removed size-1 dims carry no split; the others keep theirs."""

  stacked = "squeeze"
  linear = (0,)   # (a rearrangement of the elements)

  priority = 0

  def _dims(self, node):
    shape = node.input_shape(0)
    dims = [int(d) % len(shape) for d in node.attr("squeeze_dims").i] if node.attr("squeeze_dims") else []
    return dims or [i for i, s in enumerate(shape) if s == 1]

  def factors(self, node):
    dims = self._dims(node)
    ins = tuple(None if i in dims else f"d{i}" for i in range(len(node.input_shape(0))))
    return Factors((ins,), (tuple(l for l in ins if l),))

  def emit(self, ctx, node, local_inputs, axes_of):
    # Name the squeezed dims: without them the local op would also drop dims whose *shard* has size 1.
    dims = tf.compat.v1.AttrValue(list=tf.compat.v1.AttrValue.ListValue(i=self._dims(node)))
    return ctx.clone(node, {0: local_inputs[0]}, attrs={"squeeze_dims": dims})


def reshape_groups(src, dst):
  """Minimal aligned groups [(input dims, output dims)] with equal element counts, in order."""
  groups, i, j = [], 0, 0
  while i < len(src) or j < len(dst):
    gi, gj, a, b = [], [], 1, 1
    if i < len(src):
      a, i = a * src[i], i + 1
      gi.append(i - 1)
    if j < len(dst):
      b, j = b * dst[j], j + 1
      gj.append(j - 1)
    while a != b and (i < len(src) or j < len(dst)):
      if (a < b and i < len(src)) or j == len(dst):
        a, i = a * src[i], i + 1
        gi.append(i - 1)
      else:
        b, j = b * dst[j], j + 1
        gj.append(j - 1)
    groups.append((gi, gj))
  return groups


def _map_group(mesh, src, dst, gi, gj, axes):
  """Axes of one group's major output dim given the major input dim's axes (None when not exact)."""
  if not axes:
    return ()
  tiles = math.prod(mesh.axis_size(a) for a in axes)
  major_in = [d for d in gi if src[d] != 1]
  major_out = [d for d in gj if dst[d] != 1]
  if not major_in or not major_out:
    return None
  if len(major_in) == 1 and len(major_out) == 1:
    return axes
  if dst[major_out[0]] % tiles == 0 and src[major_in[0]] % tiles == 0:
    return axes
  return None


@register("Bitcast")
class Bitcast(FactorRule):
  """Reinterpret the element type: dims pass through, except a last dim that a size change adds or removes."""

  priority = 0

  data = (0,)

  def factors(self, node):
    in_rank, out_rank = len(node.input_shape(0)), len(node.outputs[0].shape)
    common = min(in_rank, out_rank)   # equal ranks: equal element sizes, every dim passes
    shared = tuple(f"d{i}" for i in range(common))
    return Factors((shared + (None,) * (in_rank - common),), (shared + (None,) * (out_rank - common),))


@register("Reshape")
class Reshape(Rule):
  """Reshape by groups of dims (split/merge keeps the split on the major dim when exact)."""

  stacked = "reshape"
  linear = (0,)   # (a rearrangement of the elements)

  priority = 0

  data = (0,)

  def _convert(self, node, sharding, forward):
    src, dst = node.input_shape(0), node.outputs[0].shape
    if not forward:
      src, dst = dst, src
    s = sharding.with_rank(len(src))
    out = [()] * len(dst)
    for gi, gj in reshape_groups(src, dst):
      major_in = [d for d in gi if src[d] != 1]
      lead = major_in[0] if major_in else None
      if any(s.dims[d] for d in gi if d != lead):
        continue  # a minor dim of the group is split: not expressible after the reshape
      mapped = _map_group(s.mesh, src, dst, gi, gj, s.dims[lead] if lead is not None else ())
      if mapped:
        major_out = [d for d in gj if dst[d] != 1]
        out[major_out[0]] = mapped
    return Sharding(s.mesh, tuple(out))

  def forward(self, ctx, node, operands):
    s = operands[0]
    if s is None or s.is_maximal:
      return [[]]
    return [[self._convert(node, s, True)]]

  def backward(self, ctx, node, outputs, operands):
    s = outputs[0]
    if s is None or s.is_maximal:
      return [[], []]
    return [[self._convert(node, s, False)], []]

  def _exact(self, node, need):
    """The layout the local reshape of `need`'s shards produces, or None when that reshape is not exact (a split
    the reshape cannot carry, or shards whose element counts differ)."""
    natural = self._convert(node, need, True)
    used = lambda s: sorted(a for dims in s.dims for a in dims)
    if used(need) != used(natural):
      return None
    if math.prod(need.shard_shape(node.input_shape(0))) != math.prod(natural.shard_shape(node.outputs[0].shape)):
      return None
    return natural

  def _candidates(self, ctx, node, target):
    """Input layouts to reshape from: the target's own (splits the group rule maps back), whole, and the
    operand's current layout with one dim's split moved onto another dim (one all-to-all where it moves)."""
    rank = len(node.input_shape(0))
    yield self._convert(node, target, False)
    yield Sharding(ctx.mesh, ((),) * rank)
    cur = ctx.current(0)
    if cur is None or cur.is_maximal:
      return
    cur = cur.with_rank(rank)
    yield cur
    for d in range(rank):
      if not cur.dims[d]:
        continue
      for e in range(rank):
        if e != d:
          dims = list(cur.dims)
          dims[e], dims[d] = dims[e] + dims[d], ()
          yield Sharding(ctx.mesh, tuple(dims))

  def partition(self, ctx, node):
    """Reshape the shards locally from the input layout that costs the fewest bytes per device in all: bringing
    the operand to it, plus bringing the local reshape's result to the completed layout. Splits that move across
    shard boundaries go by all-to-all where that is cheaper than gathering them."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    target = ctx.target(0)
    best = None
    for need in self._candidates(ctx, node, target):
      natural = self._exact(node, need)
      if natural is None:
        continue
      cost = ctx.operand_cost(0, need) + ctx.output_cost(0, natural)
      if best is None or cost < best[0]:
        best = (cost, need, natural)
    _, need, natural = best
    x = ctx.operand(0, need)
    shape_dtype = node.input_info(1).dtype
    local = natural.shard_shape(node.outputs[0].shape)
    (y,) = ctx.clone(node, {0: x, 1: tf.constant(local, shape_dtype)})
    ctx.set_output(0, y, natural)


@register("Tile")
class Tile(FactorRule):
  """Repeated dims are whole locally; dims with multiple 1 pass their split."""

  stacked = "tile"

  priority = 2

  data = (0,)

  def factors(self, node):
    mult = node.const_input(1)
    rank = len(node.input_shape(0))
    tiled = set(range(rank)) if mult is None else {d for d in range(rank) if int(np.asarray(mult)[d]) != 1}
    labels = unsplit(dim_labels(rank), tiled)
    return Factors((labels,), (labels,))


@register("BroadcastTo")
class BroadcastTo(FactorRule):
  """Broadcast dims (new or size 1) are produced locally at their shard size; others pass their split."""

  stacked = "broadcast_to"

  priority = 2

  data = (0,)

  def factors(self, node):
    out = node.outputs[0].shape
    shape = node.input_shape(0)
    labels = dim_labels(len(out))
    off = len(out) - len(shape)
    ins = tuple(None if (shape[i] == 1 and out[off + i] != 1) else labels[off + i] for i in range(len(shape)))
    return Factors((ins,), (labels,))

  def emit(self, ctx, node, local_inputs, axes_of):
    # Only input-carried dims may be split here (new dims are unsplit in the natural layout).
    return ctx.clone(node, {0: local_inputs[0], 1: self.local_shape_input(ctx, node, axes_of, 1)})
