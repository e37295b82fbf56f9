"""Slices and pads, and the gradients that are their transposes: Slice, StridedSlice, StridedSliceGrad,
Pad, PadV2, MirrorPad; and `narrow`, how every op that reads part of a dim (these, Split, SplitV) partitions.

A dim read whole (or left unpadded) passes its split through. A narrowed dim is never gathered just to be
narrowed, since the result is usually much smaller than the operand (a last token, a few rows of a 512 MiB
table). `narrow` weighs, by the bytes each moves, what GSPMD does with a windowed slice:
- window: the result stays split on that dim and each device takes its window of it from its own rows and
  its neighbours' (halo exchange), when every window lies within a neighbour's reach;
- take: each device reads the selected rows it holds (a select puts zeros where it holds none) and the
  result-sized partial sums combine in one all-reduce (a reduce-scatter when the result is split), so only
  the result moves;
- gather: the narrowed dims whole on every device first (free when they already are).
Strided slices with new axes, an ellipsis, strides, shrunk dims or a start read at run time (a dynamic begin
with a static size) are narrowed alike. Completion lets a contiguous slice keep its operand's split on the
sliced dim when the result still gives every device a row; other narrowed dims take no split from it.
StridedSliceGrad, the transpose of a plain strided slice, passes the split of the dims read whole.
A constant pad, or a contiguous slice split on its picked dim, read only by windowed readers (FOLDING_READERS) is
deferred as a `windows.Shift`: the readers' windows read its operand, so the pair takes one halo exchange.
"""

import dataclasses
from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.factors import dim_labels, Factors, FactorRule, unsplit
from tf_gspmd.ops.gather import take_owned
from tf_gspmd.ops.registry import register
from tf_gspmd.ops.windows import Shift

# The readers whose windows a pad or slice before them folds into: one halo exchange for both ops (the windows
# of the pair compose: a row of the reader's window is a row of the pad's or slice's operand, or its fill).
FOLDING_READERS = frozenset({"Slice", "StridedSlice", "Pad", "PadV2", "Conv2D", "Conv2DBackpropFilter", "MaxPool",
                             "AvgPool", "MaxPoolGrad"})


@dataclasses.dataclass(frozen=True)
class Pick:
  """The rows one input dim contributes: `size` rows from `start` every `stride`, or from a start read at run
  time (`dynamic` = (input index, element) of a vector input; with `wrap` a negative start counts from the
  end, as a strided slice's index does). A `shrink` pick (one row) drops the dim from the result."""
  size: int
  start: int = 0
  stride: int = 1
  shrink: bool = False
  dynamic: Optional[Tuple[int, int]] = None
  wrap: bool = False

  @property
  def contiguous(self):
    """A constant run of rows that stays a dim of the result: the pick a window can serve."""
    return self.dynamic is None and self.stride == 1 and not self.shrink


@dataclasses.dataclass(frozen=True)
class Selection:
  """What an op reads of its operand: `picks` {input dim: Pick} (other dims whole) and the result's dims in
  order, each the input dim it comes from or None for a new size-1 axis (shrunk dims are absent)."""
  picks: Dict[int, Pick]
  out: Tuple[Optional[int], ...]

  def labels(self, rank):
    """Factor labels (operand, result): whole dims and contiguous picks pass their split; others carry none."""
    ins = tuple(f"d{d}" if d not in self.picks or self.picks[d].contiguous else None for d in range(rank))
    return ins, tuple(None if d is None else ins[d] for d in self.out)


