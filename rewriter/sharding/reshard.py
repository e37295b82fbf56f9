"""Resharding: plan pure steps from one layout to another, then emit them.

Legal moves used here: all-reduce of partial results, all-gather of the minor mesh axes of a dimension,
local slicing of a replicated (or coarser) dimension, removal of padding after a full gather, and
all-to-all where a split moves from one dimension to another, and reduce-scatter where partial results
are wanted split. An
uneven dimension whose shards would not line up after a partial gather is gathered whole and re-sliced.

An all-to-all serves uneven dimensions too (GShard's dispatch with fewer experts or groups than devices): the
dimension that becomes split is padded to a whole number of chunks per member before the exchange, the one
that becomes whole loses the padding its last shards carried after it. It still sends at most what the gather
it replaces would: the local shard, its newly split dimension padded by less than one chunk per member.
"""

import dataclasses
import math
from typing import Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding


@dataclasses.dataclass(frozen=True)
class AllReduce:
  axes: Tuple[str, ...]
  op: str


@dataclasses.dataclass(frozen=True)
class AllGather:
  dim: int
  axes: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class AllGatherDims:
  """All-gathers of several dims (`parts`: (dim, axes) each) as one collective over all their axes."""
  parts: Tuple[Tuple[int, Tuple[str, ...]], ...]

  @property
  def axes(self):
    return tuple(a for _, axes in self.parts for a in axes)


@dataclasses.dataclass(frozen=True)
class Unpad:
  dim: int
  size: int


@dataclasses.dataclass(frozen=True)
class LocalSlice:
  dim: int
  axes: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ReduceScatter:
  """Combine partial results over `axes` and keep this device's slice of dim `dim` (split by `axes`)."""
  dim: int
  axes: Tuple[str, ...]
  op: str


@dataclasses.dataclass(frozen=True)
class AllToAll:
  """Move the split by `axes` from dim `src` (gathered) to dim `dst` (split): one all-to-all."""
  src: int
  dst: int
  axes: Tuple[str, ...]


def _tiles(mesh, axes):
  return math.prod(mesh.axis_size(a) for a in axes)


