"""Resharding: plan pure steps from one layout to another, then emit them.

Legal moves used here: all-reduce of partial results, all-gather of the minor mesh axes of a dimension,
local slicing of a replicated (or coarser) dimension, and removal of padding after a full gather. An
uneven dimension whose shards would not line up after a partial gather is gathered whole and re-sliced.
"""

import dataclasses
import math
from typing import Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd._sharding import Sharding


@dataclasses.dataclass(frozen=True)
class AllReduce:
  axes: Tuple[str, ...]
  op: str


@dataclasses.dataclass(frozen=True)
class AllGather:
  dim: int
  axes: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Unpad:
  dim: int
  size: int


@dataclasses.dataclass(frozen=True)
class LocalSlice:
  dim: int
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
  src = Sharding(mesh, ((),) * rank) if src.is_maximal else src.with_rank(rank)
  dst = Sharding(mesh, ((),) * rank) if dst.is_maximal else dst.with_rank(rank)
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
  return steps


def emit_reshard(ctx, x, shape, src, dst, partial, source, reason):
  """Emit the planned steps on local value `x` (global shape `shape`); returns the local value in `dst`."""
  mesh = dst.mesh
  rank = len(shape)
  cur = list((Sharding(mesh, ((),) * rank) if src.is_maximal else src.with_rank(rank)).dims)
  steps = plan_reshard(shape, src, dst, partial)
  if steps:
    ctx.report.reshards.append((source, str(src), str(dst), tuple(type(s).__name__ for s in steps)))
  for step in steps:
    if isinstance(step, AllReduce):
      x = ctx.backend.all_reduce(x, step.axes, step.op, source, reason)
    elif isinstance(step, AllGather):
      x = ctx.backend.all_gather(x, step.dim, step.axes, source, reason)
      cur[step.dim] = cur[step.dim][:len(cur[step.dim]) - len(step.axes)]
    elif isinstance(step, Unpad):
      begin = [0] * rank
      size = [-1] * rank
      size[step.dim] = step.size
      x = tf.slice(x, begin, size)
    elif isinstance(step, LocalSlice):
      x = _local_slice(ctx, x, shape, cur, step)
      cur[step.dim] = cur[step.dim] + step.axes
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
