"""Convolutions, pooling and batch normalisation (and their gradients).

Batch and channel dims pass their split; an input-channel (or, for the filter gradient, batch) split gives
partial sums and one all-reduce, like a matmul. A 2-D or 3-D channels-last convolution or pooling, forward and both
gradients, may also keep its spatial dims split whatever its window, stride, dilation and padding (GSPMD's windowed
input): each device computes its rows of the result from its own input rows plus halo rows from its
neighbours, moved by one halo exchange per split dim and cut at a per-device offset (`PartitionContext.windows`:
one dim after the other, each exchange carrying the earlier ones' halos, so corners arrive too); rows
outside the input (padding, the padding of uneven shards) are *selected* to the window's pad value, so the
local op runs with no padding along that dim. An input gradient is the transposed window: each device takes
the rows of the result gradient whose windows reach its rows, runs the gradient op on that window, and keeps
its own rows. A window that needs rows past the neighbours' shards gathers the dim instead (and the report
says so). The windows' geometry, halo plan and the prologue these rules share are in `ops/windows.py`. Batch
normalisation in training mode reduces over batch and space, so those dims are whole; only channels split
(inference-mode batch norm is element-wise per channel and passes every split).
"""

import math

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.factors import Factors, FactorRule, identity_value
from tf_gspmd.ops.registry import register
from tf_gspmd.ops.windows import WindowedRule, attr_text, geometry, split_spatial


def _nhwc(node, b, c, rank=4):
  """Labels of an activation: batch label `b`, channel label `c`, spatial dims unsplit."""
  fmt = attr_text(node, "data_format", "NHWC")
  spatial = (None,) * (rank - 2)
  return (b, c) + spatial if fmt.startswith("NC") else (b,) + spatial + (c,)


def _explicit(pads):
  return {"padding": tf.compat.v1.AttrValue(s=b"EXPLICIT"),
          "explicit_paddings": tf.compat.v1.AttrValue(list=tf.compat.v1.AttrValue.ListValue(i=pads))}


def _explicit_except(dims, ds):
  """EXPLICIT paddings attrs: each spatial dim padded as the op pads it, except those of `ds` (their windows are
  cut)."""
  pads = [0, 0]
  for k in sorted(dims):
    pads += [0, 0] if k in ds else [dims[k].lo, dims[k].hi]
  return _explicit(pads + [0, 0])


def _local_conv(node, x, dims, ds):
  """(the window `x` as the local convolution reads it, its attrs): a 2-D convolution pads its other spatial dims
  itself (EXPLICIT); a 3-D one (SAME or VALID only) reads them padded here and runs VALID."""
  if len(dims) == 2:
    return x, _explicit_except(dims, ds)
  return _pad_others(x, dims, ds, 0), _valid(node)


def _valid(node):
  attrs = {"padding": tf.compat.v1.AttrValue(s=b"VALID")}
  if node.attr("explicit_paddings") is not None:
    attrs["explicit_paddings"] = tf.compat.v1.AttrValue(list=tf.compat.v1.AttrValue.ListValue())
  return attrs


def _pad_others(x, dims, ds, fill):
  """`x` padded along the spatial dims but those of `ds` as the op pads them (pooling ops take no EXPLICIT
  padding; AvgPool none at all), so the local op runs VALID."""
  pads = [[0, 0]] + [[0, 0] if k in ds else [dims[k].lo, dims[k].hi] for k in sorted(dims)] + [[0, 0]]
  return tf.pad(x, pads, constant_values=fill) if any(p[0] or p[1] for p in pads) else x


def _unpad_others(x, dims, ds):
  """The inverse of `_pad_others` on a gradient of the padded input: the rows of the input itself."""
  begin = [0] + [0 if k in ds else dims[k].lo for k in sorted(dims)] + [0]
  size = [-1] + [-1 if k in ds else dims[k].size for k in sorted(dims)] + [-1]
  return tf.slice(x, begin, size) if any(dims[k].lo or dims[k].hi for k in dims if k not in ds) else x


