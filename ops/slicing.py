"""Slices and pads, and the gradients that are their transposes: Slice, StridedSlice, StridedSliceGrad,
Pad, PadV2, MirrorPad.

A dim read whole (or left unpadded) passes its split through. A dim sliced or padded by a constant window
may stay split too: each device takes its window of the result from its own rows and its neighbours'
(halo exchange, GSPMD's windowed slice and pad); otherwise that dim is whole on every device. Strided
slices with new axes, an ellipsis or shrunk dims keep the split of every dim they read whole.
StridedSliceGrad, the transpose of a plain strided slice, passes the split of the dims read whole.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd.ops.factors import dim_labels, Factors, FactorRule, unsplit
from tf_gspmd.ops.registry import register


class _Windowed(FactorRule):
  """A rule whose selected dims may stay split: each device takes its window of the result from its own
  rows and its neighbours' (halo exchange). Subclasses give `ranges(node)`: {input dim: (start, size)}."""

  def data_inputs(self, node):
    return [0]

  def ranges(self, node):
    raise NotImplementedError

  def factors(self, node, windowed=True):
    shape = node.input_shape(0)
    ranges = self.ranges(node)
    if ranges is None:
      return Factors(((None,) * len(shape),), ((None,) * len(node.outputs[0].shape),))
    labels = dim_labels(len(shape)) if windowed else unsplit(dim_labels(len(shape)), set(ranges))
    return Factors((labels,), (labels,))

  def partition(self, ctx, node):
    ranges = self.ranges(node)
    target = ctx.target(0)
    split = [d for d in (ranges or {}) if not target.is_maximal and d < target.rank and target.dims[d]]
    if ranges is None or len(split) != 1:
      return self.partition_with(ctx, node, self.factors(node, windowed=False))
    d = split[0]
    start, size = ranges[d]
    x = ctx.window(0, target, d, size, start, 0)
    if x is None:
      return self.partition_with(ctx, node, self.factors(node, windowed=False))
    begin = [0] * x.shape.rank
    extent = x.shape.as_list()
    for k, (b, n) in ranges.items():   # the other selected dims are whole: select them locally
      if k != d:
        begin[k], extent[k] = b, n
    ctx.set_output(0, ctx.identity(tf.slice(x, begin, extent)), target)


@register("Slice")
class Slice(_Windowed):
  """Dims sliced to less than their size take a window (split: with halos); full-size dims pass their split."""

  def ranges(self, node):
    begin, size = node.const_input(1), node.const_input(2)
    if begin is None or size is None:
      return None
    shape, out = node.input_shape(0), node.outputs[0].shape
    return {d: (int(begin[d]), out[d]) for d in range(len(shape)) if out[d] != shape[d]}

  def emit(self, ctx, node, local_inputs, axes_of):
    (x,) = local_inputs
    ranges = self.ranges(node)
    if ranges is None:
      return ctx.clone(node, {0: x})
    size = [ranges[d][1] if d in ranges else x.shape[d] for d in range(x.shape.rank)]
    begin = [ranges[d][0] if d in ranges else 0 for d in range(x.shape.rank)]
    return ctx.clone(node, {0: x, 1: tf.constant(begin, node.input_info(1).dtype),
                            2: tf.constant(size, node.input_info(2).dtype)})


