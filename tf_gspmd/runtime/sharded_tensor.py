"""`ShardedTensor`: a global value held as per-device components laid out by a `Sharding`."""

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.mesh import Mesh
from tf_gspmd._layout.sharding import to_sharding
from tf_gspmd.errors import InputError, MeshError
from tf_gspmd.runtime import parallel


class ShardedTensor:
  """A global tensor stored as one component per mesh device.

  Attributes:
    components: this process's per-device tf.Tensors (mesh row-major order), each of the sharding's shard
      shape: one per mesh device, unless the mesh spans several processes. On logical CPUs of one process a
      result's components may all be held by the first device (the same host memory; see gs.function's
      `exchange`), and devices holding the same tile may share one tensor.
    positions: the mesh positions of `components`.
    sharding: the `Sharding` of the global value.
    shape: the global shape; dtype: the element type.

  Passing a ShardedTensor to a `gs.function` uses the components in place (no data moves when the
  function wants this sharding). `.numpy()` assembles the global value, with padding removed. When the mesh
  spans several processes and this process lacks some tile (`is_fully_addressable` is False), `.numpy()` is an
  all-gather over the mesh (each device sends its shard): every process must call it, in the same order. A
  replicated value (a loss) is read locally in every process.
  """

  def __init__(self, components, sharding, shape, dtype, packed=None, devices=None, positions=None):
    self._components = tuple(components) if components is not None else None
    self._packed = packed    # (parallel device, packed tensor): how a gs.function result arrives
    self.sharding = sharding
    self.shape = shape if isinstance(shape, tf.TensorShape) else tf.TensorShape(shape)
    self.dtype = dtype if isinstance(dtype, tf.DType) else tf.as_dtype(dtype)
    self._mesh_devices = tuple(devices) if devices is not None else None
    if positions is None:   # `positions`: this process's mesh positions, where the caller knows them
      positions = parallel.local(devices).positions if devices is not None else tuple(range(sharding.mesh.size))
    self.positions = positions

  @property
  def components(self):
    if self._components is None:
      pd, packed = self._packed
      self._components = tuple(pd.unpack(packed))
    return self._components

  def packed_for(self, pd):
    """The components as one parallel tensor of `pd` (kept from the producing call, or packed once). A component
    held by another device than its own (a result of the in-process graph, held by the first device) is copied
    onto its device as it is packed: a program run on `pd` then reads every argument where it runs, instead of
    each device receiving it from the first device on every call."""
    if self._packed is None or self._packed[0] is not pd:
      self._packed = (pd, pd.pack(_on_devices(self.components, pd.components)))
    return self._packed[1]

  @property
  def is_fully_addressable(self):
    """Whether this process holds a copy of every tile (always, unless the mesh spans several processes)."""
    return self._missing_tiles() == []

  def _tile(self, p, rank):
    s = self.sharding
    return () if s.is_maximal else tuple(s.with_rank(rank).tile_index(p, d) for d in range(rank))

  def _missing_tiles(self):
    rank = len(self.shape)
    if self.sharding.is_maximal:
      return [] if self.sharding.maximal in self.positions else [self.sharding.maximal]
    have = {self._tile(p, rank) for p in self.positions}
    return [p for p in range(self.sharding.mesh.size) if self._tile(p, rank) not in have]

  def numpy(self):
    shape = tuple(self.shape.as_list())
    s = self.sharding
    local = dict(zip(self.positions, self.components))
    if self._missing_tiles():   # tiles held by other processes: one all-gather over the mesh
      pieces = parallel.gather_to_host(self._mesh_devices, list(self.components))
    else:
      pieces = None
    def piece(p):
      return pieces[p] if pieces is not None else local[p].numpy()
    if s.is_maximal:
      return piece(s.maximal)
    s = s.with_rank(len(shape))
    shard = s.shard_shape(shape)
    padded = np.zeros([c * s.tiles(d) for d, c in enumerate(shard)], self.dtype.as_numpy_dtype)
    done = set()
    for p in (range(s.mesh.size) if pieces is not None else self.positions):
      idx = self._tile(p, len(shape))
      if idx in done:
        continue
      done.add(idx)
      padded[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, shard))] = piece(p)
    return padded[tuple(slice(0, n) for n in shape)]

  def __array__(self, dtype=None, copy=None):  # pylint: disable=unused-argument
    a = np.asarray(self.numpy())
    return a.astype(dtype) if dtype is not None else a

  @property
  def devices(self):
    return tuple(c.device for c in self.components)

  def __float__(self):
    return float(self.numpy())

  def __repr__(self):
    return f"ShardedTensor(shape={self.shape.as_list()}, dtype={self.dtype.name}, sharding={self.sharding})"


