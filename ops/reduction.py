"""Reductions, and the ops that select or accumulate along a dim: Sum, Mean, Max, Min, Prod, All, Any,
ArgMax, ArgMin, TopKV2, Cumsum, Cumprod, CumulativeLogsumexp.

Reductions over constant axes: reduced dims are reduced factors; split ones need one all-reduce (All and Any
merge the shards' results with Min and Max). Padding of an unevenly split reduced dim is masked with the
reduction's identity (0 for Sum, -inf for Max, True for All, ...) before the local reduction, so it never leaks
into the result. Scans keep the dims they run along whole; ArgMax/ArgMin over a split dim all-gather only each
shard's winner, TopKV2 each shard's top k.
"""

import math

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.factors import const_axis, dim_labels, Factors, FactorRule, unsplit
from tf_gspmd.ops.registry import register

_REDUCE_OP = {"Sum": "Add", "Mean": "Add", "Max": "Max", "Min": "Min", "Prod": "Mul"}


def reduced_axes(node):
  axes = node.const_input(1)
  if axes is None:
    return None
  rank = len(node.input_shape(0))
  return sorted({int(a) % rank for a in np.atleast_1d(axes)}) if rank else []


@register("Sum", "Mean", "Max", "Min", "Prod")
class Reduce(FactorRule):
  """reduce(x, axes): kept dims pass through, reduced dims combine partial results with the op's reducer."""

  stacked = "reduction"

  data = (0,)

  def factors(self, node):
    rank = len(node.input_shape(0))
    red = reduced_axes(node)
    if red is None:  # axes computed at run time: reduce everything locally after replication
      red = []
    labels = tuple(f"d{i}" for i in range(rank))
    keep = node.attr("keep_dims")
    out = tuple((None if i in red else l) for i, l in enumerate(labels) if keep or i not in red)
    ins = tuple((f"r{i}" if i in red else l) for i, l in enumerate(labels))
    return Factors((ins,), (out,), _REDUCE_OP[node.op])

  def split_reduced(self, node):
    # An integer Mean truncates sum/count; partial sums cannot be scaled first, so it reduces unsplit.
    return node.op != "Mean" or not node.outputs[0].dtype.is_integer

  def emit(self, ctx, node, local_inputs, axes_of):
    if node.op != "Mean" or not any(axes_of.get(l) for l in self.factors(node).reduced):
      return ctx.clone(node, {0: local_inputs[0]})
    # Mean = Sum * (1/count) with the global count: the scale is linear, so it commutes with the all-reduce.
    count = math.prod(node.input_shape(0)[i] for i in reduced_axes(node))
    (total,) = ctx.clone(node, {0: local_inputs[0]}, op_type="Sum")
    return [total * tf.constant(1.0 / count, node.outputs[0].dtype)]


@register("All", "Any")
class LogicalReduce(FactorRule):
  """Logical reductions: a split reduced dim reduces locally, then one all-reduce of the (small) result merges the
  shards' with Min (All) or Max (Any) -- the booleans carried as int32, the padding of an uneven split masked with
  the identity (True for All, False for Any). Axes computed at run time keep every dim whole."""

  stacked = "reduction"

  data = (0,)

  def factors(self, node):
    rank = len(node.input_shape(0))
    axes = node.const_input(1)
    labels = dim_labels(rank)
    keep = node.attr("keep_dims")
    if axes is None:
      red = set(range(rank))
      return Factors((unsplit(labels, red),), (tuple(None for _ in labels) if keep else (),))
    red = {int(a) % rank for a in np.atleast_1d(axes)}
    out = tuple((None if i in red else l) for i, l in enumerate(labels) if keep or i not in red)
    ins = tuple((f"r{i}" if i in red else l) for i, l in enumerate(labels))
    return Factors((ins,), (out,), "Min" if node.op == "All" else "Max")


