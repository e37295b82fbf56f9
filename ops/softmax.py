"""Softmax, LogSoftmax and the fused cross-entropy ops, including over a split class dimension.

With the class dim split, each device reduces its slice and a few small all-reduces (max, sum of exp,
label logit) replace gathering the logits: the way GSPMD partitions an expanded softmax.
"""

import math

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.mesh import axes_text
from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.registry import register


def _tiles(mesh, axes):
  return math.prod(mesh.axis_size(a) for a in axes)


def _class_stats(ctx, x, shape, sharding, source):
  """(max, sum of exp(x - max)) over the last dim, all-reduced over the axes that split it; and exp(x - max).

  The max is taken over the finite and -inf values; a row holding a NaN or +inf anywhere gets the max +inf on
  every device (one flag folded into the same all-reduce), so that every shard sees the same non-finite row
  whichever shard holds the NaN: exp(x - max) is then 0 at its finite values and NaN at its NaN and +inf values,
  and the sum NaN, as in the unpartitioned kernel.
  """
  axes = sharding.dims[-1]
  last = len(shape) - 1
  uneven = bool(axes) and shape[last] % sharding.tiles(last)
  xm = ctx.mask(x, shape, sharding, last, x.dtype.min) if uneven else x
  inf = tf.constant(np.inf, x.dtype)
  bad = tf.logical_or(tf.math.is_nan(xm), tf.equal(xm, inf))
  m = tf.reduce_max(tf.where(bad, -inf, xm), axis=-1, keepdims=True)
  m = tf.where(tf.reduce_any(bad, axis=-1, keepdims=True), inf, m)
  if axes:
    m = ctx.backend.all_reduce(m, axes, "Max", source, f"max over the class dim split by {axes_text(axes)}")
  e = tf.exp(x - m)
  if uneven:
    e = ctx.mask(e, shape, sharding, last, 0.0)
  s = tf.reduce_sum(e, axis=-1, keepdims=True)
  if axes:
    s = ctx.backend.all_reduce(s, axes, "Add", source, f"sum of exp over the class dim split by {axes_text(axes)}")
  return m, s, e


# TF's CPU Softmax kernel for these dtypes returns, on a row holding a NaN or +inf, NaN at those values and 0
# elsewhere (its vectorised exp of the shifted row feeds a finite normaliser); for float64 the whole row is NaN.
_NONFINITE_STAYS_LOCAL = (tf.float32, tf.float16, tf.bfloat16)


@register("Softmax", "LogSoftmax")
class Softmax(FactorRule):
  """Normalise over the last dim: every dim passes its split through."""

  stacked = "softmax"

  priority = 0

  def factors(self, node):
    labels = tuple(f"d{i}" for i in range(len(node.outputs[0].shape)))
    return Factors((labels,), (labels,))

  def internal_bytes(self, node, axes_of, mesh):
    """The class dim split: max and sum of exp all-reduced, one value per row."""
    shape = node.outputs[0].shape
    labels = self.factors(node).outputs[0]
    if not axes_of.get(labels[-1]):
      return 0
    rows = math.prod(-(-shape[d] // _tiles(mesh, axes_of.get(l, ()))) for d, l in enumerate(labels[:-1]))
    return 2 * rows * node.outputs[0].dtype.size

  def partition(self, ctx, node):
    target = ctx.target(0)
    if target.is_maximal or not target.dims[-1]:
      return super().partition(ctx, node)
    shape = node.input_shape(0)
    x = ctx.operand(0, target)
    with ctx.helper_scope():
      m, s, e = _class_stats(ctx, x, shape, target, node.name)
      if node.op == "LogSoftmax":
        y = x - m - tf.math.log(s)   # a NaN or +inf makes the sum NaN: the whole row NaN, as TF's kernel gives
      elif x.dtype in _NONFINITE_STAYS_LOCAL:
        y = tf.where(tf.equal(m, tf.constant(np.inf, x.dtype)), e, e / s)
      else:
        y = e / s
    ctx.set_output(0, y, target)


@register("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits")
class SoftmaxCrossEntropy(FactorRule):
  """(loss[b], backprop[b, c]) from logits[b, c] and labels ([b] ids or [b, c] probabilities)."""

  def factors(self, node):
    sparse = node.op.startswith("Sparse")
    return Factors((("b", "c"), ("b",) if sparse else ("b", "c")), (("b",), ("b", "c")))

  def internal_bytes(self, node, axes_of, mesh):
    """The class dim split: max, sum of exp and the label term all-reduced, one value per row."""
    b, c = axes_of.get("b", ()), axes_of.get("c", ())
    if not c or set(b) & set(c):
      return 0
    return 3 * -(-node.outputs[0].shape[0] // _tiles(mesh, b)) * node.outputs[0].dtype.size

  def partition(self, ctx, node):
    loss_t = ctx.target(0)
    b_axes = () if loss_t.is_maximal else loss_t.dims[0]
    cur = ctx.current(0)
    c_axes = () if cur is None or cur.is_maximal else cur.with_rank(2).dims[1]
    planned = ctx.planned_axes()   # automatic sharding's choice, when it priced this op
    if planned is not None:
      b_axes, c_axes = tuple(planned.get("b", ())), tuple(planned.get("c", ()))
    mesh = ctx.mesh
    sparse = node.op.startswith("Sparse")
    if not c_axes or set(c_axes) & set(b_axes):   # class dim whole on every device: the op runs locally
      whole = Sharding(mesh, (b_axes, ()))
      loss, grad = ctx.clone(node, {0: ctx.operand(0, whole),
                                    1: ctx.operand(1, Sharding(mesh, (b_axes,)) if sparse else whole)})
      ctx.set_output(0, loss, Sharding(mesh, (b_axes,)))
      ctx.set_output(1, grad, whole)
      return
    xs = Sharding(mesh, (b_axes, c_axes))
    shape = node.input_shape(0)
    x = ctx.operand(0, xs)
    labels = ctx.operand(1, Sharding(mesh, (b_axes,)) if sparse else xs)
    with ctx.helper_scope():
      m, s, e = _class_stats(ctx, x, shape, xs, node.name)
      lse = tf.math.log(s) + m
      if sparse:
        c = xs.shard_shape(shape)[1]
        offsets = np.array([xs.tile_index(p, 1) * c for p in range(mesh.size)], np.int32)
        local_ids = tf.cast(labels, tf.int32) - ctx.lookup(offsets, f"class_offset_{c}")
        # Selected, not multiplied by a one-hot: a -inf logit (a masked class) or padding must not give 0 * inf.
        hit = tf.one_hot(local_ids, c, on_value=True, off_value=False)   # no hit where another device holds it
        picked = tf.reduce_sum(tf.where(hit, x, tf.zeros([], x.dtype)), axis=-1, keepdims=True)
        picked = ctx.backend.all_reduce(picked, c_axes, "Add", node.name, "label logit from the device holding it")
        loss = tf.squeeze(lse - picked, -1)
        grad = e / s - tf.cast(hit, x.dtype)
      else:
        lab = ctx.mask(labels, shape, xs, 1, 0.0) if shape[1] % xs.tiles(1) else labels
        xm = ctx.mask(x, shape, xs, 1, 0.0) if shape[1] % xs.tiles(1) else x
        partial = tf.reduce_sum(lab * (lse - xm), axis=-1)
        loss = ctx.backend.all_reduce(partial, c_axes, "Add", node.name, "cross-entropy terms over the split class dim")
        grad = e / s - lab
    ctx.set_output(0, loss, Sharding(mesh, (b_axes,)))
    ctx.set_output(1, grad, xs)