def _on_devices(components, devices):
  """`components` with each one not on its device of `devices` copied there."""
  out = []
  for c, d in zip(components, devices):
    if tf.DeviceSpec.from_string(c.device) == tf.DeviceSpec.from_string(d):
      out.append(c)
    else:
      with tf.device(d):
        out.append(tf.identity(c))
  return out


def padded(piece, shard_shape):
  """`piece` (a tile, a tensor) padded with zeros at the end of each dim to `shard_shape` (uneven splits)."""
  pad = [(0, c - n) for c, n in zip(shard_shape, piece.shape.as_list())]
  return tf.pad(piece, pad) if any(r for _, r in pad) else piece


def shard_host_value(value, sharding, shape, positions=None):
  """Split a global host value into the shards of mesh `positions` (default: all; zero-padded to the shard
  shape)."""
  value = np.asarray(value)
  positions = range(sharding.mesh.size) if positions is None else positions
  if sharding.is_maximal or sharding.is_replicated:
    return [value] * len(positions)
  s = sharding.with_rank(len(shape))
  local = s.shard_shape(shape)
  shards = []
  for p in positions:
    idx = [s.tile_index(p, d) for d in range(len(shape))]
    piece = value[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, local))]
    pad = [(0, c - n) for c, n in zip(local, piece.shape)]
    shards.append(np.pad(piece, pad) if any(p[1] for p in pad) else piece)
  return shards


def from_process_local_data(local_data, mesh, spec, global_shape=None):
  """A global value from each process's part of it (JAX's make_array_from_process_local_data).

  Every process passes the block of the global value its own devices hold under `spec` -- e.g. with the batch
  split over the processes, each process's own rows of the global batch -- and gets a `ShardedTensor` whose local
  shards come from that block only; no data moves between processes. Along each dim, the block is the range of
  rows this process's tiles cover (the whole dim where the spec does not split it across processes).

  Args:
    local_data: this process's block (numpy or tf.Tensor).
    mesh: the `gs.Mesh`; spec: the global value's layout (`P(...)` or `Sharding`).
    global_shape: the global shape; by default each dim's block size times the number of blocks along it.

  Raises InputError when the block's shape does not fit the spec and global shape.
  """
  if not isinstance(mesh, Mesh):
    raise MeshError(f"gs.from_process_local_data(mesh={mesh!r}): give the gs.Mesh the global value is laid out over",
                    node="mesh")
  block = np.asarray(local_data)
  if block.dtype == object:
    raise InputError(f"process-local data {type(local_data).__name__} is not an array of numbers: pass this "
                     "process's block as a numpy array or tf.Tensor", node="process-local data")
  devices = mesh.resolve_devices()
  positions = parallel.local(devices).positions
  s = to_sharding(spec, mesh, rank=block.ndim, what="process-local data")
  rank = block.ndim
  tiles = [s.tiles(d) if not s.is_maximal else 1 for d in range(rank)]
  idx = {p: [s.tile_index(p, d) if not s.is_maximal else 0 for d in range(rank)] for p in positions}
  mine = [sorted({idx[p][d] for p in positions}) for d in range(rank)]
  if global_shape is None:
    global_shape = [block.shape[d] * tiles[d] // len(mine[d]) for d in range(rank)]
  if isinstance(global_shape, (str, bytes)) or not hasattr(global_shape, "__iter__") or len(global_shape) != rank or \
      not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in global_shape):
    raise InputError(f"global_shape={global_shape!r}: give the global value's shape, {rank} non-negative ints (the "
                     f"block has rank {rank}), or leave it out", node="global_shape")
  global_shape = tuple(int(n) for n in global_shape)
  shard = s.shard_shape(global_shape) if not s.is_maximal else global_shape
  lo = [mine[d][0] * shard[d] for d in range(rank)]
  hi = [min((mine[d][-1] + 1) * shard[d], global_shape[d]) for d in range(rank)]
  want = tuple(h - l for l, h in zip(lo, hi))
  if any(mine[d] != list(range(mine[d][0], mine[d][-1] + 1)) for d in range(rank)) or block.shape != want:
    raise InputError(f"process-local data of shape {block.shape} does not fit: this process's devices hold rows "
                     f"{[f'{l}:{h}' for l, h in zip(lo, hi)]} of the global {global_shape} laid out as {s}; pass "
                     f"exactly that block (shape {want}), or give global_shape")
  comps = []
  for p in positions:
    starts = [idx[p][d] * shard[d] - lo[d] for d in range(rank)]
    piece = block[tuple(slice(max(a, 0), max(a, 0) + c) for a, c in zip(starts, shard))]
    piece = np.pad(piece, [(0, c - n) for c, n in zip(shard, piece.shape)])
    with tf.device(devices[p]):
      comps.append(tf.identity(tf.constant(piece)))
  return ShardedTensor(comps, s, global_shape, tf.as_dtype(block.dtype), devices=devices)
