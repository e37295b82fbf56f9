"""Writes and sums of rows at indexed positions: ScatterNd, TensorScatter*, Inplace{Update,Add,Sub},
ResourceScatter* (into a variable), UnsortedSegmentSum.

ScatterNd and UnsortedSegmentSum sum rows into a zero tensor: the update rows are summed factors (partial
sums + one all-reduce when split), the indexed output dims are whole, trailing dims pass. TensorScatter*
start from an existing tensor, so their update rows are whole on every device. A variable split along its
first dim takes on each device only the updates of the rows it owns; nothing is communicated.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.gather import checked_ids
from tf_gspmd.ops.registry import register
from tf_gspmd.ops.variables import handle_sharding, value_labels


@register("ScatterNd")
class ScatterNd(FactorRule):
  """scatter_nd(indices[r..., K], updates[r..., rest], shape): r summed, rest pass."""

  data = (0, 1)

  def factors(self, node):
    idx = node.input_shape(0)
    k = idx[-1]
    r = tuple(f"r{i}" for i in range(len(idx) - 1))
    rest = tuple(f"d{i}" for i in range(k, len(node.outputs[0].shape)))
    return Factors((r + (None,), r + rest), ((None,) * k + rest,))

  def emit(self, ctx, node, local_inputs, axes_of):
    shape = self.local_shape_input(ctx, node, axes_of, 2)
    return ctx.clone(node, {0: local_inputs[0], 1: local_inputs[1], 2: shape})


@register("TensorScatterUpdate", "TensorScatterAdd", "TensorScatterSub", "TensorScatterMax", "TensorScatterMin")
class TensorScatter(FactorRule):
  """tensor with rows replaced/combined: indexed dims and update rows whole, trailing dims pass."""

  def factors(self, node):
    idx = node.input_shape(1)
    k = idx[-1]
    rank = len(node.outputs[0].shape)
    rest = tuple(f"d{i}" for i in range(k, rank))
    t = (None,) * k + rest
    return Factors((t, (None,) * len(idx), (None,) * (len(idx) - 1) + rest), (t,))


@register("InplaceUpdate", "InplaceAdd", "InplaceSub")
class Inplace(FactorRule):
  """x[i] = v, x[i] += v, x[i] -= v along dim 0 (the step accumulators of Lingvo's Recurrent): like a
  TensorScatter with one indexed dim, the rows of x and v are whole, the other dims pass their split."""

  def factors(self, node):
    rest = tuple(f"d{k}" for k in range(1, len(node.outputs[0].shape)))
    t = (None,) + rest
    return Factors((t, (None,) * len(node.input_shape(1)), (None,) + rest), (t,))


@register("UnsortedSegmentSum")
class UnsortedSegmentSum(FactorRule):
  """data[ids..., rest] -> out[segments, rest]: id dims are summed (partial sums + all-reduce), rest pass."""

  data = (0, 1)

  def factors(self, node):
    rank = len(node.input_shape(0))
    k = len(node.input_shape(1))
    ids = tuple(f"r{i}" for i in range(k))
    rest = tuple(f"d{i}" for i in range(k, rank))
    return Factors((ids + rest, ids), ((None,) + rest,))


# var[ids] (op)= updates, for a variable split along its first dim: each device folds the updates of the rows it
# owns into one dense delta (the ids of other rows map to the dropped segment -1) and combines it locally.
_SCATTER_COMBINE = {
    "ResourceScatterAdd": (tf.math.unsorted_segment_sum, lambda old, d, hit: old + d),
    "ResourceScatterSub": (tf.math.unsorted_segment_sum, lambda old, d, hit: old - d),
    "ResourceScatterMul": (tf.math.unsorted_segment_prod, lambda old, d, hit: old * d),
    "ResourceScatterDiv": (tf.math.unsorted_segment_prod, lambda old, d, hit: old / d),
    "ResourceScatterMin": (tf.math.unsorted_segment_min, lambda old, d, hit: tf.minimum(old, d)),
    "ResourceScatterMax": (tf.math.unsorted_segment_max, lambda old, d, hit: tf.maximum(old, d)),
    "ResourceScatterUpdate": (tf.math.unsorted_segment_max, lambda old, d, hit: tf.where(hit, d, old)),
}


@register(*_SCATTER_COMBINE)
class ResourceScatter(FactorRule):
  """var[ids] op= updates: the variable's other dims pass their split to the updates; ids are replicated.

  A variable split along its first dim takes on each device only the updates of its own rows (masked, summed
  per row into a dense local delta); nothing is communicated. Ids are checked as TF checks them (`checked_ids`):
  one outside the variable raises, never dropped.
  """

  priority = 0

  def factors(self, node):
    labels = value_labels(node)
    ids = tuple(f"i{k}" for k in range(len(node.input_shape(1))))
    return Factors((labels, ids, ids + labels[1:]), ())

  def partition(self, ctx, node):
    layout = handle_sharding(ctx, node)
    k = len(node.input_shape(1))
    handle = ctx.operand(0, None)
    ids = ctx.operand(1, Sharding(ctx.mesh))
    updates = ctx.operand(2, Sharding(ctx.mesh, ((),) * k + layout.dims[1:]))
    if not layout.dims or not layout.dims[0]:
      ctx.clone(node, {0: handle, 1: ids, 2: updates})
      return
    size = node.input_info(0).value_shape[0]
    c = -(-size // layout.tiles(0))
    lo = np.array([layout.tile_index(p, 0) * c for p in range(ctx.mesh.size)], ids.dtype.as_numpy_dtype)
    segment, combine = _SCATTER_COMBINE[node.op]
    dtype = node.attr("dtype")
    with ctx.helper_scope(), ctx.after_control_inputs():
      ids = checked_ids(ids, size, f"{node.op}: indices must be in [0, {size}) (the first dim of the variable, "
                        f"split over {tuple(layout.dims[0])})")
      local = tf.reshape(ids, [-1]) - ctx.lookup(lo, f"row_offset_{c}")
      local = tf.where((local >= 0) & (local < c), local, -tf.ones_like(local))
      flat = tf.reshape(updates, [-1] + updates.shape.as_list()[k:])
      delta = segment(flat, local, c)
      hit = tf.math.unsorted_segment_max(tf.ones_like(local), local, c) > 0
      hit = tf.reshape(hit, [c] + [1] * (flat.shape.rank - 1))
      old = tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
      new = tf.where(hit, combine(old, delta, hit), old)
    ctx.record(tf.raw_ops.AssignVariableOp(resource=handle, value=new, name=node.name))