def _strided_selection(node, shape=None):
  """The Selection of a StridedSlice (or of the slice a StridedSliceGrad transposes, of operand `shape`), or
  None (a stride read at run time, or a dynamic begin or end on a dim that is neither shrunk nor read whole)."""
  shape = node.input_shape(0) if shape is None else shape
  begin, end, strides = (node.const_input(i) for i in (1, 2, 3))
  if strides is None or shape is None:
    return None
  strides = np.asarray(strides).reshape(-1)
  begin = None if begin is None else np.asarray(begin).reshape(-1)
  end = None if end is None else np.asarray(end).reshape(-1)
  bm, em, sm = node.attr("begin_mask"), node.attr("end_mask"), node.attr("shrink_axis_mask")
  nm, elm = node.attr("new_axis_mask"), node.attr("ellipsis_mask")
  consumed = sum(1 for k in range(len(strides)) if not (nm >> k & 1 or elm >> k & 1))
  picks, out, d = {}, [], 0
  for k in range(len(strides)):
    if elm >> k & 1:
      for _ in range(len(shape) - consumed):
        out.append(d)
        d += 1
      continue
    if nm >> k & 1:
      out.append(None)
      continue
    if d >= len(shape):
      return None
    size = shape[d]
    if sm >> k & 1:
      if begin is None:
        picks[d] = Pick(1, shrink=True, dynamic=(1, k), wrap=True)
      else:
        b = int(begin[k])
        picks[d] = Pick(1, b + size if b < 0 else b, shrink=True)
    else:
      if (begin is None and not bm >> k & 1) or (end is None and not em >> k & 1):
        return None
      rows = range(size)[slice(None if bm >> k & 1 else int(begin[k]), None if em >> k & 1 else int(end[k]),
                               int(strides[k]))]
      if rows != range(size):
        picks[d] = Pick(len(rows), rows.start if len(rows) else 0, rows.step)
      out.append(d)
    d += 1
  out.extend(range(d, len(shape)))
  return Selection(picks, tuple(out))


def _slice_selection(node):
  """The Selection of a Slice (a begin read at run time, with a static size, included), or None."""
  shape, out = node.input_shape(0), node.outputs[0].shape
  begin = node.const_input(1)
  if shape is None or out is None:
    return None
  picks = {}
  for d, (s, n) in enumerate(zip(shape, out)):
    if begin is None:
      if n != s:
        picks[d] = Pick(n, dynamic=(1, d))
    elif (int(begin[d]), n) != (0, s):
      picks[d] = Pick(n, int(begin[d]))
  return Selection(picks, tuple(range(len(shape))))


def _whole(mesh, rank):
  return Sharding(mesh, ((),) * rank)


def _used(ctx, node, o):
  """Whether output o of `node` is read (unread results cost nothing: their ops are pruned)."""
  return ctx.used(node.ref(o))


def _natural(ctx, sel, layout):
  """The layout of a result computed from an operand laid out as `layout`: whole dims keep their split."""
  return Sharding(ctx.mesh, tuple(() if d is None or d in sel.picks else layout.dims[d] for d in sel.out))


def _partial(sel, layout):
  axes = tuple(a for d in sorted(sel.picks) for a in layout.dims[d])
  return (axes, "Add") if axes else None


def _rows(ctx, node, pick, size):
  """The global rows of a pick: a numpy array, or a tensor when its start is read at run time."""
  if pick.dynamic is None:
    return pick.start + pick.stride * np.arange(pick.size)
  i, k = pick.dynamic
  vec = ctx.operand(i, _whole(ctx.mesh, 1))
  with ctx.helper_scope():
    start = vec[k]
    if pick.wrap:
      start = tf.where(start < 0, start + size, start)
    return start + tf.range(pick.size, dtype=start.dtype)


def _select(ctx, node, x, shape, layout, sel, skip=()):
  """`x` (laid out as `layout`) narrowed to `sel` on the picked dims (but `skip`). Split picked dims read the
  rows this device holds (zeros elsewhere: a partial result); the others read their rows directly."""
  rank = len(shape)
  rows = {d: _rows(ctx, node, p, shape[d]) for d, p in sel.picks.items() if d not in skip}
  mask = None
  with ctx.helper_scope():
    for d in sorted(rows):
      p, idx = sel.picks[d], rows[d]
      if layout.dims[d]:
        x, owned = take_owned(ctx, x, layout, shape[d], d, idx)
        owned = tf.reshape(owned, [-1 if k == d else 1 for k in range(rank)])
        mask = owned if mask is None else mask & owned
      elif p.contiguous:
        x = tf.slice(x, [p.start if k == d else 0 for k in range(rank)], [p.size if k == d else -1 for k in
                                                                              range(rank)])
      else:
        x = tf.gather(x, idx, axis=d)
    if mask is not None:
      x = tf.where(mask, x, tf.zeros([], x.dtype))
  return x