@register("StridedSlice")
class StridedSlice(_Windowed):
  """Untouched full-range dims pass their split, shrunk dims vanish, new axes (`x[..., None]`) are whole.

  A contiguous range (stride 1, no shrink, no new axes) on a split dim takes a window with halos, like Slice.
  """

  def _plain(self, node):
    return not node.attr("new_axis_mask") and not node.attr("ellipsis_mask") and all(
        node.const_input(i) is not None for i in (1, 2, 3))

  def _entries(self, node):
    """Output dims in order: ("in", input dim, read whole with stride 1, shrunk) or ("new",); None if dynamic.

    Expands the ellipsis (and the implicit one at the end) and keeps new axes where they are inserted.
    """
    shape = node.input_shape(0)
    consts = [node.const_input(i) for i in (1, 2, 3)]
    if any(c is None for c in consts):
      return None
    begin, end, strides = (np.asarray(c).reshape(-1) for c in consts)
    bm, em, sm = node.attr("begin_mask"), node.attr("end_mask"), node.attr("shrink_axis_mask")
    nm, elm = node.attr("new_axis_mask"), node.attr("ellipsis_mask")
    consumed = sum(1 for i in range(len(begin)) if not (nm >> i & 1 or elm >> i & 1))
    entries, d = [], 0
    for i in range(len(begin)):
      if elm >> i & 1:
        for _ in range(len(shape) - consumed):
          entries.append(("in", d, True, False))
          d += 1
      elif nm >> i & 1:
        entries.append(("new",))
      else:
        b = 0 if bm >> i & 1 else int(begin[i])
        e = shape[d] if em >> i & 1 else int(end[i])
        shrink = bool(sm >> i & 1)
        entries.append(("in", d, not shrink and strides[i] == 1 and b in (0, -shape[d]) and e >= shape[d], shrink))
        d += 1
    while d < len(shape):
      entries.append(("in", d, True, False))
      d += 1
    return entries

  @staticmethod
  def full_dims(shape, begin, end, strides, begin_mask, end_mask, shrink_mask):
    """Dims of `shape` that a strided slice reads entirely, in order, with stride 1."""
    full = set()
    for d in range(len(shape)):
      if d >= len(begin):
        full.add(d)
        continue
      b = 0 if begin_mask >> d & 1 else int(begin[d])
      e = shape[d] if end_mask >> d & 1 else int(end[d])
      if not shrink_mask >> d & 1 and strides[d] == 1 and b in (0, -shape[d]) and e >= shape[d]:
        full.add(d)
    return full

  def ranges(self, node):
    """{dim: (start, size)} of a contiguous stride-1 selection without shrinking, else None."""
    if not self._plain(node) or node.attr("shrink_axis_mask"):
      return None
    shape = node.input_shape(0)
    begin, end, strides = (np.asarray(node.const_input(i)).reshape(-1) for i in (1, 2, 3))
    if np.any(strides != 1):
      return None
    out = {}
    for d in range(min(len(begin), len(shape))):
      b = 0 if node.attr("begin_mask") >> d & 1 else int(begin[d])
      e = shape[d] if node.attr("end_mask") >> d & 1 else int(end[d])
      b, e = (b + shape[d] if b < 0 else b), (e + shape[d] if e < 0 else e)
      b, e = min(max(b, 0), shape[d]), min(max(e, 0), shape[d])
      if (b, e) != (0, shape[d]):
        out[d] = (b, max(e - b, 0))
    return out

  def factors(self, node, windowed=True):
    if self.ranges(node) is not None:
      return super().factors(node, windowed)
    shape = node.input_shape(0)
    entries = self._entries(node)
    if entries is None:
      return Factors(((None,) * len(shape),), ((None,) * len(node.outputs[0].shape),))
    full = {e[1] for e in entries if e[0] == "in" and e[2]}
    ins = tuple(f"d{d}" if d in full else None for d in range(len(shape)))
    out = tuple(None if e[0] == "new" else ins[e[1]] for e in entries if e[0] == "new" or not e[3])
    return Factors((ins,), (out,))


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


@register("Pad", "PadV2", "MirrorPad")
class Pad(FactorRule):
  """Unpadded dims pass their split. A padded dim may stay split too (constant padding): each device takes
  its window of the padded result, with halo rows from its neighbours (GSPMD's windowed pad)."""

  def data_inputs(self, node):
    return [0]

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
    x = ctx.window(0, target, d, shape[d] + int(pads[d].sum()), -int(pads[d][0]), fill)
    if x is None:
      return self.partition_with(ctx, node, self.factors(node, windowed=False))
    rest = pads.copy()
    rest[d] = 0
    if rest.any():   # the other padded dims are whole: pad them locally
      x = tf.pad(x, rest, constant_values=fill)
    ctx.set_output(0, ctx.identity(x), target)