def _avg_scale(ctx, layout, dims, reached):
  """Per result element, taps / window count, so a VALID average of a window with padding selected to 0
  becomes the average over its input rows alone (the op's SAME semantics); None where every count is full.
  Along a split dim d, `reached[d]` = (first, count): result row j of the device of shard index t is row
  first[t] + j (a per-device table)."""
  scale = None
  for k in sorted(dims):
    g = dims[k]
    if k in reached:
      d, (first, count) = k, reached[k]
      rows = first[:, None] + np.arange(count)[None, :]
      cnt = g.count(rows)
      if np.all(cnt[(rows >= 0) & (rows < g.out)] == g.taps):
        continue
      tiles = np.array([layout.tile_index(p, d) for p in range(ctx.mesh.size)])
      table = (g.taps / np.where(cnt > 0, cnt, g.taps)).astype(np.float32)[tiles]
      shape = [1] * (len(dims) + 2)
      shape[d] = count
      f = tf.reshape(ctx.lookup(table, f"avg_scale_{d}_{count}"), shape)
    else:
      cnt = g.count(np.arange(g.out))
      if np.all(cnt == g.taps):
        continue
      shape = [1] * (len(dims) + 2)
      shape[k] = g.out
      f = tf.constant((g.taps / cnt).astype(np.float32).reshape(shape))
    scale = f if scale is None else scale * f
  return scale


def _forward_reads(ctx, w, i):
  """[(dim, `windows.Rows`)]: the rows of input i each device's result rows read, along every split dim."""
  return [(d, ctx.rows_read(i, w.layout(), d, w.dims[d].out, -w.dims[d].lo, w.dims[d].stride, w.dims[d].window))
          for d in w.ds]


def _reaching(w, layout):
  """{split dim: `WindowDim.reaching`}: per shard index, the result rows whose windows reach its input rows."""
  return {d: w.dims[d].reaching(layout.tiles(d)) for d in w.ds}


def _own_rows(ctx, dx, layout, w, reached):
  """A gradient computed over the windows `reached` cut to each device's own input rows, dim by dim."""
  for d, (first, count, lo, hi, c) in reached.items():
    start = w.dims[d].rows_read(first, count, lo, hi)[0]
    dx = ctx.take_rows(dx, layout, d, np.arange(len(first)) * c - start, c)
  return dx


@register("Conv2D", "Conv3D")
class Conv(WindowedRule):
  """out[b, ..., co] = sum over window and ci of in[b, ..., ci] * filter[..., ci, co].

  A split spatial dim of a 2-D NHWC convolution stays split: each device convolves its window of input rows
  (its own plus halo rows from its neighbours), whatever the stride, dilation and padding, so only halos move.
  """

  def factors(self, node, spatial=None):
    rank = len(node.outputs[0].shape)
    filt = (None,) * (rank - 2) + ("ci", "co")
    if spatial is None:
      spatial = geometry(node) is not None
    if not spatial:
      return Factors((_nhwc(node, "b", "ci", rank), filt), (_nhwc(node, "b", "co", rank),))
    space = tuple(f"s{i}" for i in range(rank - 2))
    return Factors((("b",) + space + ("ci",), filt), (("b",) + space + ("co",),))

  def windowed(self, ctx, node, w):
    x = ctx.windows(0, w.layout(), _forward_reads(ctx, w, 0), 0)
    if x is None:
      return False
    k = ctx.operand(1, Sharding(ctx.mesh, ((),) * (w.rank - 1) + (w.c_axes,)))
    with ctx.helper_scope():
      x, attrs = _local_conv(node, x, w.dims, w.ds)
    (y,) = ctx.clone(node, {0: x, 1: k}, attrs=attrs)
    ctx.set_output(0, y, w.layout(w.c_axes))
    return True


