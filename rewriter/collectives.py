"""The one module that builds collective ops. CPU, GPU, TPU and multi-worker differ only here.

Groups are sets of mesh devices that differ only along some mesh axes. Every device runs the same
program, so per-device values (group key, permutation) are read from constant tables indexed by the
partition id. Group keys derive from the member device names (the same in every process); instance keys
come from one process-wide counter, so every program gets fresh, deterministic keys. No collective hangs:
the runtime aborts a program's collectives past its deadline (DeadlineExceededError). The ops' own
`timeout_seconds` stays 0 on purpose: TF starts a timer thread per collective per device for it.
"""

import dataclasses
import itertools
import math
import threading
from typing import Optional, Tuple
import zlib

import numpy as np
import tensorflow as tf

from tf_gspmd.errors import PartitionError
from tf_gspmd.rewriter.report import CollectiveRecord

# The collective vocabulary. Passes ask here which op types are collectives instead of keeping lists.
EMITTED_OPS = frozenset({"CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2"})   # what Backend builds
TF_COLLECTIVE_OPS = EMITTED_OPS | frozenset({   # every TF collective op type (a program may hold only ours)
    "CollectiveReduceScatterV2", "CollectiveBcastSendV2", "CollectiveBcastRecvV2", "CollectiveReduceV3",
    "CollectiveAllToAllV3", "CollectiveReduce", "CollectiveGather", "CollectiveBcastSend", "CollectiveBcastRecv"})
# The collectives XLA compiles: TF 2.21's tf2xla registers an XLA kernel (XLA_CPU_JIT, XLA_GPU_JIT) for
# CollectiveReduceV2 only, which sums or multiplies (`lowered_by_xla`); gathers, all-to-alls and broadcasts
# have none and run outside XLA.
XLA_LOWERED = frozenset({"CollectiveReduceV2"})


@dataclasses.dataclass(frozen=True)
class Emitted:
  """A collective op the backend built, described for later passes (which never decode its keys)."""

  kind: str                        # "all-reduce", "all-gather" or "all-to-all": what the op itself does
  axes: Tuple[str, ...]            # the mesh axes its groups span
  reduction: Optional[str] = None  # an all-reduce's merge op ("Add", "Max", ...)


_lock = threading.Lock()
_group_keys = {}          # key -> member device names
_instance_counter = itertools.count(1 << 16)


def group_key(members):
  """A stable int32 key for a group of devices, unique within the process."""
  with _lock:
    key = (zlib.crc32("|".join(members).encode()) & 0x3FFFFFFF) + 1
    while key in _group_keys and _group_keys[key] != tuple(members):
      key = key % 0x3FFFFFFF + 1
    _group_keys[key] = tuple(members)
    return key


def lowered_by_xla(node):
  """Whether XLA compiles the collective NodeDef `node`: a type tf2xla lowers, with a merge its kernel takes."""
  return node.op in XLA_LOWERED and node.attr["merge_op"].s in (b"Add", b"Mul")


def next_instance_key():
  with _lock:
    return next(_instance_counter)


def _rank_key(name):
  spec = tf.DeviceSpec.from_string(name)
  return (spec.job or "", spec.replica or 0, spec.task or 0, spec.device_type or "", spec.device_index or 0)


_NATIVE = (tf.float32, tf.float16, tf.float64, tf.int32, tf.int64)
_CARRIER = {tf.bool: tf.int32, tf.int8: tf.int32, tf.uint8: tf.int32, tf.int16: tf.int32, tf.uint16: tf.int32,
            tf.bfloat16: tf.float32, tf.uint32: tf.int64}


def _carry(x, source):
  """Cast `x` to a dtype TF's collectives accept (exactly representable), with the cast back."""
  if x.dtype in _NATIVE:
    return x, lambda y: y
  if x.dtype not in _CARRIER:
    raise PartitionError(f"TF collectives cannot carry {x.dtype.name} tensors; keep this tensor replicated",
                         node=source)
  dtype = x.dtype
  return tf.cast(x, _CARRIER[dtype]), lambda y: tf.cast(y, dtype)


