"""Convolutions, pooling and batch normalisation (and their gradients).

Batch and channel dims pass their split; an input-channel (or, for the filter gradient, batch) split gives
partial sums and one all-reduce, like a matmul. Spatial dims are whole on every device here. Batch
normalisation in training mode reduces over batch and space, so those dims are whole too; only channels
split (inference-mode batch norm is element-wise per channel and passes every split).
"""

import tensorflow as tf

from tf_gspmd._mesh import axes_text
from tf_gspmd._sharding import Sharding
from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.registry import register


def _nhwc(node, b, c, rank=4):
  """Labels of an activation: batch label `b`, channel label `c`, spatial dims unsplit."""
  fmt = node.attr("data_format")
  fmt = fmt.decode() if isinstance(fmt, bytes) else (fmt or "NHWC")
  spatial = (None,) * (rank - 2)
  return (b, c) + spatial if fmt.startswith("NC") else (b,) + spatial + (c,)


def _halo_eligible(node):
  """Stride 1, no dilation, SAME padding, NHWC: a split spatial dim needs only its neighbours' edge rows."""
  fmt = node.attr("data_format")
  fmt = fmt.decode() if isinstance(fmt, bytes) else (fmt or "NHWC")
  padding = node.attr("padding")
  padding = padding.decode() if isinstance(padding, bytes) else padding
  return (node.op.startswith("Conv2D") and not fmt.startswith("NC") and padding == "SAME" and
          all(v == 1 for v in node.attr("strides").i) and
          all(v == 1 for v in (node.attr("dilations").i or [1])))


def _split_spatial(layout, rank):
  """(dim, axes) of the one split spatial dim of an NHWC layout, or None."""
  if layout is None or layout.is_maximal:
    return None
  layout = layout.with_rank(rank)
  split = [d for d in range(1, rank - 1) if layout.dims[d]]
  return (split[0], layout.dims[split[0]]) if len(split) == 1 else None