@register("Conv2DBackpropInput", "Conv3DBackpropInputV2")
class ConvBackpropInput(WindowedRule):
  """d_in[b, ..., ci] = sum over co of filter[..., ci, co] * d_out[b, ..., co].

  A split spatial dim of a 2-D NHWC convolution stays split: each device takes the rows of d_out whose
  windows reach its rows of d_in (halo rows from its neighbours), back-propagates that window and keeps its
  own rows.
  """

  data = (1, 2)

  def factors(self, node, spatial=None):
    rank = len(node.outputs[0].shape)
    filt = (None,) * (rank - 2) + ("ci", "co")
    if spatial is None:
      spatial = geometry(node) is not None
    if spatial:
      space = tuple(f"s{i}" for i in range(rank - 2))
      return Factors((filt, ("b",) + space + ("co",)), (("b",) + space + ("ci",),))
    return Factors((filt, _nhwc(node, "b", "co", rank)), (_nhwc(node, "b", "ci", rank),))

  def emit(self, ctx, node, local_inputs, axes_of):
    sizes = self.local_shape_input(ctx, node, axes_of, 0)
    return ctx.clone(node, {0: sizes, 1: local_inputs[0], 2: local_inputs[1]})

  def windowed(self, ctx, node, w):
    layout = w.layout()
    reached = _reaching(w, layout)
    dy = ctx.windows(2, layout, [(d, r[:4]) for d, r in reached.items()], 0)
    if dy is None:
      return False
    k = ctx.operand(1, Sharding(ctx.mesh, ((),) * (w.rank - 2) + (w.c_axes, ())))
    natural = w.layout(w.c_axes)
    sizes = list(natural.shard_shape(node.outputs[0].shape))
    for d, (first, count, lo, hi, _) in reached.items():
      sizes[d] = w.dims[d].rows_read(first, count, lo, hi)[1]
    padded = w.rank == 5   # a 3-D gradient (SAME or VALID only) of the input padded along its other dims
    if padded:
      for k_ in w.dims:
        if k_ not in reached:
          sizes[k_] += w.dims[k_].lo + w.dims[k_].hi
    (dx,) = ctx.clone(node, {0: tf.constant(sizes, node.input_info(0).dtype), 1: k, 2: dy},
                      attrs=_valid(node) if padded else _explicit_except(w.dims, w.ds))
    with ctx.helper_scope():
      dx = _own_rows(ctx, _unpad_others(dx, w.dims, w.ds) if padded else dx, natural, w, reached)
    ctx.set_output(0, dx, natural)
    return True

@register("Conv2DBackpropFilter", "Conv3DBackpropFilterV2")
class ConvBackpropFilter(WindowedRule):
  """d_filter[..., ci, co] = sum over b and space of in[b, ..., ci] * d_out[b, ..., co].

  With a spatial dim of a 2-D NHWC convolution split, each device correlates its rows of d_out with its
  window of input rows (halo rows from its neighbours), giving a partial filter gradient summed by one
  all-reduce (no gather of activations).
  """

  data = (0, 2)

  def factors(self, node, spatial=None):
    rank = len(node.outputs[0].shape)
    if spatial is None:
      spatial = geometry(node) is not None
    if spatial:
      space = tuple(f"s{i}" for i in range(rank - 2))
      return Factors((("b",) + space + ("ci",), ("b",) + space + ("co",)), ((None,) * (rank - 2) + ("ci", "co"),))
    return Factors((_nhwc(node, "b", "ci", rank), _nhwc(node, "b", "co", rank)),
                   ((None,) * (rank - 2) + ("ci", "co"),))

  def emit(self, ctx, node, local_inputs, axes_of):
    sizes = self.local_shape_input(ctx, node, axes_of, 1)
    return ctx.clone(node, {0: local_inputs[0], 1: sizes, 2: local_inputs[1]})

  def split_layout(self, ctx, node):
    """The layout of d_out when it splits a spatial dim, else the input's."""
    cur = ctx.current(2)
    rank = len(node.input_shape(2))
    return cur if split_spatial(cur, rank) else ctx.current(0)

  def windowed(self, ctx, node, w):
    layout = w.layout()
    x = ctx.windows(0, layout, _forward_reads(ctx, w, 0), 0)
    if x is None:
      return False
    dy = ctx.operand(2, layout)
    dy_shape = node.input_shape(2)
    # Summed over batch and rows: the padding of uneven shards must add nothing (selected to 0 on both sides).
    for d in w.ds:
      if w.dims[d].out % layout.tiles(d):
        dy = ctx.mask(dy, dy_shape, layout, d, 0)
    if w.b_axes and dy_shape[0] % layout.tiles(0):
      dy = ctx.mask(dy, dy_shape, layout, 0, 0)
      x = ctx.mask(x, node.input_shape(0), layout, 0, 0)
    kernel = [int(v) for v in node.outputs[0].shape]
    with ctx.helper_scope():
      x, attrs = _local_conv(node, x, w.dims, w.ds)
    (dw,) = ctx.clone(node, {0: x, 1: tf.constant(kernel, node.input_info(1).dtype), 2: dy}, attrs=attrs)
    ctx.set_output(0, dw, Sharding(ctx.mesh, ((),) * w.rank), partial=(tuple(w.axes) + w.b_axes, "Add"))
    return True