def _window_layout(ctx, sel, target, rank):
  """(operand layout, dim) when the result is split on exactly one picked dim, a contiguous one, and no
  other picked dim: the operand laid out like the result (shrunk dims whole) can then serve it by windows."""
  if target.is_maximal:
    return None
  dims = [()] * rank
  for o, d in enumerate(sel.out):
    if target.dims[o]:
      if d is None:
        return None
      dims[d] = target.dims[o]
  split = [d for d in sel.picks if dims[d]]
  if len(split) != 1 or not sel.picks[split[0]].contiguous:
    return None
  return Sharding(ctx.mesh, tuple(dims)), split[0]


def narrow(ctx, node, i, selections):
  """Partition `node`, whose output o is input i narrowed to `selections[o]`: by windows, take or gather (see
  the module docstring), whichever moves the fewest bytes for the outputs that are read."""
  mesh = ctx.mesh
  shape = ctx.input_shape(i)
  rank = len(shape)
  cur = ctx.current(i)
  cur = _whole(mesh, rank) if cur is None or cur.is_maximal else cur.with_rank(rank)
  used = [o for o in range(len(selections)) if _used(ctx, node, o)] or list(range(len(selections)))
  targets = [ctx.target(o).with_rank(len(node.outputs[o].shape)) if not ctx.target(o).is_maximal else ctx.target(o)
             for o in range(len(selections))]
  plans = []   # (bytes, order, kind, layouts)

  windows = [_window_layout(ctx, sel, targets[o], rank) for o, sel in enumerate(selections)]
  if all(windows[o] is not None for o in used):
    costs = [ctx.window_bytes(i, w, d, selections[o].picks[d].size, selections[o].picks[d].start)
             for o, (w, d) in ((o, windows[o]) for o in used)]
    if None not in costs:
      plans.append((sum(costs), 0, "window", None))

  dtype = ctx.input_dtype(i)
  can_take = dtype.is_floating or dtype.is_integer or dtype == tf.bool
  picked = set().union(*(sel.picks for sel in selections))
  for order, take in ((1, False), (3, True)):
    if take and not (can_take and any(cur.dims[d] for d in picked)):
      continue
    for shift, whole_from in enumerate(("target", "current")):
      dims = [cur.dims[d] if take and d in picked else () for d in range(rank)]
      taken = {a for d in range(rank) for a in dims[d]}
      for d in range(rank):
        if d in picked:
          continue
        if whole_from == "current":
          ax = cur.dims[d]
        else:
          o = used[0]
          t = targets[o]
          ax = () if t.is_maximal or d not in selections[o].out else t.dims[selections[o].out.index(d)]
        if not taken & set(ax):
          dims[d] = ax
          taken.update(ax)
      layout = Sharding(mesh, tuple(dims))
      cost = ctx.operand_cost(i, layout) + sum(
          ctx.output_cost(o, _natural(ctx, selections[o], layout), _partial(selections[o], layout)) for o in used)
      plans.append((cost, order + shift, "local", layout))
  _, _, kind, layout = min(plans, key=lambda p: p[:2])

  outs, naturals, partials = [], [], []
  for o, sel in enumerate(selections):
    out_shape = node.outputs[o].shape
    if not np.prod(out_shape) or o not in used:   # an empty or unread result needs no data, no collective
      natural, partial = targets[o], None
      with ctx.helper_scope():
        x = tf.zeros(natural.shard_shape(out_shape) if not natural.is_maximal else out_shape, node.outputs[o].dtype)
    elif kind == "window":
      w, d = windows[o]
      p = sel.picks[d]
      x = ctx.window(i, w, d, p.size, p.start, 0)
      x = _select(ctx, node, x, shape, w, sel, skip=(d,))
      natural, partial = targets[o], None
    else:
      x = _select(ctx, node, ctx.operand(i, layout), shape, layout, sel)
      natural, partial = _natural(ctx, sel, layout), _partial(sel, layout)
    with ctx.helper_scope():
      outs.append(tf.reshape(x, natural.shard_shape(out_shape) if not natural.is_maximal else out_shape))
    naturals.append(natural)
    partials.append(partial)
  if len(outs) == 1:
    outs = [ctx.identity(outs[0])]
  else:
    outs = tf.identity_n(outs, name=node.name)
    ctx.record(outs[0])
  for o, (x, natural, partial) in enumerate(zip(outs, naturals, partials)):
    ctx.set_output(o, x, natural, partial=partial)