@register("ArgMax", "ArgMin")
class ArgReduce(FactorRule):
  """The other dims pass their split. An operand already split along the reduced dim is not gathered: each
  device finds its shard's winner, and only the winners (value and global index) are all-gathered."""

  stacked = "reduction"

  data = (0,)

  def factors(self, node):
    rank = len(node.input_shape(0))
    axis = const_axis(node, 1, rank)
    labels = dim_labels(rank)
    return Factors((unsplit(labels, {axis}),), (labels[:axis] + labels[axis + 1:],))

  def partition(self, ctx, node):
    shape = node.input_shape(0)
    axis = const_axis(node, 1, len(shape))
    cur = ctx.current(0)
    if axis is None or cur is None or cur.is_maximal or not cur.with_rank(len(shape)).dims[axis]:
      return super().partition(ctx, node)
    cur = cur.with_rank(len(shape))
    target = ctx.target(0)
    out_dims = cur.dims[:axis] + cur.dims[axis + 1:]
    if not target.is_maximal and set(cur.dims[axis]) & set(target.used_axes):
      return super().partition(ctx, node)
    x = ctx.operand(0, cur)
    arg_max = node.op == "ArgMax"
    dtype = x.dtype
    worst = (dtype.min if arg_max else dtype.max) if not dtype.is_floating else (-np.inf if arg_max else np.inf)
    with ctx.helper_scope():
      if shape[axis] % cur.tiles(axis):
        x = ctx.mask(x, shape, cur, axis, worst)
      c = cur.shard_shape(shape)[axis]
      wide = shape[axis] >= 2**31   # the indices travel as int32 where they fit
      index_type = tf.int64 if wide else tf.int32
      local = (tf.argmax if arg_max else tf.argmin)(x, axis, output_type=index_type)
      best = (tf.reduce_max if arg_max else tf.reduce_min)(x, axis)
      offsets = np.array([cur.tile_index(p, axis) * c for p in range(ctx.mesh.size)], index_type.as_numpy_dtype)
      index = local + ctx.lookup(offsets, f"arg_offset_{axis}_{c}")
      why = "each shard's winner along the split reduced dim"
      values = ctx.backend.all_gather(best[None], 0, cur.dims[axis], node.name, why)
      indices = ctx.backend.all_gather(index[None], 0, cur.dims[axis], node.name, why)
      shard = (tf.argmax if arg_max else tf.argmin)(values, 0, output_type=tf.int32)   # first best: lowest index
      pick = tf.one_hot(shard, cur.tiles(axis), axis=0, on_value=True, off_value=False)
      out = tf.reduce_max(tf.where(pick, indices, tf.constant(-1, index_type)), 0)
      out = tf.cast(out, node.attr("output_type") or tf.int64)
    ctx.record(out)
    ctx.set_output(0, out, Sharding(ctx.mesh, out_dims))


@register("TopKV2")
class TopK(FactorRule):
  """Top-k over the last dim: the other dims pass their split. An operand already split along the last dim is not
  gathered: each device takes its shard's top k (values and global indices), only those are all-gathered, and the
  top k of the candidates is the result (ties to the lower index, as TF's kernel: candidates are in index order
  among equal values)."""

  data = (0,)

  def factors(self, node):
    rank = len(node.input_shape(0))
    labels = unsplit(dim_labels(rank), {rank - 1})
    return Factors((labels,), (labels, labels))

  def partition(self, ctx, node):
    shape = node.input_shape(0)
    k = node.const_input(1)
    cur = ctx.current(0)
    last = len(shape) - 1 if shape else None
    if (k is None or last is None or cur is None or cur.is_maximal or not cur.with_rank(len(shape)).dims[last]
        or node.attr("sorted") is False):
      return super().partition(ctx, node)
    cur = cur.with_rank(len(shape))
    axes = cur.dims[last]
    target = ctx.target(0)
    if not target.is_maximal and set(axes) & set(target.used_axes):
      return super().partition(ctx, node)
    k = int(np.asarray(k))
    x = ctx.operand(0, cur)
    dtype = x.dtype
    worst = -np.inf if dtype.is_floating else dtype.min
    c = cur.shard_shape(shape)[last]
    why = "each shard's top k along the split last dim"
    with ctx.helper_scope():
      if shape[last] % cur.tiles(last):
        x = ctx.mask(x, shape, cur, last, worst)
      values, local = tf.math.top_k(x, min(k, c))
      offsets = np.array([cur.tile_index(p, last) * c for p in range(ctx.mesh.size)], np.int64)
      index = tf.cast(local, tf.int64) + ctx.lookup(offsets, f"top_k_offset_{c}")
      lead = list(range(1, len(shape)))

      def candidates(t):   # [tiles, ..., k'] in shard order -> [..., tiles * k']
        t = ctx.backend.all_gather(t[None], 0, axes, node.name, why)
        return tf.reshape(tf.transpose(t, lead + [0, len(shape)]), t.shape[1:-1].as_list() + [-1])

      all_values, all_indices = candidates(values), candidates(index)
      out_values, at = tf.math.top_k(all_values, k)
      out_indices = tf.cast(tf.gather(all_indices, at, batch_dims=len(shape) - 1), node.outputs[1].dtype)
    ctx.record(out_values)
    ctx.record(out_indices)
    dims = cur.dims[:last] + ((),)
    ctx.set_output(0, out_values, Sharding(ctx.mesh, dims))
    ctx.set_output(1, out_indices, Sharding(ctx.mesh, dims))


@register("Cumsum", "Cumprod", "CumulativeLogsumexp")
class Scan(FactorRule):
  """Cumulative ops along a constant axis: the scanned dim is whole on every device, the others pass."""

  stacked = "reduction"

  data = (0,)

  def factors(self, node):
    rank = len(node.outputs[0].shape)
    labels = unsplit(dim_labels(rank), {const_axis(node, 1, rank)})
    return Factors((labels,), (labels,))