def _tiled_windows(node):
  """Pooling windows that tile space exactly (VALID, window == stride, NHWC): a split spatial dim whose
  shards hold whole windows pools locally, with no halo."""
  fmt = attr_text(node, "data_format", "NHWC")
  padding = attr_text(node, "padding", "")
  ksize, strides = list(node.attr("ksize").i), list(node.attr("strides").i)
  if fmt.startswith("NC") or padding != "VALID" or not ksize or ksize != strides:
    return None
  return strides


class _PoolRule(WindowedRule):
  """Batch and channels pass their split; space too for 2-D NHWC pooling (halo exchange, see the module
  docstring), or for other pooling when windows tile it and every shard holds whole ones."""

  def _labels(self, node, spatial):
    rank = len(node.outputs[0].shape)
    if spatial:
      return ("b",) + tuple(f"s{i}" for i in range(rank - 2)) + ("c",)
    return _nhwc(node, "b", "c", rank)

  def spatial(self, node):
    return geometry(node) is not None or _tiled_windows(node) is not None

  def factors(self, node, spatial=None):
    labels = self._labels(node, self.spatial(node) if spatial is None else spatial)
    return Factors(tuple(labels for _ in self.data_inputs(node)), (labels,))

  def unsplit(self, ctx, node):
    """Spatial dims split only where pooling windows tile them and every shard holds whole windows, under the
    completed layout and under the strategy automatic sharding planned (which is taken only then)."""
    target = ctx.target(0)
    strides = _tiled_windows(node)
    shape = self.input_image_shape(node)
    planned = ctx.planned_axes() or {}
    labels = self._labels(node, True)

    def tiles(d):
      axes = planned.get(labels[d], ())
      return max(target.tiles(d), math.prod(ctx.mesh.axis_size(a) for a in axes))

    ok = strides is not None and not target.is_maximal and all(
        shape[d] % (tiles(d) * strides[d]) == 0 for d in range(1, len(shape) - 1))
    self.partition_with(ctx, node, self.factors(node, spatial=ok))

  def input_image_shape(self, node):
    return node.input_shape(self.data_inputs(node)[0])