def _slice_shift(ctx, node, sel):
  """The `Shift` of a slice whose result is split on one contiguous picked dim (its rows are its operand's,
  offset by the pick's start), other picks constant runs cut locally; None for other slices."""
  shape = ctx.input_shape(0)
  rank = len(shape)
  target = ctx.target(0)
  if sel.out != tuple(range(rank)) or target.is_maximal or not all(p.contiguous for p in sel.picks.values()):
    return None
  window = _window_layout(ctx, sel, target.with_rank(rank), rank)
  if window is None:
    return None
  w, d = window
  p = sel.picks[d]
  others = sorted(k for k in sel.picks if k != d)

  def local(x):
    if not others:
      return x
    return tf.slice(x, [sel.picks[k].start if k in others else 0 for k in range(rank)],
                    [sel.picks[k].size if k in others else -1 for k in range(rank)])

  def cost():
    moved = ctx.window_bytes(0, w, d, p.size, p.start)
    return ctx.operand_cost(0, _whole(ctx.mesh, rank)) if moved is None else moved

  return Shift(node.inputs[0], d, p.start, p.start, p.start + p.size, 0, tuple(others), local, cost)


class _Narrowing(FactorRule):
  """A rule whose output is its operand narrowed to `selection(node)` (None when it cannot say: then every
  dim is whole). Partitioned by `narrow`."""

  data = (0,)

  def selection(self, node):
    raise NotImplementedError

  def factors(self, node):
    sel = self.selection(node)
    if sel is None:
      return Factors(((None,) * len(node.input_shape(0)),), ((None,) * len(node.outputs[0].shape),))
    ins, out = sel.labels(len(node.input_shape(0)))
    return Factors((ins,), (out,))

  def forward(self, ctx, node, operands):
    """A contiguous slice keeps its operand's split on the sliced dim only where every device still gets a
    row of the result (a smaller result is better left to its users than split into mostly empty shards)."""
    cands = super().forward(ctx, node, operands)
    sel = self.selection(node)
    if sel is None:
      return cands
    out_shape = node.outputs[0].shape
    small = {o for o, d in enumerate(sel.out) if d in sel.picks}
    cands[0] = [Sharding(s.mesh, tuple(() if o in small and out_shape[o] < s.tiles(o) else a
                                       for o, a in enumerate(s.dims))) for s in cands[0]]
    return cands

  def partition(self, ctx, node):
    sel = self.selection(node)
    if sel is None or not node.input_info(0).partitionable:
      return FactorRule.partition(self, ctx, node)
    shift = _slice_shift(ctx, node, sel)
    if shift is None or not ctx.defer(shift, lambda: narrow(ctx, node, 0, [sel]), FOLDING_READERS):
      narrow(ctx, node, 0, [sel])


@register("Slice")
class Slice(_Narrowing):
  """Dims sliced to less than their size are picked (a begin read at run time too); full-size dims pass."""

  stacked = "slice"

  def selection(self, node):
    return _slice_selection(node)


@register("StridedSlice")
class StridedSlice(_Narrowing):
  """Full-range dims pass their split, shrunk dims vanish, new axes (`x[..., None]`) are whole; ranges, strides
  and indices (`x[:, -1]`, also read at run time) are picked."""

  stacked = "strided_slice"

  def selection(self, node):
    return _strided_selection(node)