def _ceil(a, b):
  return -(-a // b)


def _aligned(mesh, size, outer, inner):
  """True when splitting the `outer` shards further by `inner` axes keeps every shard inside its parent."""
  return not outer or _ceil(size, _tiles(mesh, outer)) == _tiles(mesh, inner) * _ceil(size, _tiles(mesh, outer + inner))


def plan_reshard(shape, src, dst, partial=None):
  """Steps that turn a value laid out as `src` (plus pending `partial` = (axes, op)) into `dst`."""
  mesh = dst.mesh
  rank = len(shape)
  src = src.tiled(rank)
  dst = dst.tiled(rank)
  steps = []
  if partial:
    steps.append(AllReduce(tuple(partial[0]), partial[1]))
  cur = list(src.dims)
  for d in range(rank):
    s, t = cur[d], dst.dims[d]
    common = 0
    while common < min(len(s), len(t)) and s[common] == t[common]:
      common += 1
    keep = s[:common]
    if common < len(s) or not _aligned(mesh, shape[d], keep, t[common:]):
      if not _aligned(mesh, shape[d], keep, s[common:]) or not _aligned(mesh, shape[d], keep, t[common:]):
        keep = ()
      steps.append(AllGather(d, s[len(keep):]))
      if not keep and shape[d] % _tiles(mesh, s):
        steps.append(Unpad(d, shape[d]))
      cur[d] = keep
  for d in range(rank):
    if len(dst.dims[d]) > len(cur[d]):
      steps.append(LocalSlice(d, dst.dims[d][len(cur[d]):]))
  return _fuse_gathers(_slice_before_reducing(
      _fuse_all_to_all(_fuse_reduce_scatter(steps, shape, mesh, src), shape, mesh, src), src))


def _fuse_gathers(steps):
  """All-gathers of different dims one after the other are one all-gather over their axes together: each member's
  shard arrives once, where gathering dim by dim also sends the first gathers' results again."""
  out, run = [], []
  def flush():
    gathers = [st for st in run if isinstance(st, AllGather)]
    if len(gathers) > 1:
      out.append(AllGatherDims(tuple((g.dim, g.axes) for g in gathers)))
      out.extend(st for st in run if isinstance(st, Unpad))
    else:
      out.extend(run)
    run.clear()
  for st in steps:
    if isinstance(st, AllGather) and all(g.dim != st.dim for g in run):
      run.append(st)
    elif isinstance(st, Unpad) and run:
      run.append(st)
    else:
      flush()
      out.append(st)
  flush()
  return out


def _slice_before_reducing(steps, src):
  """A partial value is equal on the devices its pending reduction does not span, so a local slice by axes the
  value does not use can come first: the all-reduce then carries only the slice (a gradient summed over `data`
  kept split over `model`: its shard, not the whole value)."""
  if not steps or not isinstance(steps[0], AllReduce):
    return steps
  red = steps[0]
  used = set(red.axes) | {a for axes in src.dims for a in axes}   # (an axis a gather frees is free only after it)
  early, rest, moved_dims = [], [], set()
  for st in steps[1:]:
    if isinstance(st, LocalSlice) and st.dim not in moved_dims and not set(st.axes) & used:
      early.append(st)
    else:
      rest.append(st)
      moved_dims.update(d for d in (getattr(st, "dim", None), getattr(st, "src", None), getattr(st, "dst", None))
                        if d is not None)
  return early + [red] + rest if early else steps


def _fuse_reduce_scatter(steps, shape, mesh, src):
  """All-reduce of partial results followed by a local slice by the same axes is one reduce-scatter."""
  if not steps or not isinstance(steps[0], AllReduce):
    return steps
  red = steps[0]
  for j, sl in enumerate(steps):
    if isinstance(sl, LocalSlice) and sl.axes[:len(red.axes)] == red.axes:
      prefix = _prefix_before(steps, j, src)
      if shape[sl.dim] % _tiles(mesh, prefix + sl.axes):
        continue
      rest = sl.axes[len(red.axes):]
      fused = [ReduceScatter(sl.dim, red.axes, red.op)] + ([LocalSlice(sl.dim, rest)] if rest else [])
      return steps[1:j] + fused + steps[j + 1:]
  return steps


def _fuse_all_to_all(steps, shape, mesh, src):
  """An all-gather of axes A on one dim plus a local slice by A on another is one all-to-all of A.

  It moves 1/|A| of the data instead of gathering it all. A fusion is kept only if the whole plan stays
  valid step by step (A is the minor split of the source dim when it moves) and both dims stay aligned
  (no padding would cross a shard boundary). The gather's removal of padding goes with it: the all-to-all
  drops the padding of the dim it gathers itself.
  """
  plan = list(steps)
  k = 0
  while k < len(plan):
    g = plan[k]
    if isinstance(g, AllGather):
      for j, sl in enumerate(plan):
        if isinstance(sl, LocalSlice) and sl.dim != g.dim and sl.axes[:len(g.axes)] == g.axes:
          rest = sl.axes[len(g.axes):]
          unpad = [i for i, x in enumerate(plan) if isinstance(x, Unpad) and x.dim == g.dim and i > k][:1]
          first_slice = next(i for i, x in enumerate(plan) if isinstance(x, LocalSlice))
          dropped = [k, j] + unpad
          others = [x for i, x in enumerate(plan) if i not in dropped]
          pos = first_slice - sum(1 for i in dropped if i < first_slice)
          # Where the slices began, else earlier (before a reduce-scatter that would cover the moving split).
          for at in [pos] + [p for p in range(pos - 1, -1, -1)]:
            trial = others[:at] + [AllToAll(g.dim, sl.dim, g.axes)] + (
                [LocalSlice(sl.dim, rest)] if rest else []) + others[at:]
            if _valid(trial, shape, mesh, src):
              plan = trial
              k = -1
              break
          break
    k += 1
  return plan


def _valid(steps, shape, mesh, src):
  """Simulate `steps`: every move removes a minor split, every slice and all-to-all keeps its dims aligned (a
  new split cuts each existing shard into whole chunks), and a reduce-scatter's dim divides evenly."""
  cur = list(src.dims)
  for st in steps:
    if isinstance(st, AllGather):
      if cur[st.dim][len(cur[st.dim]) - len(st.axes):] != st.axes:
        return False
      cur[st.dim] = cur[st.dim][:len(cur[st.dim]) - len(st.axes)]
    elif isinstance(st, LocalSlice):
      if not _aligned(mesh, shape[st.dim], cur[st.dim], st.axes):
        return False
      cur[st.dim] = cur[st.dim] + st.axes
    elif isinstance(st, ReduceScatter):
      cur[st.dim] = cur[st.dim] + st.axes
      if shape[st.dim] % _tiles(mesh, cur[st.dim]):
        return False
    elif isinstance(st, AllToAll):
      moving = cur[st.src][len(cur[st.src]) - len(st.axes):]
      kept = cur[st.src][:len(cur[st.src]) - len(st.axes)]
      if (moving != st.axes or not _aligned(mesh, shape[st.src], kept, st.axes)
          or not _aligned(mesh, shape[st.dst], cur[st.dst], st.axes)):
        return False
      cur[st.src] = kept
      cur[st.dst] = cur[st.dst] + st.axes
  return True


def _all_to_all_shape(shape, mesh, cur, step):
  """The local shape an all-to-all `step` sends from layout dims `cur`: the shard, its dim `step.dst` padded to
  a whole chunk per member of the group."""
  local = [_ceil(shape[d], _tiles(mesh, cur[d])) for d in range(len(shape))]
  local[step.dst] = _tiles(mesh, step.axes) * _ceil(shape[step.dst], _tiles(mesh, cur[step.dst] + step.axes))
  return local


def plan_bytes(shape, itemsize, src, dst, partial=None):
  """Bytes per device the reshard `src` -> `dst` puts on the wire (the report's convention)."""
  return plan_cost(shape, itemsize, src, dst, partial)[0]


def plan_cost(shape, itemsize, src, dst, partial=None, axis_cost=None):
  """(bytes per device, the same weighted per step by the costliest mesh axis it crosses in `axis_cost`,
  {axis: relative time per byte}, default 1.0) of the reshard `src` -> `dst`."""
  mesh = dst.mesh
  rank = len(shape)
  cur = list(src.tiled(rank).dims)
  axis_cost = axis_cost or {}

  def local():
    return math.prod(_ceil(shape[d], _tiles(mesh, cur[d])) for d in range(rank)) * itemsize

  total = weighted = 0
  for step in plan_reshard(shape, src, dst, partial):
    moved = 0
    if isinstance(step, AllReduce):
      moved = local()
    elif isinstance(step, AllGather):   # every member's shard, padding included (removed only after)
      moved = local() * _tiles(mesh, step.axes)
      cur[step.dim] = cur[step.dim][:len(cur[step.dim]) - len(step.axes)]
    elif isinstance(step, AllGatherDims):
      moved = local() * _tiles(mesh, step.axes)
      for d, axes in step.parts:
        cur[d] = cur[d][:len(cur[d]) - len(axes)]
    elif isinstance(step, LocalSlice):
      cur[step.dim] = cur[step.dim] + step.axes
    elif isinstance(step, AllToAll):
      moved = math.prod(_all_to_all_shape(shape, mesh, cur, step)) * itemsize
      cur[step.src] = cur[step.src][:len(cur[step.src]) - len(step.axes)]
      cur[step.dst] = cur[step.dst] + step.axes
    elif isinstance(step, ReduceScatter):
      moved = local()
      cur[step.dim] = cur[step.dim] + step.axes
    if moved:
      total += moved
      weighted += moved * max(axis_cost.get(a, 1.0) for a in step.axes)
  return total, weighted


def emit_reshard(ctx, x, shape, src, dst, partial, source, reason):
  """Emit the planned steps on local value `x` (global shape `shape`); returns the local value in `dst`."""
  mesh = dst.mesh
  rank = len(shape)
  cur = list(src.tiled(rank).dims)
  steps = plan_reshard(shape, src, dst, partial)
  if steps:
    ctx.report.reshard(source, src, dst, [type(s).__name__ for s in steps])
  for step in steps:
    if isinstance(step, AllReduce):
      x = ctx.backend.all_reduce(x, step.axes, step.op, source, reason)
    elif isinstance(step, AllGather):
      x = ctx.backend.all_gather(x, step.dim, step.axes, source, reason)
      cur[step.dim] = cur[step.dim][:len(cur[step.dim]) - len(step.axes)]
    elif isinstance(step, AllGatherDims):
      x = _all_gather_dims(ctx, x, step, source, reason)
      for d, axes in step.parts:
        cur[d] = cur[d][:len(cur[d]) - len(axes)]
    elif isinstance(step, Unpad):
      begin = [0] * rank
      size = [-1] * rank
      size[step.dim] = step.size
      x = tf.slice(x, begin, size)
    elif isinstance(step, LocalSlice):
      x = _local_slice(ctx, x, shape, cur, step)
      cur[step.dim] = cur[step.dim] + step.axes
    elif isinstance(step, ReduceScatter):
      x = ctx.backend.reduce_scatter(x, step.dim, step.axes, step.op, source, reason)
      cur[step.dim] = cur[step.dim] + step.axes
    elif isinstance(step, AllToAll):
      x = _all_to_all(ctx, x, shape, cur, step, source, reason)
      cur[step.src] = cur[step.src][:len(cur[step.src]) - len(step.axes)]
      cur[step.dst] = cur[step.dst] + step.axes
  return x


def _all_gather_dims(ctx, x, step, source, reason):
  """One all-gather `step` of several dims: the shards gathered along a new leading dim over all the axes (the
  first part's axes major), then each dim's pieces put in place."""
  local = x.shape.as_list()
  tiles = [_tiles(ctx.mesh, axes) for _, axes in step.parts]
  g = ctx.backend.all_gather(tf.expand_dims(x, 0), 0, step.axes, source, reason)
  g = tf.reshape(g, tiles + local)   # [t_1, .., t_k, local dims]
  k, rank = len(tiles), len(local)
  where = {d: j for j, (d, _) in enumerate(step.parts)}
  perm = []
  for d in range(rank):
    if d in where:
      perm.append(where[d])   # the dim's tile index just before its local rows
    perm.append(k + d)
  shape = [local[d] * (tiles[where[d]] if d in where else 1) for d in range(rank)]
  return tf.reshape(tf.transpose(g, perm), shape)


def _all_to_all(ctx, x, shape, cur, step, source, reason):
  """One all-to-all `step` on local value `x` laid out by dims `cur`, uneven dims included.

  1. Pad dim `step.dst` to a whole chunk per member (zeros past the global end: the padding its shards hold).
  2. Exchange: chunk k of `dst` goes to member k, what arrives is concatenated along `src` in mesh order.
  3. Cut `src` to its shard size under the split that remains: the members' padding past the end goes.
  """
  local = x.shape.as_list()
  sent = _all_to_all_shape(shape, ctx.mesh, cur, step)
  if local[step.dst] < sent[step.dst]:
    pads = [[0, 0] for _ in local]
    pads[step.dst][1] = sent[step.dst] - local[step.dst]
    x = tf.pad(x, pads)
  x = ctx.backend.all_to_all(x, step.src, step.dst, step.axes, source, reason)
  kept = _ceil(shape[step.src], _tiles(ctx.mesh, cur[step.src][:len(cur[step.src]) - len(step.axes)]))
  if x.shape[step.src] > kept:
    size = [-1] * len(local)
    size[step.src] = kept
    x = tf.slice(x, [0] * len(local), size)
  return x


def _local_slice(ctx, x, shape, cur, step):
  """Keep this device's part of dimension `step.dim` when `step.axes` newly split it (no communication)."""
  mesh = ctx.mesh
  d = step.dim
  new_axes = cur[d] + step.axes
  n_new = _tiles(mesh, step.axes)
  c_new = _ceil(shape[d], _tiles(mesh, new_axes))
  local = list(x.shape.as_list())
  if local[d] < n_new * c_new:
    pads = [[0, 0] for _ in local]
    pads[d][1] = n_new * c_new - local[d]
    x = tf.pad(x, pads)
  begin = np.zeros((mesh.size, len(local)), np.int32)
  inner = Sharding(mesh, tuple(step.axes if k == d else () for k in range(len(local))))
  for p in range(mesh.size):
    begin[p, d] = inner.tile_index(p, d) * c_new
  size = list(local)
  size[d] = c_new
  return tf.slice(x, ctx.lookup(begin, f"slice_begin_{d}_{'_'.join(step.axes)}_{c_new}"), size)


def _prefix_before(steps, j, src):
  """Axes of dim `steps[j].dim` just before step j runs (after the gathers planned before it)."""
  d = steps[j].dim
  axes = src.dims[d]
  for x in steps[:j]:
    if isinstance(x, AllGather) and x.dim == d:
      axes = axes[:len(axes) - len(x.axes)]
  return axes
