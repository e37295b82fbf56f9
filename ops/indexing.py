"""Ops that select or combine slices: concat/stack/split, slice, pad, one-hot, gather and segment sums.

The dim an op reads across (concat axis, sliced or padded dims, ...) carries no factor:
it is whole on every device, so the op runs unchanged on the local shards; every other dim passes its
split through. Gather from a table split along the gathered dim never gathers the table: each device looks
up the ids it owns and one all-reduce combines the rows.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd._sharding import Sharding
from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.registry import register


def _labels(rank):
  return tuple(f"d{i}" for i in range(rank))


def _axis(node, i, rank):
  v = node.const_input(i)
  return None if v is None else int(np.asarray(v).reshape(-1)[0]) % max(rank, 1)


def _without(labels, dims):
  return tuple(None if k in dims else l for k, l in enumerate(labels))


class AlongAxis(FactorRule):
  """Base: data inputs share labels except `fixed_dims` (whole on every device)."""

  priority = 1

  def fixed_dims(self, node):
    raise NotImplementedError

  def factors(self, node):
    rank = len(node.outputs[0].shape)
    labels = _without(_labels(rank), self.fixed_dims(node))
    return Factors(tuple(labels for _ in self.data_inputs(node)), tuple(labels for _ in node.outputs))


@register("ConcatV2")
class Concat(AlongAxis):
  """Concatenation. Split along the concat dim, each device assembles its window of the result from the
  operands' rows it owns and its neighbours' (masked windows summed); otherwise the concat dim is whole."""

  priority = 0

  def data_inputs(self, node):
    return list(range(len(node.inputs) - 1))

  def fixed_dims(self, node):
    return {_axis(node, len(node.inputs) - 1, len(node.outputs[0].shape))}

  def factors(self, node, windowed=True):
    rank = len(node.outputs[0].shape)
    labels = _labels(rank) if windowed and None not in self.fixed_dims(node) else \
        _without(_labels(rank), self.fixed_dims(node))
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
    ctx.set_output(0, ctx.identity(tf.add_n(windows) if len(windows) > 1 else windows[0]), target)


@register("Pack")
class Pack(FactorRule):
  """stack: a new, unsplit dim at `axis`."""

  priority = 0

  def factors(self, node):
    rank = len(node.input_shape(0))
    axis = node.attr("axis") % (rank + 1)
    labels = _labels(rank)
    return Factors(tuple(labels for _ in node.inputs), (labels[:axis] + (None,) + labels[axis:],))


@register("Unpack")
class Unpack(FactorRule):
  """unstack: the unpacked dim is whole on every device."""

  priority = 0

  def factors(self, node):
    rank = len(node.input_shape(0))
    axis = node.attr("axis") % rank
    labels = _labels(rank)
    out = labels[:axis] + labels[axis + 1:]
    return Factors((_without(labels, {axis}),), tuple(out for _ in node.outputs))


@register("Split")
class Split(AlongAxis):
  priority = 0

  def data_inputs(self, node):
    return [1]

  def fixed_dims(self, node):
    return {_axis(node, 0, len(node.outputs[0].shape))}


@register("SplitV")
class SplitV(AlongAxis):
  priority = 0

  def data_inputs(self, node):
    return [0]

  def fixed_dims(self, node):
    return {_axis(node, 2, len(node.outputs[0].shape))}


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
    labels = _labels(len(shape)) if windowed else _without(_labels(len(shape)), set(ranges))
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
    labels = _labels(rank) if windowed else _without(_labels(rank), self._padded(node))
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


@register("OneHot")
class OneHot(FactorRule):
  """The depth dim is produced whole (sliced afterwards if it should be split); index dims pass."""

  def data_inputs(self, node):
    return [0]

  def factors(self, node):
    rank = len(node.input_shape(0))
    axis = node.attr("axis")
    axis = rank if axis == -1 else axis
    labels = _labels(rank)
    return Factors((labels,), (labels[:axis] + (None,) + labels[axis:],))


@register("UnsortedSegmentSum")
class UnsortedSegmentSum(FactorRule):
  """data[ids..., rest] -> out[segments, rest]: id dims are summed (partial sums + all-reduce), rest pass."""

  def data_inputs(self, node):
    return [0, 1]

  def factors(self, node):
    rank = len(node.input_shape(0))
    k = len(node.input_shape(1))
    ids = tuple(f"r{i}" for i in range(k))
    rest = tuple(f"d{i}" for i in range(k, rank))
    return Factors((ids + rest, ids), ((None,) + rest,))


@register("GatherV2")
class Gather(FactorRule):
  """params[..., axis, ...][indices]: index dims and params' other dims pass their split.

  When the table is split along the gathered dim (a vocabulary-split embedding), each device looks up the
  ids in its own range (clamped), zeroes the rows it does not own, and one all-reduce sums the rows.
  """

  def data_inputs(self, node):
    return [0, 1]

  def _axis(self, node):
    return _axis(node, 2, len(node.input_shape(0)))

  def factors(self, node):
    p_rank, i_rank = len(node.input_shape(0)), len(node.input_shape(1))
    axis = self._axis(node)
    if node.attr("batch_dims") or axis is None:
      return Factors(((None,) * p_rank, (None,) * i_rank), ((None,) * len(node.outputs[0].shape),))
    p = tuple(f"p{d}" for d in range(p_rank))
    idx = tuple(f"i{d}" for d in range(i_rank))
    out = p[:axis] + idx + p[axis + 1:]
    return Factors((p[:axis] + ("v",) + p[axis + 1:], idx), (out,))

  def partition(self, ctx, node):
    axis = self._axis(node)
    cur = ctx.current(0)
    v_axes = () if cur is None or cur.is_maximal or axis is None else cur.with_rank(len(node.input_shape(0))).dims[axis]
    target = ctx.target(0)
    if not v_axes or node.attr("batch_dims") or target.is_maximal or set(v_axes) & set(target.used_axes):
      return FactorRule.partition(self, ctx, node)   # the table is whole along the gathered dim
    mesh = ctx.mesh
    f = self.factors(node)
    p_labels, i_labels = f.operands
    out_labels = f.outputs[0]
    axes_of = {l: target.dims[d] for d, l in enumerate(out_labels)}
    params_s = Sharding(mesh, tuple(v_axes if l == "v" else axes_of.get(l, ()) for l in p_labels))
    ids_s = Sharding(mesh, tuple(axes_of.get(l, ()) for l in i_labels))
    params = ctx.operand(0, params_s)
    ids = ctx.operand(1, ids_s)
    rows = self.masked_lookup(ctx, params, ids, params_s, axis, node.input_shape(0)[axis])
    natural = Sharding(mesh, tuple(axes_of.get(l, ()) for l in out_labels))
    ctx.set_output(0, rows, natural, partial=(v_axes, "Add"))

  def masked_lookup(self, ctx, params, ids, params_s, axis, size):
    """Rows of the ids this device owns along `axis` (zeros elsewhere): the partial result of a split table."""
    mesh = ctx.mesh
    c = -(-size // params_s.tiles(axis))
    lo = np.array([params_s.tile_index(p, axis) * c for p in range(mesh.size)], ids.dtype.as_numpy_dtype)
    with ctx.helper_scope():
      ids = tf.clip_by_value(ids, 0, size - 1) - ctx.lookup(lo, f"vocab_offset_{axis}_{c}")
      owned = (ids >= 0) & (ids < c)
      rows = tf.gather(params, tf.clip_by_value(ids, 0, c - 1), axis=axis)
      mask_shape = [1] * axis + ids.shape.as_list() + [1] * (params.shape.rank - axis - 1)
      return tf.where(tf.reshape(owned, mask_shape), rows, tf.zeros([], rows.dtype))

  def split_reduced(self, node):
    return False   # "v" is not summed: the generic path keeps the gathered dim whole (see partition)