def _same_pads(kernel, rank, skip):
  """EXPLICIT paddings (NHWC) that make a VALID window along `skip` and SAME elsewhere."""
  pads = [0, 0]
  for i in range(1, rank - 1):
    total = 0 if i == skip else kernel[i - 1] - 1
    pads += [total // 2, total - total // 2]
  return pads + [0, 0]


def _explicit(pads):
  return {"padding": tf.compat.v1.AttrValue(s=b"EXPLICIT"),
          "explicit_paddings": tf.compat.v1.AttrValue(list=tf.compat.v1.AttrValue.ListValue(i=pads))}


@register("Conv2D", "Conv3D")
class Conv(FactorRule):
  """out[b, ..., co] = sum over window and ci of in[b, ..., ci] * filter[..., ci, co].

  With stride 1 and SAME padding a spatial dim may stay split: each device convolves its rows plus a halo
  of its neighbours' edge rows (GSPMD's halo exchange), so only the halos move.
  """

  def factors(self, node, spatial=None):
    rank = len(node.outputs[0].shape)
    filt = (None,) * (rank - 2) + ("ci", "co")
    if spatial is None:
      spatial = _halo_eligible(node)
    if not spatial:
      return Factors((_nhwc(node, "b", "ci", rank), filt), (_nhwc(node, "b", "co", rank),))
    space = tuple(f"s{i}" for i in range(rank - 2))
    return Factors((("b",) + space + ("ci",), filt), (("b",) + space + ("co",),))

  def partition(self, ctx, node):
    target = ctx.target(0)
    shape = node.input_shape(0)
    rank = len(shape)
    split = [d for d in range(1, rank - 1) if not target.is_maximal and target.dims[d]]
    kernel = node.input_shape(1)
    if not _halo_eligible(node) or len(split) != 1:
      return self.partition_with(ctx, node, self.factors(node, spatial=False))
    d = split[0]
    axes = target.dims[d]
    n = target.tiles(d)
    k = kernel[d - 1]
    left, right = (k - 1) // 2, k - 1 - (k - 1) // 2
    if shape[d] % n or max(left, right) > shape[d] // n:
      return self.partition_with(ctx, node, self.factors(node, spatial=False))
    mesh = ctx.mesh
    b_axes = target.dims[0]
    co_axes = tuple(a for a in target.dims[-1] if a not in axes and a not in b_axes)
    x = ctx.operand(0, Sharding(mesh, tuple(axes if i == d else (b_axes if i == 0 else ()) for i in range(rank))))
    w = ctx.operand(1, Sharding(mesh, ((),) * (rank - 1) + (co_axes,)))
    with ctx.helper_scope():
      x = ctx.backend.halo_exchange(x, d, axes, left, right, node.name,
                                    f"{node.name} convolves rows split over {axes_text(axes)}")
    (y,) = ctx.clone(node, {0: x, 1: w}, attrs=_explicit(_same_pads(kernel, rank, d)))
    natural = Sharding(mesh, tuple(axes if i == d else (b_axes if i == 0 else (co_axes if i == rank - 1 else ()))
                                   for i in range(rank)))
    ctx.set_output(0, y, natural)


@register("Conv2DBackpropInput", "Conv3DBackpropInputV2")
class ConvBackpropInput(FactorRule):
  """d_in[b, ..., ci] = sum over co of filter[..., ci, co] * d_out[b, ..., co].

  For a SAME stride-1 Conv2D a split spatial dim stays split: each device convolves its rows of d_out, plus
  halo rows from its neighbours, with the flipped filter (the forward convolution's halo exchange, mirrored).
  """

  def data_inputs(self, node):
    return [1, 2]

  def factors(self, node):
    rank = len(node.outputs[0].shape)
    filt = (None,) * (rank - 2) + ("ci", "co")
    if _halo_eligible(node):
      space = tuple(f"s{i}" for i in range(rank - 2))
      return Factors((filt, ("b",) + space + ("co",)), (("b",) + space + ("ci",),))
    return Factors((filt, _nhwc(node, "b", "co", rank)), (_nhwc(node, "b", "ci", rank),))

  def emit(self, ctx, node, local_inputs, axes_of):
    sizes = self.local_shape_input(ctx, node, axes_of, 0)
    return ctx.clone(node, {0: sizes, 1: local_inputs[0], 2: local_inputs[1]})

  def partition(self, ctx, node):
    rank = len(node.outputs[0].shape)
    target = ctx.target(0)
    split = _split_spatial(target, rank) if _halo_eligible(node) else None
    shape = node.outputs[0].shape
    kernel = node.input_shape(1)
    if split is None or shape[split[0]] % target.tiles(split[0]) or kernel[split[0] - 1] - 1 > \
        shape[split[0]] // target.tiles(split[0]):
      return self.partition_with(ctx, node, Factors(((None,) * (rank - 2) + ("ci", "co"),
                                                     _nhwc(node, "b", "co", rank)), (_nhwc(node, "b", "ci", rank),)))
    d, axes = split
    mesh = ctx.mesh
    b_axes = tuple(a for a in target.dims[0] if a not in axes)
    ci_axes = tuple(a for a in target.dims[-1] if a not in axes and a not in b_axes)
    k = kernel[d - 1]
    top = (k - 1) // 2
    dy = ctx.operand(2, Sharding(mesh, tuple(axes if i == d else (b_axes if i == 0 else ()) for i in range(rank))))
    w = ctx.operand(1, Sharding(mesh, ((),) * (rank - 2) + (ci_axes, ())))
    with ctx.helper_scope():
      dy = ctx.backend.halo_exchange(dy, d, axes, k - 1 - top, top, node.name,
                                     f"{node.name} back-propagates through rows split over {axes_text(axes)}")
      w = tf.transpose(tf.reverse(w, list(range(rank - 2))), list(range(rank - 2)) + [rank - 1, rank - 2])
      pads = [0, 0]
      for i in range(1, rank - 1):
        total = 0 if i == d else kernel[i - 1] - 1
        pads += [total - total // 2, total // 2]   # the forward padding, mirrored
      pads += [0, 0]
      dx = tf.nn.conv2d(dy, w, strides=1, padding=[pads[2 * i:2 * i + 2] for i in range(rank)])
    ctx.record(dx)
    ctx.set_output(0, dx, Sharding(mesh, tuple(axes if i == d else (b_axes if i == 0 else
                                                                    (ci_axes if i == rank - 1 else ()))
                                               for i in range(rank))))


@register("Conv2DBackpropFilter", "Conv3DBackpropFilterV2")
class ConvBackpropFilter(FactorRule):
  """d_filter[..., ci, co] = sum over b and space of in[b, ..., ci] * d_out[b, ..., co].

  For a SAME stride-1 Conv2D with rows split, each device correlates its rows of d_out with its rows of the
  input plus halo rows, giving a partial filter gradient summed by one all-reduce (no gather of activations).
  """

  def data_inputs(self, node):
    return [0, 2]

  def factors(self, node):
    rank = len(node.outputs[0].shape)
    if _halo_eligible(node):
      space = tuple(f"s{i}" for i in range(rank - 2))
      return Factors((("b",) + space + ("ci",), ("b",) + space + ("co",)), ((None,) * (rank - 2) + ("ci", "co"),))
    return Factors((_nhwc(node, "b", "ci", rank), _nhwc(node, "b", "co", rank)),
                   ((None,) * (rank - 2) + ("ci", "co"),))

  def emit(self, ctx, node, local_inputs, axes_of):
    sizes = self.local_shape_input(ctx, node, axes_of, 1)
    return ctx.clone(node, {0: local_inputs[0], 1: sizes, 2: local_inputs[1]})

  def partition(self, ctx, node):
    rank = len(node.outputs[0].shape)
    kernel = node.outputs[0].shape   # the filter's shape (static), whatever computes filter_sizes
    shape = node.input_shape(0)
    cur = ctx.current(2)
    split = _split_spatial(cur, rank) if _halo_eligible(node) else None
    if split is None or shape[split[0]] % cur.tiles(split[0]) or int(kernel[split[0] - 1]) - 1 > \
        shape[split[0]] // cur.tiles(split[0]):
      return self.partition_with(ctx, node, Factors((_nhwc(node, "b", "ci", rank), _nhwc(node, "b", "co", rank)),
                                                    ((None,) * (rank - 2) + ("ci", "co"),)))
    d, axes = split
    mesh = ctx.mesh
    cur = cur.with_rank(rank)
    b_axes = tuple(a for a in cur.dims[0] if a not in axes)
    layout = Sharding(mesh, tuple(axes if i == d else (b_axes if i == 0 else ()) for i in range(rank)))
    k = int(kernel[d - 1])
    top = (k - 1) // 2
    x = ctx.operand(0, layout)
    dy = ctx.operand(2, layout)
    with ctx.helper_scope():
      x = ctx.backend.halo_exchange(x, d, axes, top, k - 1 - top, node.name,
                                    f"{node.name} correlates rows split over {axes_text(axes)}")
    (dw,) = ctx.clone(node, {0: x, 1: tf.constant(list(kernel), node.input_info(1).dtype), 2: dy},
                      attrs=_explicit(_same_pads([int(v) for v in kernel], rank, d)))
    ctx.set_output(0, dw, Sharding(mesh, ((),) * rank), partial=(tuple(axes) + b_axes, "Add"))


def _tiled_windows(node):
  """Pooling windows that tile space exactly (VALID, window == stride, NHWC): a split spatial dim whose
  shards hold whole windows pools locally, with no halo."""
  fmt = node.attr("data_format")
  fmt = fmt.decode() if isinstance(fmt, bytes) else (fmt or "NHWC")
  padding = node.attr("padding")
  padding = padding.decode() if isinstance(padding, bytes) else padding
  ksize, strides = list(node.attr("ksize").i), list(node.attr("strides").i)
  if fmt.startswith("NC") or padding != "VALID" or not ksize or ksize != strides:
    return None
  return strides


class _PoolRule(FactorRule):
  """Batch and channels pass their split; space too when windows tile it and every shard holds whole ones."""

  def _labels(self, node, spatial):
    rank = len(node.outputs[0].shape)
    if spatial:
      return ("b",) + tuple(f"s{i}" for i in range(rank - 2)) + ("c",)
    return _nhwc(node, "b", "c", rank)

  def factors(self, node, spatial=None):
    labels = self._labels(node, _tiled_windows(node) is not None if spatial is None else spatial)
    return Factors(tuple(labels for _ in self.data_inputs(node)), (labels,))

  def partition(self, ctx, node):
    strides = _tiled_windows(node)
    target = ctx.target(0)
    shape = self.input_image_shape(node)
    ok = strides is not None and not target.is_maximal and all(
        shape[d] % (target.tiles(d) * strides[d]) == 0 for d in range(1, len(shape) - 1))
    self.partition_with(ctx, node, self.factors(node, spatial=ok))

  def input_image_shape(self, node):
    return node.input_shape(self.data_inputs(node)[0])


@register("MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D")
class Pool(_PoolRule):
  def data_inputs(self, node):
    return [0]


@register("LRN")
class LRN(FactorRule):
  """Local response normalisation runs across channels: batch and space pass their split."""

  def factors(self, node):
    labels = ("b", "h", "w", None)
    return Factors((labels,), (labels,))


@register("MaxPoolGrad", "MaxPool3DGrad", "MaxPoolGradGrad")
class MaxPoolGrad(_PoolRule):
  def data_inputs(self, node):
    return [0, 1, 2]

  def factors(self, node, spatial=None):
    labels = self._labels(node, _tiled_windows(node) is not None if spatial is None else spatial)
    return Factors((labels, labels, labels), (labels,))


@register("AvgPoolGrad", "AvgPool3DGrad")
class AvgPoolGrad(_PoolRule):
  def data_inputs(self, node):
    return [1]

  def input_image_shape(self, node):
    return node.outputs[0].shape

  def emit(self, ctx, node, local_inputs, axes_of):
    return ctx.clone(node, {0: self.local_shape_input(ctx, node, axes_of, 0), 1: local_inputs[0]})


@register("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
class FusedBatchNorm(FactorRule):
  """y = normalise(x) per channel; statistics over batch and space (whole when training)."""

  def factors(self, node):
    x = _nhwc(node, None if node.attr("is_training") else "b", "c", len(node.input_shape(0)))
    others = _per_channel([node.input_shape(i) for i in range(1, len(node.inputs))])
    return Factors((x,) + others, (x,) + _per_channel([o.shape for o in node.outputs[1:]]))


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
