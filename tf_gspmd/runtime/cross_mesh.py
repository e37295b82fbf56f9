"""Cross-mesh resharding: a ShardedTensor on one mesh becomes a ShardedTensor on another (Alpa's cross-mesh
resharding between pipeline stages), each destination device receiving exactly its slice.

Plan, then move. `plan_transfer` is pure: for every destination device it intersects the device's slice of the
global value (padding excluded) with the source tiles. The intersections of two tilings form a grid, so the
slice is covered by pieces, one per source tile it meets; each piece comes from one device holding that tile:
the destination device itself when it holds a copy (a local copy), else, among the replicas in the destination's
process (all of them when there are none), the one that has sent the fewest bytes so far (replicas share the
load). `reshard` runs the plan: each piece is cut on the device that holds the source tile and copied to its
destination device, where the pieces are concatenated and padded to the destination's shard shape. Nothing is
gathered: a device receives the bytes of its slice and no more.

The two meshes may share devices or not; their shardings are independent (uneven splits included), and their
devices may belong to different processes: a piece whose two devices are in different processes is one
point-to-point send (TF's collective broadcast in a group of those two devices), of the piece only.
"""

import dataclasses
import math
import threading
import zlib
from typing import Tuple

import tensorflow as tf

from tf_gspmd._platform import cluster as _cluster
from tf_gspmd._layout.sharding import Sharding, to_sharding
from tf_gspmd.errors import InputError
from tf_gspmd.rewriter.collectives import vocabulary
from tf_gspmd.runtime import parallel
from tf_gspmd.runtime.sharded_tensor import ShardedTensor


def tile_extent(sharding, shape, position):
  """(starts, lengths) of the global slice the device at mesh `position` holds under `sharding` for a value of
  `shape`: lengths exclude padding (a padding-only tile has length 0; its start may lie past the end)."""
  if sharding.is_maximal or sharding.is_replicated:
    return (0,) * len(shape), tuple(shape)
  s = sharding.with_rank(len(shape))
  local = s.shard_shape(shape)
  starts = tuple(s.tile_index(position, d) * local[d] for d in range(len(shape)))
  return starts, tuple(max(0, min(c, n - a)) for c, n, a in zip(local, shape, starts))


