"""Ops that index: one-hot, gather and segment sums.

Gather from a table split along the gathered dim never gathers the table: each device looks up the ids it
owns and one all-reduce combines the rows.
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
