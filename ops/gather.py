"""Lookups of rows by index: GatherV2, ResourceGather (a variable's table), GatherNd, OneHot.

Index dims and the table's other dims pass their split. A table split along the gathered dim (a
vocabulary-split embedding, or a few indices of a split sequence) is not gathered: each device looks up the
ids it owns, zeroes the rows it does not, and one all-reduce sums the rows (a reduce-scatter when the result
is split by the table's axes) -- unless, by bytes, gathering the table would move less. `take_owned` is that
lookup, shared with the slicing rules. Under `batch_dims` (`tf.gather(x, positions, batch_dims=1)`: a masked
language model's head reading its masked tokens) the batch dims of the table and the ids are one factor, split alike,
and the gathered dim stays whole. GatherNd's indexed dims and OneHot's depth dim are whole.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.factors import const_axis, dim_labels, Factors, FactorRule
from tf_gspmd.ops.registry import register
from tf_gspmd.ops.variables import handle_sharding


def take_owned(ctx, x, layout, size, axis, ids):
  """The rows `ids` (global indices along `axis`, a numpy array or a tensor) of `x`, a shard laid out as
  `layout` that splits `axis`, read where this device holds them; and `owned`, shaped like `ids`: which of them
  it holds.

  Rows held elsewhere read a clamped local row, garbage for the caller to replace (with a select, so that no
  NaN or Inf of a foreign row leaks into a sum). Every global row has exactly one owner in each group of the
  axes splitting `axis`, and padding rows are never owned, so the selected results of a group sum to the rows
  themselves: the way a narrowing op (gather, slice, strided slice) of a split dim moves only its result,
  never the operand.
  """
  c = -(-size // layout.tiles(axis))
  dtype = ids.dtype if isinstance(ids, tf.Tensor) else (tf.int32 if size < 2**31 else tf.int64)
  lo = np.array([layout.tile_index(p, axis) * c for p in range(ctx.mesh.size)], dtype.as_numpy_dtype)
  local = tf.cast(ids, dtype) - ctx.lookup(lo, f"offset_{axis}_{c}")
  owned = (local >= 0) & (local < c)
  return tf.gather(x, tf.clip_by_value(local, 0, c - 1), axis=axis), owned


def checked_ids(ids, size, what):
  """`ids` once an Assert has checked that each is in [0, size) (it raises InvalidArgumentError saying `what`).

  TF's ops that index a table (gather, scatter into a variable) raise for such an id on CPU. Split along the
  indexed dim, no device would own the row (or a padding row would), so the partitioned op must check what
  the op checked: the lookup or write waits for the Assert.
  """
  in_range = tf.reduce_all((ids >= 0) & (ids < tf.cast(size, ids.dtype)))
  check = tf.debugging.Assert(in_range, [what + "; got", ids], summarize=16, name="ids_in_range")
  with tf.control_dependencies([check]):
    return tf.identity(ids, name="checked_ids")


@register("GatherV2")
class Gather(FactorRule):
  """params[..., axis, ...][indices]: index dims and params' other dims pass their split.

  When the table is split along the gathered dim (a vocabulary-split embedding), each device looks up the
  ids in its own range (bounds-checked as TF checks them), zeroes the rows it does not own, and one all-reduce sums the rows; the
  generic path (the table whole along that dim) only where it moves fewer bytes.
  """

  stacked = "gather"

  data = (0, 1)

  def _axis(self, node):
    return const_axis(node, 2, len(node.input_shape(0)))

  def factors(self, node):
    p_rank, i_rank = len(node.input_shape(0)), len(node.input_shape(1))
    axis = self._axis(node)
    batch = self._batch_dims(node, i_rank)
    if axis is None or batch is None or batch > axis:
      return Factors(((None,) * p_rank, (None,) * i_rank), ((None,) * len(node.outputs[0].shape),))
    p = tuple(f"p{d}" for d in range(p_rank))
    idx = p[:batch] + tuple(f"i{d}" for d in range(batch, i_rank))   # batch dims: one factor for both
    out = p[:axis] + idx[batch:] + p[axis + 1:]
    # Under batch dims each row looks up in its own table: the gathered dim stays whole (no owned-ids lookup).
    return Factors((p[:axis] + ("v" if not batch else None,) + p[axis + 1:], idx), (out,))

  @staticmethod
  def _batch_dims(node, i_rank):
    """The op's leading dims shared by the table and the ids (`batch_dims`, negative counted from the ids'
    rank), or None when TF's attr is out of range."""
    b = node.attr("batch_dims") or 0
    b = b + i_rank if b < 0 else b
    return b if 0 <= b <= i_rank else None

  def partition(self, ctx, node):
    axis = self._axis(node)
    cur = ctx.current(0)
    v_axes = () if cur is None or cur.is_maximal or axis is None else cur.with_rank(len(node.input_shape(0))).dims[axis]
    target = ctx.target(0)
    dtype = node.outputs[0].dtype
    if not v_axes or node.attr("batch_dims") or target.is_maximal or not (
        dtype.is_floating or dtype.is_integer or dtype == tf.bool):
      return FactorRule.partition(self, ctx, node)   # the table is whole along the gathered dim
    mesh = ctx.mesh
    f = self.factors(node)
    p_labels, i_labels = f.operands
    out_labels = f.outputs[0]
    # The output's other dims follow its layout where that does not use the table's axes; a result wanted
    # split by them is reduce-scattered into place from the partial rows.
    axes_of = {l: target.dims[d] for d, l in enumerate(out_labels) if not set(target.dims[d]) & set(v_axes)}
    params_s = Sharding(mesh, tuple(v_axes if l == "v" else axes_of.get(l, ()) for l in p_labels))
    ids_s = Sharding(mesh, tuple(axes_of.get(l, ()) for l in i_labels))
    natural = Sharding(mesh, tuple(axes_of.get(l, ()) for l in out_labels))
    partial = (v_axes, "Add")
    # GSPMD's choice by bytes: look up where the table is (the result moves), or gather the table along the
    # gathered dim (the generic path), which only pays when the table is smaller than the result.
    data = self.data_inputs(node)
    gathered = min(self._cost(ctx, f, data, plan) for plan in (self._axes_from_target(ctx, node, f, data),
                                                              self._axes_from_operands(ctx, node, f, data)))
    # Constant ids wanted whole are read from the constant itself (not gathered back from their slices).
    const_ids = node.const_input(1) if ids_s.is_replicated else None
    local = ctx.operand_cost(0, params_s) + (0 if const_ids is not None else ctx.operand_cost(1, ids_s)) + \
        ctx.output_cost(0, natural, partial)
    if gathered < local:
      return FactorRule.partition(self, ctx, node)
    params = ctx.operand(0, params_s)
    if const_ids is not None:
      with ctx.helper_scope():
        ids = tf.constant(const_ids, node.input_info(1).dtype, name="ids")
    else:
      ids = ctx.operand(1, ids_s)
    rows = self.masked_lookup(ctx, params, ids, params_s, axis, node.input_shape(0)[axis])
    ctx.set_output(0, rows, natural, partial=partial)

  def masked_lookup(self, ctx, params, ids, params_s, axis, size):
    """Rows of the ids this device owns along `axis` (zeros elsewhere): the partial result of a split table.

    An id outside [0, size) is owned by no device. TF's gather raises InvalidArgumentError for it on CPU (and
    gives zeros on GPU, as the masked rows do), so each device first checks its ids with an Assert the lookup
    waits for: the error TF raises, on every layout, never a clamped row.
    """
    with ctx.helper_scope():
      ids = checked_ids(ids, size, f"gather: indices must be in [0, {size}) (the gathered dim of the table, split "
                        f"over {tuple(params_s.dims[axis])})")
      rows, owned = take_owned(ctx, params, params_s, size, axis, ids)
      mask_shape = [1] * axis + ids.shape.as_list() + [1] * (params.shape.rank - axis - 1)
      return tf.where(tf.reshape(owned, mask_shape), rows, tf.zeros([], rows.dtype))

  def split_reduced(self, node):
    return False   # "v" is not summed: the generic path keeps the gathered dim whole (see partition)


