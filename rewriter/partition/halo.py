"""Windowed operands of the partition pass: each device's rows of an operand for a windowed result (a slice, a
pad, a concat, a convolution or pooling window), exchanged with its neighbours as a halo, and the masking of an
unevenly split dimension's padding.

`WindowedOperands` is a part of `partition.PartitionContext`: its methods use the context's `mesh`, `node`,
`lookup`, `current`, `operand` and emission scope.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd.ops import windows
from tf_gspmd.rewriter.graph.graph_view import public_key


class WindowedOperands:
  """Windows of a node's operands (mixed into the partition pass's PartitionContext)."""

  def mask(self, x, shape, sharding, dim, value):
    """Replace the padding of an unevenly split dimension `dim` by `value`."""
    n = sharding.tiles(dim)
    c = -(-shape[dim] // n)
    valid = np.array([min(max(shape[dim] - sharding.tile_index(p, dim) * c, 0), c) for p in range(self.mesh.size)],
                     np.int32)
    with tf.name_scope(self._scope()):
      count = self.lookup(valid, f"valid_{dim}_{c}")
      keep = tf.range(c) < count
      bshape = [1] * len(shape)
      bshape[dim] = c
      return tf.where(tf.reshape(keep, bshape), x, tf.constant(value, x.dtype))

  def window(self, i, sharding, dim, out_size, start, fill, stride=1, size=1):
    """Input i re-split along `dim` for a windowed result of `out_size` rows split like `sharding` on `dim`.

    Result row j reads the input's rows [start + j*stride, start + j*stride + size): a slice, pad or concat
    reads one row per result row (stride 1, size 1); a convolution or pooling window reads its dilated
    window size at its stride (`start` = -padding before). The device of shard index t computes result rows
    [t*c, (t+1)*c) (c the result's shard size), so it gets input rows [start + t*c*stride, ...) of length
    (c-1)*stride + size (GSPMD's windowed input). Returns None when a window reaches past a neighbour (the
    caller then gathers instead); see `window_rows`.
    """
    rows = self.rows_read(i, sharding, dim, out_size, start, stride, size)
    return self.window_rows(i, sharding, dim, *rows, fill)

  def window_fits(self, i, sharding, dim, out_size, start, stride=1, size=1):
    """Whether `window` can serve input i from neighbours only (no emission)."""
    rows = self.rows_read(i, sharding, dim, out_size, start, stride, size)
    return self._window_plan(i, sharding, dim, rows)[1] is not None

  def window_rows(self, i, sharding, dim, first, length, lo, hi, fill):
    """Input i with rows [first[t], first[t] + length) along `dim` on the device of shard index t.

    `first`, `lo`, `hi` are indexed by shard index. Rows outside [lo[t], hi[t]) (outside the input, padding of
    uneven shards, rows read only by results in the result's padding) are *selected* to `fill` (so a
    neighbour's inf or NaN never leaks into a result). The input is first laid out as `sharding`, then each
    device takes the rows it lacks from its neighbours (one halo exchange sized by the largest need, which
    may differ between devices) and slices its window at a per-device offset (`windows.plan_halo`). Returns
    None when a device needs rows past its neighbours' shards.
    """
    rows = windows.Rows(np.asarray(first), length, np.asarray(lo), np.asarray(hi))
    r, plan, shift = self._window_plan(i, sharding, dim, rows)
    if plan is None:
      return None
    # A window is cached like a reshard: a gradient reading the forward op's window (a filter gradient) reuses
    # its halos instead of exchanging them again.
    key = (self.node.inputs[i], sharding.with_rank(len(self.node.input_info(i).shape)), dim,
           tuple(rows.first.tolist()), length, tuple(rows.lo.tolist()), tuple(rows.hi.tolist()),
           repr(np.asarray(fill).item()))
    if key not in self._windows:
      self._windows[key] = self._emit_window(i, r, plan, fill, shift, rows)
    return self._windows[key]

  def _window_plan(self, i, sharding, dim, rows):
    """(tensor, `windows.HaloPlan` of it, `windows.Shift` or None) for windows `rows` of input i: of the
    deferred op's source when input i is one whose shift is along `dim` and the window fits there, else of
    input i (plan None when it does not fit)."""
    r = self.node.inputs[i]
    rank = len(self.node.input_info(i).shape)
    if r in self._deferred:
      shift = self._deferred[r][0]
      if shift.dim == dim and not any(sharding.with_rank(rank).dims[k] for k in shift.local_dims):
        src = shift.source
        plan = windows.plan_halo(self.ir.info(src).shape, self.values[src][1], sharding, dim, shift.rows(rows))
        if plan is not None:
          return src, plan, shift
    return r, self._halo_plan(i, sharding, dim, rows), None

  def _emit_window(self, i, r, plan, fill, shift, rows):
    """Emit `plan` (a `windows.HaloPlan` of tensor r, input i or the source of its `shift`): reshard, halo
    exchange, per-device cut, fill select (then, through a shift, the deferred op's own fill and other dims)."""
    dim, length = plan.dim, plan.rows.length
    what = f"operand {i} of {self.node.name} ({self.node.op})"
    if shift is not None:
      node = self._deferred[self.node.inputs[i]][2]
      what += f" through {node.name} ({node.op})"
    x = self._operand_of(r, plan.source, what)
    with tf.name_scope(self._scope()):
      via = "" if shift is None else f" of {public_key(r)} (through {node.name} ({node.op}))"
      x = self._halo_take(x, plan, fill if shift is None else shift.fill, via)
      if shift is None:
        return x
      if repr(np.asarray(shift.fill).item()) != repr(np.asarray(fill).item()):
        # rows no result reads take the reader's fill, not the deferred op's
        wanted = windows.HaloPlan(plan.shape, dim, rows, plan.tiles, plan.own, 0, 0, (), plan.source).valid()
        x = self._keep(x, wanted, len(plan.shape), dim, length, fill)
      return shift.local(x)

  def _halo_take(self, x, plan, fill, via=""):
    """`x` (laid out as `plan.source`) with its halos along `plan.dim` exchanged, cut to each device's window and
    the rows that do not matter set to `fill`."""
    dim, length = plan.dim, plan.rows.length
    if plan.left or plan.right:
      x = self.backend.halo_exchange(x, dim, plan.axes, plan.left, plan.right, self.node.name,
                                     f"{self.node.name} ({self.node.op}) moves its window{via} along dim {dim}")
    x = self._take(x, dim, plan.offsets(), length, f"window_{dim}_{length}")
    return self._keep(x, plan.valid(), len(plan.shape), dim, length, fill)

  def windows(self, i, sharding, reads, fill):
    """Input i windowed along several split dims: `reads`, [(dim, `windows.Rows`)] in order. The first dim's
    window is `window_rows`'s; each next dim's halos are exchanged on the tensor already extended along the dims
    before it, so a device's corner rows arrive with that exchange (one dim after the other, as XLA does).
    Returns None when a window reaches past a neighbour's shard along some dim."""
    if not self.windows_fit(i, sharding, reads):
      return None
    (d0, rows0), rest = reads[0], reads[1:]
    x = self.window_rows(i, sharding, d0, *rows0, fill)
    shape = self.node.input_info(i).shape
    with tf.name_scope(self._scope()):
      for d, rows in rest:
        x = self._halo_take(x, windows.plan_halo(shape, sharding, sharding, d, windows.Rows(*rows)), fill)
    return x

  def windows_fit(self, i, sharding, reads):
    """Whether `windows` can serve input i from neighbours only (no emission)."""
    (d0, rows0), rest = reads[0], reads[1:]
    shape = self.node.input_info(i).shape
    return self.window_rows_fit(i, sharding, d0, *rows0) and all(
        windows.plan_halo(shape, sharding, sharding, d, windows.Rows(*rows)) is not None for d, rows in rest)

  def _keep(self, x, valid, rank, dim, length, fill):
    """`x` with the window rows that are not `valid` (per device and row; None: all are) set to `fill`."""
    if valid is None:
      return x
    keep = self.lookup(valid, f"window_valid_{dim}_{length}")
    bshape = [1] * rank
    bshape[dim] = length
    return tf.where(tf.reshape(keep, bshape), x, tf.constant(fill, x.dtype))

  def window_rows_fit(self, i, sharding, dim, first, length, lo, hi):
    """Whether `window_rows` can serve input i from neighbours only (no emission)."""
    return self._window_plan(i, sharding, dim, windows.Rows(first, length, lo, hi))[1] is not None

  def window_bytes(self, i, sharding, dim, out_size, start, stride=1, size=1):
    """Bytes per device that `window` moves (resharding input i to the layout it reads, then its halos); None
    when the window does not fit (the caller weighs it against other ways to compute the same result)."""
    r, plan, _ = self._window_plan(i, sharding, dim, self.rows_read(i, sharding, dim, out_size, start, stride, size))
    if plan is None:
      return None
    return self._cost_of(r, plan.source) + plan.halo_elements() * self.input_dtype(i).size

  def take_rows(self, x, sharding, dim, begin, count):
    """Rows [begin[t], begin[t] + count) along `dim` of the local `x` on the device of shard index t (rows
    before or past x's ends read 0): a local slice at a per-device offset, no communication."""
    tiles = np.array([sharding.tile_index(p, dim) for p in range(self.mesh.size)])
    with tf.name_scope(self._scope()):
      return self._take(x, dim, np.asarray(begin)[tiles].astype(np.int32), count, f"rows_{dim}_{count}")

  def rows_read(self, i, sharding, dim, out_size, start, stride=1, size=1):
    """The `windows.Rows` of input i a result of `out_size` rows split like `sharding` on `dim` reads."""
    return windows.rows_read_by(self.node.input_info(i).shape[dim], sharding.tiles(dim), out_size, start, stride,
                                size)

  def _halo_plan(self, i, sharding, dim, rows):
    """The `windows.HaloPlan` for windows `rows` of input i, as it is laid out now; None when it does not fit."""
    return windows.plan_halo(self.node.input_info(i).shape, self.current(i), sharding, dim, rows)

  def _take(self, x, dim, offset, count, name):
    """`x`'s rows [offset[p], offset[p] + count) along `dim` on device p, zero-padded where they leave x."""
    front, back, offset = windows.take_bounds(offset, count, x.shape[dim])
    if front or back:
      pads = [[0, 0] for _ in range(x.shape.rank)]
      pads[dim] = [front, back]
      x = tf.pad(x, pads)
    if x.shape[dim] == count:
      return x
    begin = np.zeros((self.mesh.size, x.shape.rank), np.int32)
    begin[:, dim] = offset
    size = x.shape.as_list()
    size[dim] = count
    return tf.slice(x, self.lookup(begin, name), size)