@register("StridedSliceGrad")
class StridedSliceGrad(FactorRule):
  """d_input of a strided slice (new axes, ellipsis and shrunk dims included): dims read whole pass their split;
  others are whole."""

  data = (4,)
  linear = (4,)   # (the gradient placed in zeros)

  def factors(self, node):
    rank = len(node.outputs[0].shape)
    shape = node.const_input(0)
    sel = _strided_selection(node, [int(s) for s in np.asarray(shape).reshape(-1)]) if shape is not None else None
    if sel is None or len(sel.out) != len(node.input_shape(4)):
      return Factors(((None,) * len(node.input_shape(4)),), ((None,) * rank,))
    # dy's dims are the slice result's: a dim read whole carries its operand dim's label, new axes and narrowed
    # dims none (the gradient scatters them into zeros, which needs them whole).
    grad = tuple(f"d{d}" if d is not None and d not in sel.picks else None for d in sel.out)
    return Factors((grad,), (tuple(f"d{d}" if d not in sel.picks else None for d in range(rank)),))

  def emit(self, ctx, node, local_inputs, axes_of):
    return ctx.clone(node, {0: self.local_shape_input(ctx, node, axes_of, 0), 4: local_inputs[0]})


@register("XlaDynamicUpdateSlice")
class DynamicUpdateSlice(FactorRule):
  """update written into operand at start indices read at run time (Keras's `ops.slice_update`, a KV cache's
  write): dims the update covers whole pass their split (their start is clamped to 0), written-into dims are
  whole on every device, so the same start is right everywhere."""

  data = (0, 1)

  def factors(self, node):
    shape, update = node.input_shape(0), node.input_shape(1)
    whole = {d for d in range(len(shape)) if shape[d] is None or update[d] != shape[d]}
    labels = unsplit(dim_labels(len(shape)), whole)
    return Factors((labels, labels), (labels,))


@register("Pad", "PadV2", "MirrorPad")
class Pad(FactorRule):
  """Unpadded dims pass their split. A padded dim may stay split too (constant padding): each device takes
  its window of the padded result, with halo rows from its neighbours (GSPMD's windowed pad)."""

  stacked = "pad"

  data = (0,)

  def _padded(self, node):
    pads = node.const_input(1)
    rank = len(node.input_shape(0))
    return set(range(rank)) if pads is None else {d for d in range(rank) if np.any(np.asarray(pads)[d] != 0)}

  def factors(self, node, windowed=None):
    rank = len(node.input_shape(0))
    if windowed is None:
      windowed = node.op != "MirrorPad" and node.const_input(1) is not None
    labels = dim_labels(rank) if windowed else unsplit(dim_labels(rank), self._padded(node))
    return Factors((labels,), (labels,))

  def partition(self, ctx, node):
    target = ctx.target(0)
    padded = self._padded(node)
    split = [d for d in padded if not target.is_maximal and target.dims[d]]
    if node.op == "MirrorPad" or len(split) != 1 or node.const_input(1) is None:
      return self.partition_with(ctx, node, self.factors(node, windowed=False))
    d = split[0]
    pads = np.asarray(node.const_input(1))
    fill = 0 if node.op == "Pad" else np.asarray(node.const_input(2)).item()
    shape = node.input_shape(0)
    rest = pads.copy()
    rest[d] = 0

    def local(x):   # the other padded dims are whole: pad them locally
      return tf.pad(x, rest, constant_values=fill) if rest.any() else x

    def emit():
      x = ctx.window(0, target, d, shape[d] + int(pads[d].sum()), -int(pads[d][0]), fill)
      if x is None:
        return self.partition_with(ctx, node, self.factors(node, windowed=False))
      ctx.set_output(0, ctx.identity(local(x)), target)

    def cost():
      moved = ctx.window_bytes(0, target, d, shape[d] + int(pads[d].sum()), -int(pads[d][0]))
      return ctx.operand_cost(0, _whole(ctx.mesh, len(shape))) if moved is None else moved

    shift = Shift(node.inputs[0], d, -int(pads[d][0]), 0, shape[d], fill,
                  tuple(k for k in range(len(shape)) if rest[k].any()), local, cost)
    if not ctx.defer(shift, emit, FOLDING_READERS):
      emit()