@register("ResourceGather")
class ResourceGather(Gather):
  """table[ids] with the table a variable: like GatherV2 along dim 0, the table never resharded."""

  stacked = None   # (a variable's table: read per device)

  def _axis(self, node):
    return 0

  def _params_shape(self, node):
    return node.input_info(0).value_shape

  def factors(self, node):
    p_rank, i_rank = len(self._params_shape(node)), len(node.input_shape(1))
    p = tuple(f"p{d}" for d in range(p_rank))
    idx = tuple(f"i{d}" for d in range(i_rank))
    return Factors((("v",) + p[1:], idx), (idx + p[1:],))

  def partition(self, ctx, node):
    table = handle_sharding(ctx, node)
    target = ctx.target(0)
    i_rank = len(node.input_shape(1))
    # Index dims follow the output's layout where the table does not already use those mesh axes.
    ids_dims = tuple(() if target.is_maximal or set(target.dims[d]) & set(table.used_axes) else target.dims[d]
                     for d in range(i_rank))
    ids = ctx.operand(1, Sharding(ctx.mesh, ids_dims))
    natural = Sharding(ctx.mesh, ids_dims + table.dims[1:])
    handle = ctx.operand(0, None)
    v_axes = table.dims[0] if table.dims else ()
    if not v_axes:
      (rows,) = ctx.clone(node, {0: handle, 1: ids})
      return ctx.set_output(0, rows, natural)
    size = self._params_shape(node)[0]
    with ctx.helper_scope():
      params = tf.raw_ops.ReadVariableOp(resource=handle, dtype=node.attr("dtype"), name="read")
    rows = self.masked_lookup(ctx, params, ids, table, 0, size)
    ctx.set_output(0, rows, natural, partial=(v_axes, "Add"))


@register("GatherNd")
class GatherNd(FactorRule):
  """params[indices[..., :K]]: indexed params dims whole, trailing params dims and index batch dims pass."""

  def factors(self, node):
    p_rank = len(node.input_shape(0))
    idx = node.input_shape(1)
    k = idx[-1]
    batch = tuple(f"i{d}" for d in range(len(idx) - 1))
    rest = tuple(f"p{d}" for d in range(k, p_rank))
    return Factors(((None,) * k + rest, batch + (None,)), (batch + rest,))


@register("OneHot")
class OneHot(FactorRule):
  """The depth dim is produced whole (sliced afterwards if it should be split); index dims pass."""

  stacked = "one_hot"

  data = (0,)

  def factors(self, node):
    rank = len(node.input_shape(0))
    axis = node.attr("axis")
    axis = rank if axis == -1 else axis
    labels = dim_labels(rank)
    return Factors((labels,), (labels[:axis] + (None,) + labels[axis:],))