class Backend:
  """Emits collectives over mesh axes into the per-device graph being built."""

  def __init__(self, mesh, devices, pid, lookup, report):
    self.emitted = {}         # op name -> Emitted, for every collective op built here
    self.mesh = mesh
    self.devices = tuple(devices) if devices else tuple(f"/job:localhost/replica:0/task:0/device:CPU:{p}"
                                                         for p in range(mesh.size))
    self.pid = pid
    self.lookup = lookup      # lookup(np table, name) -> per-device row of the table (a tensor)
    self.report = report
    self._groups = {}

  # ---- groups -------------------------------------------------------------------------------------------
  def groups(self, axes):
    """(group index per position, members per group in mesh order along `axes`)."""
    axes = tuple(axes)
    if axes not in self._groups:
      mesh = self.mesh
      idx = [mesh.axis_index(a) for a in axes]
      groups, of = {}, np.zeros(mesh.size, np.int32)
      for p in range(mesh.size):
        c = mesh.coords(p)
        outer = tuple(int(c[k]) for k in range(mesh.ndim) if k not in idx)
        inner = 0
        for k in idx:
          inner = inner * mesh.shape[k] + int(c[k])
        groups.setdefault(outer, {})[inner] = p
      members = []
      for g, outer in enumerate(sorted(groups)):
        row = [groups[outer][i] for i in range(len(groups[outer]))]
        members.append(row)
        of[row] = g
      self._groups[axes] = (of, members)
    return self._groups[axes]

  def _keys(self, axes):
    of, members = self.groups(axes)
    keys = np.array([group_key([self.devices[p] for p in m]) for m in members], np.int32)
    size = len(members[0])
    return size, self.lookup(keys[of], f"group_key_{'_'.join(axes)}")

  def _rank_permutation(self, axes):
    """Per-position permutation from runtime rank order to mesh order, or None when they agree."""
    of, members = self.groups(axes)
    perms = []
    for m in members:
      ranked = sorted(m, key=lambda p: _rank_key(self.devices[p]))
      perms.append([ranked.index(p) for p in m])
    if all(p == sorted(p) for p in perms):
      return None
    return np.array(perms, np.int32)[of]

  # ---- collectives ----------------------------------------------------------------------------------------
  def all_reduce(self, x, axes, op, source, reason, record=True):
    size, key = self._keys(axes)
    y, back = _carry(x, source)
    out = tf.raw_ops.CollectiveReduceV2(
        input=y, group_size=size, group_key=key, instance_key=next_instance_key(), ordering_token=[],
        merge_op=op, final_op="Id", name="all_reduce")
    self.emitted[out.op.name] = Emitted("all-reduce", tuple(axes), op)
    if record:
      self._record("all-reduce", x, x.shape, size, axes, source, reason)
    return back(out)

  def all_gather(self, x, dim, axes, source, reason, record=True):
    """Concatenate the shards of the group along `dim`, in mesh order."""
    size, key = self._keys(axes)
    rank = x.shape.rank
    perm = [dim] + [d for d in range(rank) if d != dim]
    y, back = _carry(x, source)
    y = tf.transpose(y, perm) if dim else y
    g = tf.raw_ops.CollectiveGatherV2(
        input=y, group_size=size, group_key=key, instance_key=next_instance_key(), ordering_token=[],
        name="all_gather")
    self.emitted[g.op.name] = Emitted("all-gather", tuple(axes))
    gathered = [size * y.shape[0]] + y.shape.as_list()[1:]
    g = tf.reshape(g, gathered)  # CollectiveGatherV2 leaves dim 0 unknown; the shape is static here
    rank_perm = self._rank_permutation(axes)
    if rank_perm is not None:
      chunks = tf.reshape(g, [size, -1])
      g = tf.reshape(tf.gather(chunks, self.lookup(rank_perm, f"rank_perm_{'_'.join(axes)}")), gathered)
    if dim:
      g = tf.transpose(g, np.argsort(perm))
    if record:
      self._record("all-gather", x, g.shape, size, axes, source, reason)
    return back(g)

  def _exchange_chunks(self, y, dim, axes, name):
    """Cut dim `dim` of y into group-size chunks and send chunk k to the k-th member (mesh order).

    Returns [sender, ..., chunk, ...]: what arrived, in the senders' mesh order.
    """
    size, key = self._keys(axes)
    shape = y.shape.as_list()
    c = shape[dim] // size
    # [.., dim, ..] -> [chunk, .., c, ..]: TF's CPU all-to-all exchanges slices of dim 0.
    parts = tf.reshape(y, shape[:dim] + [size, c] + shape[dim + 1:])
    parts = tf.transpose(parts, [dim] + [d for d in range(len(shape) + 1) if d != dim])
    rank_perm = self._rank_permutation(axes)
    tag = "_".join(axes)
    if rank_perm is not None:   # slot r must carry the chunk of the member with runtime rank r
      parts = tf.gather(parts, self.lookup(np.argsort(rank_perm, axis=1).astype(np.int32), f"rank_inv_{tag}"))
    got = tf.raw_ops.CollectiveAllToAllV2(
        input=parts, group_size=size, group_key=key, instance_key=next_instance_key(), ordering_token=[],
        name=name)
    self.emitted[got.op.name] = Emitted("all-to-all", tuple(axes))
    got = tf.reshape(got, parts.shape)
    if rank_perm is not None:   # slot r came from rank r: back to the senders' mesh order
      got = tf.gather(got, self.lookup(rank_perm, f"rank_perm_{tag}"))
    return got

  def all_to_all(self, x, src, dst, axes, source, reason):
    """Move a split from dim `src` to dim `dst` over the group of `axes`.

    Dim `dst` is cut into group-size chunks; chunk k goes to the k-th member (mesh order); what arrives is
    concatenated along `src` in the senders' mesh order.
    """
    y, back = _carry(x, source)
    shape = y.shape.as_list()
    rank = len(shape)
    got = self._exchange_chunks(y, dst, axes, "all_to_all")
    size = got.shape[0]
    # [sender, .., src, ..] -> [.., sender * src, ..]: the sender index is the major part of `src`.
    got = tf.transpose(got, list(range(1, src + 1)) + [0] + list(range(src + 1, rank + 1)))
    out_shape = shape[:dst] + [shape[dst] // size] + shape[dst + 1:]
    out_shape[src] *= size
    self._record("all-to-all", x, x.shape, size, axes, source, reason)
    return back(tf.reshape(got, out_shape))

  def reduce_scatter(self, x, dim, axes, op, source, reason):
    """Sum (or max/min/product) partial results over the group, each member keeping its chunk of `dim`.

    TF's CollectiveReduceScatterV2 has no CPU kernel: emitted as an all-to-all of the chunks (member k
    receives everyone's chunk k) and a local reduction, which moves no more than a reduce-scatter.
    """
    y, back = _carry(x, source)
    got = self._exchange_chunks(y, dim, axes, "reduce_scatter")
    combine = {"Add": tf.reduce_sum, "Max": tf.reduce_max, "Min": tf.reduce_min, "Mul": tf.reduce_prod}[op]
    shape = tuple(int(v) for v in x.shape)
    self.report.add(CollectiveRecord("reduce-scatter", x.dtype.name, shape, math.prod(shape) * x.dtype.size,
                                     int(got.shape[0]), tuple(axes), source, reason,
                                     emitted="all-to-all + local reduction"))
    return back(combine(got, axis=0))

  def halo_exchange(self, x, dim, axes, left, right, source, reason):
    """x extended along `dim` by the last `left` rows of the previous shard and the first `right` rows of the
    next one (zeros at the ends of the group): two collective-permutes.

    TF has no CPU collective-permute, so both halos travel in one all-gather of the shards' edge rows and
    each device keeps its neighbours'; the report lists the logical permutes and names what was emitted.
    """
    size, _ = self._keys(axes)
    n = x.shape[dim]
    rank = x.shape.rank

    def rows(start, count):
      begin = [0] * rank
      extent = [-1] * rank
      begin[dim], extent[dim] = start, count
      return tf.slice(x, begin, extent)

    edges = tf.concat([rows(0, right), rows(n - left, left)], axis=dim)   # [first `right`, last `left`]
    gathered = self.all_gather(edges, dim, axes, source, reason, record=False)
    of, members = self.groups(axes)
    index = np.zeros(self.mesh.size, np.int32)
    for m in members:
      for k, p in enumerate(m):
        index[p] = k
    width = left + right
    parts = [x]
    for count, offset, step, valid in ((left, right, -1, index > 0), (right, 0, 1, index < size - 1)):
      if not count:
        continue
      start = np.clip(index + step, 0, size - 1) * width + offset
      idx = start[:, None] + np.arange(count)[None, :]
      halo = tf.gather(gathered, self.lookup(idx.astype(np.int32), f"halo_{dim}_{count}_{offset}_{size}"), axis=dim)
      keep = self.lookup(valid.astype(x.dtype.as_numpy_dtype), f"halo_valid_{step}_{size}")
      halo = halo * keep
      parts.insert(0 if step < 0 else len(parts), halo)
      shape = halo.shape.as_list()
      self.report.add(CollectiveRecord(
          "collective-permute", x.dtype.name, tuple(shape), math.prod(shape) * x.dtype.size, size, tuple(axes),
          source, f"{reason} ({'previous' if step < 0 else 'next'} shard's {count} edge row(s))",
          emitted=f"all-gather of {width} edge row(s) per shard"))
    return tf.concat(parts, axis=dim)

  def _record(self, kind, x, shape, size, axes, source, reason):
    shape = tuple(int(s) for s in shape)
    if any(s is None for s in shape):
      raise PartitionError(f"collective on a tensor of unknown shape {shape}", node=source)
    self.report.add(CollectiveRecord(kind, x.dtype.name, shape, math.prod(shape) * x.dtype.size, size, tuple(axes),
                                     source, reason))