def holds_tile(sharding, position):
  """Whether the device at `position` holds a tile of `sharding` (every device but the others of a maximal one)."""
  return not sharding.is_maximal or sharding.maximal == position


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One piece of a cross-mesh move: the global box `index` (a slice per dim) sent from mesh position
  `src_position` (device `src_device`) to position `dst_position` (device `dst_device`). `local`: both are one
  device (a copy in its memory, nothing crosses devices)."""

  src_position: int
  dst_position: int
  src_device: str
  dst_device: str
  index: Tuple[slice, ...]
  bytes: int

  @property
  def local(self):
    return self.src_device == self.dst_device


class TransferLog:
  """What cross-mesh moves sent, piece by piece: bytes per (source device, destination device), per destination
  device, and in total (`moved_bytes`: between different devices only). Pass one to `reshard` (or several
  moves' worth: it accumulates)."""

  def __init__(self):
    self.transfers = []

  def extend(self, transfers):
    self.transfers.extend(transfers)

  def bytes_by_pair(self):
    out = {}
    for t in self.transfers:
      out[(t.src_device, t.dst_device)] = out.get((t.src_device, t.dst_device), 0) + t.bytes
    return out

  def bytes_received(self):
    """{destination device: bytes it received (local copies included)}."""
    out = {}
    for t in self.transfers:
      out[t.dst_device] = out.get(t.dst_device, 0) + t.bytes
    return out

  def bytes_sent(self):
    """{source device: bytes it sent to other devices}."""
    out = {}
    for t in self.transfers:
      if not t.local:
        out[t.src_device] = out.get(t.src_device, 0) + t.bytes
    return out

  @property
  def total_bytes(self):
    return sum(t.bytes for t in self.transfers)

  @property
  def moved_bytes(self):
    return sum(t.bytes for t in self.transfers if not t.local)

  def __str__(self):
    lines = [f"{len(self.transfers)} pieces, {self.total_bytes} bytes ({self.moved_bytes} between devices)"]
    for (src, dst), n in sorted(self.bytes_by_pair().items()):
      lines.append(f"  {_short(src)} -> {_short(dst)}: {n} bytes")
    return "\n".join(lines)


def _short(device):
  spec = tf.DeviceSpec.from_string(device)
  return f"{spec.device_type}:{spec.device_index}" if spec.job in (None, "localhost") else device


def _segments(lo, n, tile):
  """[lo, lo + n) cut at multiples of `tile` (None: one source tile spans the dim): [(start, length, tile no.)]."""
  if n <= 0:
    return []
  if tile is None:
    return [(lo, n, 0)]
  out, a = [], lo
  while a < lo + n:
    k = a // tile
    b = min(lo + n, (k + 1) * tile)
    out.append((a, b - a, k))
    a = b
  return out


def _check_layouts(**layouts):
  """InputError naming the argument for a layout that is not a gs.Sharding, or devices that are not its mesh's."""
  for name, (sharding, devices) in layouts.items():
    if not isinstance(sharding, Sharding):
      raise InputError(f"{name}={sharding!r}: give the layout as a gs.Sharding, e.g. "
                       "gs.Sharding.from_spec(mesh, P(...))", node=name)
    if len(devices) != sharding.mesh.size:
      raise InputError(f"{name}_devices names {len(devices)} devices, but the layout's mesh {sharding.mesh} has "
                       f"{sharding.mesh.size}: give one device per mesh position", node=f"{name}_devices")


def plan_transfer(shape, dtype, src, dst, src_devices, dst_devices):
  """The pieces that move a value of `shape`/`dtype` laid out as Sharding `src` over `src_devices` to Sharding
  `dst` over `dst_devices`: {destination position: [Transfer]} (pieces in row-major order of the grid they form;
  an empty list for a padding-only or empty slice). Pure: no tensors, sized by the number of pieces only."""
  _check_layouts(src=(src, src_devices), dst=(dst, dst_devices))
  shape = tuple(int(n) for n in shape)
  rank = len(shape)
  itemsize = tf.as_dtype(dtype).size
  # Source tiles: start of the tile per dim -> the positions holding it.
  replicas = {}
  whole = src.is_maximal or src.is_replicated
  s_tile = None if whole else src.with_rank(rank).shard_shape(shape)
  for p in range(src.mesh.size):
    if holds_tile(src, p):
      replicas.setdefault(tile_extent(src, shape, p)[0], []).append(p)
  sent = {p: 0 for p in range(src.mesh.size)}
  plan = {}
  for q in range(dst.mesh.size):
    d_start, d_len = tile_extent(dst, shape, q)
    if not holds_tile(dst, q):
      d_len = (0,) * rank
    segs = [_segments(a, n, None if whole else s_tile[d]) for d, (a, n) in enumerate(zip(d_start, d_len))]
    pieces = []
    for combo in (_product(segs) if rank else [()]):
      tile_start = tuple(0 if whole else k * s_tile[d] for d, (_, _, k) in enumerate(combo))
      options = replicas.get(tile_start)
      if not options:
        raise InputError(f"no device holds the source tile starting at {tile_start} of the value laid out as {src}")
      here = [p for p in options if src_devices[p] == dst_devices[q]]
      near = [p for p in options if _host(src_devices[p]) == _host(dst_devices[q])] or options
      p = here[0] if here else min(near, key=lambda o: (sent[o], o))
      n = math.prod(length for _, length, _ in combo) * itemsize
      if not here:
        sent[p] += n
      pieces.append(Transfer(p, q, src_devices[p], dst_devices[q],
                             tuple(slice(a, a + length) for a, length, _ in combo), n))
    plan[q] = pieces
  return plan


def _host(device):
  """The process (job, replica, task) of a device name."""
  spec = tf.DeviceSpec.from_string(device)
  return (spec.job, spec.replica, spec.task)


def _product(segs):
  out = [()]
  for s in segs:
    out = [c + (x,) for c in out for x in s]
  return out


def value_elsewhere(shape, dtype, mesh, spec):
  """A ShardedTensor of which this process holds no tile (its mesh's devices belong to other processes): what a
  process that only receives passes to `reshard`, naming the value the other processes send."""
  sharding = to_sharding(spec, mesh, rank=len(shape), what="the value held elsewhere")
  return ShardedTensor([], sharding, shape, dtype, devices=mesh.resolve_devices(), positions=())


def reshard(x, mesh, spec, log=None, wait=True):
  """`x` (a ShardedTensor) moved to `mesh` laid out as `spec` (a `P`, `Sharding` or spec tuple over `mesh`).

  Every device of `mesh` receives exactly its slice: pieces of the source tiles it intersects, each from one
  device holding that tile (itself when it holds one; else a replica in its own process when there is one, the
  one that has sent least). `log`: a `TransferLog` that records every piece.

  Across processes (`gs.initialize`), every process that holds a source tile or a destination device calls
  `reshard` for the value, in the same order for the same pair of meshes; a process holding none of the source
  passes `value_elsewhere(shape, dtype, source mesh, source spec)`. A piece between processes is one
  point-to-point send (TF's collective broadcast in a group of its two devices). The result holds this process's
  destination devices. `wait=False` returns before this process's sends are received (`wait_for_sends()`
  waits for them); a pipeline's stages send without waiting, so that neither side blocks the other.

  Example:
    >>> y = gs.reshard(x, gs.Mesh((2, 2), ("a", "b"), devices=devs[4:]), gs.P("a", "b"))
  """
  if not isinstance(x, ShardedTensor):
    raise InputError(f"reshard moves a ShardedTensor between meshes; got {type(x).__name__} (a host value goes to a "
                     "mesh by passing it to a gs.function)")
  shape = tuple(x.shape.as_list())
  dst = to_sharding(spec, mesh, rank=len(shape), what="the resharded value")
  if dst is None:
    raise InputError("reshard needs the destination layout: give spec=gs.P(...) (gs.P() for replicated)")
  src = x.sharding
  src_devices = x._mesh_devices or src.mesh.resolve_devices()  # pylint: disable=protected-access
  dst_devices = mesh.resolve_devices()
  plan = plan_transfer(shape, x.dtype, src, dst, src_devices, dst_devices)
  comps = dict(zip(x.positions, x.components))
  starts = {p: tile_extent(src, shape, p)[0] for p in range(src.mesh.size)}
  d_shard = dst.shard_shape(shape) if not dst.is_maximal else shape
  mine = [q for q in range(mesh.size) if _cluster.is_local(dst_devices[q])]
  mine_set = set(mine)
  # Sends first (they do not block), so that two processes that each send to and receive from the other do
  # not both wait in a receive.
  for q in range(mesh.size):
    if q not in mine_set:
      for t in plan[q]:
        if t.src_position in comps:
          _send(_cut(t, comps, starts), t)
  out = [_assemble(plan[q], comps, starts, dst_devices[q], d_shard, x.dtype) for q in mine]
  if log is not None:   # the pieces this process sends or receives
    log.extend([t for q in range(mesh.size) for t in plan[q] if q in mine_set or t.src_position in comps])
  if wait:
    wait_for_sends()
  return ShardedTensor(out, dst, shape, x.dtype, devices=dst_devices, positions=tuple(mine))


def _cut(t, comps, starts):
  """The piece `t` cut from its source component, on the device that holds it."""
  comp = comps[t.src_position]
  begin = [s.start - a for s, a in zip(t.index, starts[t.src_position])]
  size = [s.stop - s.start for s in t.index]
  with tf.device(comp.device):
    return comp if list(comp.shape) == size else tf.slice(comp, begin, size)


def _assemble(pieces, comps, starts, device, shard_shape, dtype):
  """The destination device's component: its pieces cut where their source tiles live (or received from the
  process that holds them), copied to `device`, concatenated along the grid they form, zero-padded to
  `shard_shape`."""
  with tf.device(device):
    if not pieces:
      return tf.zeros(shard_shape, dtype)
  moved = []
  for t in pieces:
    if t.src_position in comps:
      cut = _cut(t, comps, starts)
      with tf.device(device):
        moved.append(tf.identity(cut))
    else:
      moved.append(_receive(t, dtype))
  with tf.device(device):
    value = _concat_grid(pieces, moved)
    pad = [(0, c - n) for c, n in zip(shard_shape, value.shape)]
    return tf.pad(value, pad) if any(b for _, b in pad) else value


# ---- between processes: one send and one receive per piece ---------------------------------------------------
_PAIR_GROUPS = (1 << 30) + (1 << 26)   # group keys of the pairs: above the programs' and the host gathers'
SEND_TIMEOUT = 300.0
_pairs_lock = threading.Lock()
_pair_count = {}         # (source device, destination device) -> pieces sent or received on that pair so far
_pending = []            # send threads not yet joined
_send_errors = []


def _pair_keys(t):
  """(group key, instance key) of piece `t`: the group of its two devices (ordered: a -> b differs from b -> a)
  and the piece's number on that pair (both processes number a pair's pieces in the same order)."""
  pair = (t.src_device, t.dst_device)
  with _pairs_lock:
    n = _pair_count.get(pair, 0) + 1
    _pair_count[pair] = n
  return _PAIR_GROUPS + (zlib.crc32("|".join(pair).encode()) & 0x3FFFFFF), n


def _carried(dtype):
  carried = parallel.CARRIED.get(dtype, dtype)
  if carried not in (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64):
    raise InputError(f"a {dtype.name} value cannot move between processes (TF's collectives do not carry it); "
                     "cast it to a number type first")
  return carried


def _send(value, t):
  group, instance = _pair_keys(t)

  def run():
    try:
      with tf.device(t.src_device):
        vocabulary.PERMUTE_SEND.build(input=tf.cast(value, _carried(value.dtype)), group_size=2, group_key=group,
                                      instance_key=instance, timeout_seconds=SEND_TIMEOUT)
    except Exception as e:  # pylint: disable=broad-except
      _send_errors.append((e, t.dst_device))

  thread = threading.Thread(target=run, daemon=True, name=f"send-{group}-{instance}")
  thread.start()
  with _pairs_lock:
    _pending.append(thread)


def _receive(t, dtype):
  group, instance = _pair_keys(t)
  with tf.device(t.dst_device):
    try:
      got = vocabulary.PERMUTE_RECEIVE.build(group_size=2, group_key=group, instance_key=instance,
                                             shape=[s.stop - s.start for s in t.index], T=_carried(dtype),
                                             timeout_seconds=SEND_TIMEOUT)
    except tf.errors.OpError as e:
      raise _lost(e, f"receiving a piece from {t.src_device}") from e
    return tf.cast(got, dtype)


def wait_for_sends():
  """Waits until every piece this process has sent to another process was received; raises the first send's
  error: ProcessLostError when the receiving process stopped answering (TF's collectives report it gone, or no
  receive came within SEND_TIMEOUT seconds)."""
  with _pairs_lock:
    threads = list(_pending)
    _pending.clear()
  for thread in threads:
    thread.join()
  if _send_errors:
    error, where = _send_errors[0]
    _send_errors.clear()
    if isinstance(error, tf.errors.OpError):
      raise _lost(error, f"sending a piece to {where}") from error
    raise error


def _lost(error, what):
  """A transfer's error between processes as ProcessLostError naming the process that stopped answering (when
  TF names it)."""
  return _cluster.process_lost(error, f"gs.reshard ({what})", "the transfer's collectives were aborted and this "
                               f"process cannot run collectives again: {_cluster.RESTART}",
                               unnamed="the process at the other end")


def _concat_grid(pieces, values, axis=0):
  """The box that `pieces` (a grid of segments) tile, from their `values`: along `axis`, the pieces sharing a
  start form a sub-grid over the later dims; those are concatenated in order of their starts."""
  if axis == len(pieces[0].index) or len(values) == 1:
    return values[0]
  parts = []
  for a in sorted({t.index[axis].start for t in pieces}):
    group = [k for k, t in enumerate(pieces) if t.index[axis].start == a]
    parts.append(_concat_grid([pieces[k] for k in group], [values[k] for k in group], axis + 1))
  return parts[0] if len(parts) == 1 else tf.concat(parts, axis)