@register("MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D")
class Pool(_PoolRule):
  data = (0,)

  def windowed(self, ctx, node, w):
    dims, layout = w.dims, w.layout(w.c_axes)
    fill = identity_value("Max", node.outputs[0].dtype) if node.op in ("MaxPool", "MaxPool3D") else 0
    x = ctx.windows(0, layout, _forward_reads(ctx, w, 0), fill)
    if x is None:
      return False
    with ctx.helper_scope():
      x = _pad_others(x, dims, w.ds, fill)
    (y,) = ctx.clone(node, {0: x}, attrs=_valid(node))
    if node.op in ("AvgPool", "AvgPool3D"):
      own = {d: (np.arange(layout.tiles(d)) * -(-dims[d].out // layout.tiles(d)), -(-dims[d].out // layout.tiles(d)))
             for d in w.ds}
      with ctx.helper_scope():
        scale = _avg_scale(ctx, layout, dims, own)
        if scale is not None:
          y = ctx.record(y * tf.cast(scale, y.dtype))
    ctx.set_output(0, y, layout)
    return True


@register("LRN")
class LRN(FactorRule):
  """Local response normalisation runs across channels: batch and space pass their split."""

  def factors(self, node):
    labels = ("b", "h", "w", None)
    return Factors((labels,), (labels,))


@register("MaxPoolGrad", "MaxPool3DGrad", "MaxPoolGradGrad")
class MaxPoolGrad(_PoolRule):
  """d_in of a max pool. With a spatial dim split each device takes the windows that reach its rows (the
  pooled input's rows they read and the result gradient's rows), routes the gradient locally and keeps its
  own rows."""

  data = (0, 1, 2)

  def factors(self, node, spatial=None):
    labels = self._labels(node, self.spatial(node) if spatial is None else spatial)
    return Factors((labels, labels, labels), (labels,))

  def windowed(self, ctx, node, w):
    dims, layout = w.dims, w.layout(w.c_axes)
    lowest = identity_value("Max", node.outputs[0].dtype)
    reached = _reaching(w, layout)
    inputs = [(d, dims[d].rows_read(*r[:4])) for d, r in reached.items()]
    grads = [(d, r[:4]) for d, r in reached.items()]
    if not (ctx.windows_fit(0, layout, inputs) and ctx.windows_fit(2, layout, grads)):
      return False
    x = ctx.windows(0, layout, inputs, lowest)
    dy = ctx.windows(2, layout, grads, 0)
    with ctx.helper_scope():
      x = _pad_others(x, dims, w.ds, lowest)
      # The pooled result over the window, recomputed from the input rows the window holds anyway (a max is
      # exact), rather than exchanging the result's halo rows too.
      y = tf.nn.max_pool(x, list(node.attr("ksize").i)[1:-1], list(node.attr("strides").i)[1:-1], "VALID")
    (dx,) = ctx.clone(node, {0: x, 1: y, 2: dy}, attrs=_valid(node))
    with ctx.helper_scope():
      dx = _own_rows(ctx, _unpad_others(dx, dims, w.ds), layout, w, reached)
    ctx.set_output(0, dx, layout)
    return True


@register("AvgPoolGrad", "AvgPool3DGrad")
class AvgPoolGrad(_PoolRule):
  """d_in of an average pool. With a spatial dim split each device takes the gradient rows whose windows
  reach its rows, divides each by its window's count of input rows, spreads them locally and keeps its own
  rows."""

  data = (1,)

  def input_image_shape(self, node):
    return node.outputs[0].shape

  def emit(self, ctx, node, local_inputs, axes_of):
    return ctx.clone(node, {0: self.local_shape_input(ctx, node, axes_of, 0), 1: local_inputs[0]})

  def windowed(self, ctx, node, w):
    dims, layout = w.dims, w.layout(w.c_axes)
    reached = _reaching(w, layout)
    dy = ctx.windows(1, layout, [(d, r[:4]) for d, r in reached.items()], 0)
    if dy is None:
      return False
    with ctx.helper_scope():
      scale = _avg_scale(ctx, layout, dims, {d: (r[0], r[1]) for d, r in reached.items()})
      if scale is not None:
        dy = dy * tf.cast(scale, dy.dtype)
      sizes = list(layout.shard_shape(node.outputs[0].shape))
      for k in sorted(dims):
        if k in reached:
          sizes[k] = dims[k].rows_read(*reached[k][:4])[1]
        else:
          sizes[k] += dims[k].lo + dims[k].hi
    (dx,) = ctx.clone(node, {0: tf.constant(sizes, node.input_info(0).dtype), 1: dy}, attrs=_valid(node))
    with ctx.helper_scope():
      dx = _own_rows(ctx, _unpad_others(dx, dims, w.ds), layout, w, reached)
    ctx.set_output(0, dx, layout)
    return True


@register("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
class FusedBatchNorm(FactorRule):
  """y = normalise(x) per channel; statistics over batch and space (whole when training)."""

  def factors(self, node):
    x = _nhwc(node, None if node.attr("is_training") else "b", "c", len(node.input_shape(0)))
    others = _per_channel([node.input_shape(i) for i in range(1, len(node.inputs))])
    return Factors((x,) + others, (x,) + _per_channel([o.shape for o in node.outputs[1:]]))

  def rank_free_ports(self, node):
    """The statistics and reserve spaces (`_per_channel` gives one of unknown shape no factor)."""
    return range(1, len(node.inputs)), range(1, len(node.outputs))


def _per_channel(shapes):
  """Labels of per-channel vectors; other (e.g. opaque reserve-space) operands carry no factor."""
  return tuple(() if s is None else ("c",) if len(s) == 1 and s[0] else (None,) * len(s) for s in shapes)


@register("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3")
class FusedBatchNormGrad(FactorRule):
  """dx, d_scale, d_offset per channel: batch and space are whole on every device."""

  def factors(self, node):
    x = _nhwc(node, None, "c", len(node.input_shape(0)))
    others = _per_channel([node.input_shape(i) for i in range(2, len(node.inputs))])
    return Factors((x, x) + others, (x,) + _per_channel([o.shape for o in node.outputs[1:]]))

  def rank_free_ports(self, node):
    """The statistics and reserve spaces (`_per_channel` gives one of unknown shape no factor)."""
    return range(2, len(node.inputs)), range(1, len(node.outputs))
