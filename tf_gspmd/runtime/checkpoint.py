"""Checkpoints of sharded variables: how a managed variable saves and restores its tiles (SliceSaveable,
StreamingRestore, HostSnapshot), and saves of a mesh that spans several processes: one standard TF checkpoint,
written by every process.

Every process calls the same `tf.train.Checkpoint.write` / `save` / `CheckpointManager.save` with the same path.
When what is saved includes a variable stored over several processes, the save is shared:

  1. every process publishes the path it saves to; all must agree (else every process raises InputError);
  2. each process writes the distinct tiles whose lowest device is its own (and nothing else) with SaveV2 as a
     part under `<path>_temp/`; the chief's part is TF's own save, with the object graph and every value that
     is not split over processes (replicated values, plain variables, Python state);
  3. barrier; the chief merges the parts into `<path>` (MergeV2Checkpoints, which also removes `<path>_temp`);
  4. barrier: the checkpoint exists before any process's save returns.

No process gathers a variable or writes a tile another process writes. A process that dies before a barrier
makes the others raise ProcessLostError naming it; until the merge completes `<path>` does not exist, so the
previous checkpoint (and CheckpointManager's record of it) stays what a restore finds.
"""

import functools
import itertools
import threading

import numpy as np
import tensorflow as tf

from tf_gspmd import initializers
from tf_gspmd._platform import cluster as _cluster
from tf_gspmd._platform import compat as _compat
from tf_gspmd.errors import InputError

# What a restore reads at a time into a shard: whole rows, a quarter of the tile or 8 MiB, whichever is more.
RESTORE_CHUNK_BYTES = 8 << 20

_saves = itertools.count()
_lock = threading.Lock()


_pending = threading.local()

# The last shared save of this process: its path, this process's part and the bytes of tensor data it wrote.
last_save = {}


def _data_bytes(part):
  return sum(tf.io.gfile.stat(f).length for f in tf.io.gfile.glob(f"{part}.data-*"))


def note_split_variable():
  """Called as a variable stored over several processes is collected for a save (this process may write none of
  its tiles, and then nothing in the save shows it): the next save of this thread is a shared one."""
  _pending.count = getattr(_pending, "count", 0) + 1


def _spans_processes(obj, storage_of):
  storage = storage_of(obj)
  return storage is not None and len(storage.positions) < len(storage.devices)


# What a shared save is, and what is left when a process is lost during it.
_OUTCOMES = {
    "checkpoint": ("the checkpoint save", "the checkpoint was not written and the previous one is the latest: "
                   f"{_cluster.RESTART}"),
    "weights": ("the weights file save", "the file is incomplete: restart every process and save again"),
}


def exchange(path, what="checkpoint"):
  """The processes' key-value exchange of the shared save (`what`: "checkpoint" or "weights") of `path`."""
  save, left = _OUTCOMES[what]
  return _cluster.Exchange(f"{save} of {path!r}", left)


def async_copy_key(storage_of):
  """What an asynchronous checkpoint's traced copy to the host depends on (compat.install_async_checkpoint_copy_key):
  which of its variables are stored sharded (`storage_of`)."""
  return lambda trackables: tuple(storage_of(t) is not None for t in trackables)


def save_hook(storage_of):
  """The checkpoint save hook (see the module docstring); `storage_of(obj)` is the sharded storage of a saved
  object or None."""

  def hook(saver, save, file_prefix, options):
    if not (_cluster.is_multi_process() and tf.executing_eagerly()):
      return save(saver, file_prefix, options)
    values = _compat.checkpoint_saver_tensors(saver)
    noted, _pending.count = getattr(_pending, "count", 0), 0
    if not noted and not any(_spans_processes(obj, storage_of) for _, _, obj, _ in values):
      return save(saver, file_prefix, options)
    path = file_prefix.numpy().decode() if isinstance(file_prefix, tf.Tensor) else str(file_prefix)
    k, n = _cluster.process_index(), _cluster.process_count()
    with _lock:
      seq = next(_saves)
    tag = f"tf_gspmd_checkpoint_{seq}"
    ex = exchange(path)
    ex.publish(f"{tag}/path/{k}", path, "publishing its path")
    paths = [ex.lookup(f"{tag}/path/{j}", j, "publishing its path") for j in range(n)]
    if len(set(paths)) > 1:
      raise InputError(f"the processes save one checkpoint to different paths ({dict(enumerate(paths))}): every "
                       f"process must call the same save with the same path (process 0 writes the merged "
                       f"checkpoint); give them one directory")
    part = f"{path}_temp/gspmd-part-{k:05d}-of-{n:05d}"
    tf.io.gfile.makedirs(f"{path}_temp")
    result = None
    if k == 0:
      result = save(saver, tf.constant(part), options)   # the object graph, unsplit values, the chief's tiles
      wrote = True
    else:
      mine = [(key, spec, read) for key, spec, obj, read in values if _spans_processes(obj, storage_of)]
      wrote = bool(mine)
      if wrote:
        with tf.device(_cluster.host_device()):
          tf.raw_ops.SaveV2(prefix=part, tensor_names=[m[0] for m in mine], shape_and_slices=[m[1] for m in mine],
                            tensors=[m[2]() for m in mine])
    last_save.update(path=path, part=part if wrote else None,
                     bytes_written=_data_bytes(part) if wrote else 0)
    ex.publish(f"{tag}/part/{k}", part if wrote else "", "writing its part")
    ex.barrier(f"{tag}/written", "writing its part")
    if k == 0:
      parts = [p for p in (ex.lookup(f"{tag}/part/{j}", j, "writing its part") for j in range(n)) if p]
      with tf.device(_cluster.host_device()):
        tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts, destination_prefix=path, delete_old_dirs=True)
    ex.barrier(f"{tag}/merged", "waiting for the merge")
    return result

  return hook


# ---- a managed variable in a checkpoint ---------------------------------------------------------------------

def host_of(device):
  """The CPU of the process (task) that holds `device`: where a checkpoint is read for it."""
  spec = tf.DeviceSpec.from_string(device)
  return spec.replace(device_type="CPU", device_index=0).to_string()


class SliceSaveable(_compat.SaveableObject):
  """A managed variable in a checkpoint: every distinct tile saved from its device as a slice of the global value."""

  def __init__(self, variable, name):
    storage = variable._gspmd_storage  # pylint: disable=protected-access
    self._storage = storage
    # Over several processes each process lists the tiles it writes (runtime/checkpoint.py merges the parts).
    self._order = storage.written_slices()
    if len(storage.positions) < len(storage.devices):
      note_split_variable()
    specs = [_compat.SaveSpec(functools.partial(storage.read_slice, spec), spec, name, dtype=variable.dtype,
                              device=storage.devices[p])
             for spec, p in self._order.items()]
    super().__init__(variable, specs, name)

  def restore(self, restored_tensors, restored_shapes):
    del restored_shapes
    restore(self._storage, dict(zip(self._order, restored_tensors)))
    return None


def probe_value(storage):
  """The value at the origin (the shape of `probe_spec`), read from the shard that holds it."""
  p = storage.positions[0] if storage.sharding.is_replicated or not storage.shape else None
  if p is None:
    p = next((q for q in storage.positions if not any(storage.tile_extent(q)[0])), storage.positions[0])
  comp = storage.components[storage.positions.index(p)]
  with tf.device(storage.devices[p]):
    x = comp.read_value()
    return x[tuple(slice(0, 1) for _ in storage.shape)] if storage.shape and all(storage.shape) else x


class HostSnapshot(_compat.Trackable):
  """A host copy of the tiles a process writes of a sharded variable, taken when an asynchronous save starts;
  the background writer saves it as the variable's slices."""

  def __init__(self, variable):
    self._variable = variable
    self._tiles = {}

  @property
  def _storage(self):
    # The variable's storage now: a step on another mesh or layout replaces it between saves.
    return self._variable._gspmd_storage  # pylint: disable=protected-access

  def refresh(self):
    """Copies the tiles into host variables (kept between saves: the step may update the shards meanwhile)."""
    written = self._storage.written_slices()
    self._tiles = {spec: host for spec, host in self._tiles.items() if spec in written}   # the layout may change
    for spec, p in written.items():
      x = self._storage.read_slice(spec)
      host = self._tiles.get(spec)
      if host is None:
        with tf.init_scope(), tf.device(host_of(self._storage.devices[p])):
          host = self._tiles[spec] = tf.Variable(tf.zeros(x.shape, x.dtype), trainable=False)
      host.assign(x)

  def _serialize_to_tensors(self):
    if len(self._storage.positions) < len(self._storage.devices):
      note_split_variable()
    if list(self._tiles) == [""]:
      return {_compat.VARIABLE_VALUE_KEY: self._tiles[""].read_value()}
    return {_compat.VARIABLE_VALUE_KEY: {spec: v.read_value() for spec, v in self._tiles.items()}}

  def __tf_tensor__(self, dtype=None, name=None):
    raise InputError(f"an asynchronous checkpoint asked for the whole value of the variable stored sharded as "
                     f"{self._variable.name!r} (shape {list(self._storage.shape)}): its host copy holds this "
                     f"process's tiles only. A wrapper of the variable must save it as its own host copy (as Keras "
                     f"variables do under tf_gspmd.keras), or save synchronously (without "
                     f"experimental_enable_async_checkpoint)")


def stream_restore(storage, prefix, key):
  """Restores checkpoint tensor `key` of checkpoint `prefix` into the shards of `storage` (a ShardedStorage) this
  process holds, one distinct tile at a time: RestoreV2 reads the tile's slice a few rows at a time (from however
  the checkpoint was sliced when saved), into every local shard holding that tile, each read released before the
  next. Besides the shards a restore holds one read and what TF's reader buffers for it (the saved slices it
  overlaps), never the whole value. A value of no elements has no tile to read: its saved value is read (empty)
  to check its shape."""
  storage.before_step()
  split = not (storage.sharding.is_maximal or storage.sharding.is_replicated) and storage.shape
  if not storage.has_elements:
    _read_slice(storage, prefix, key, "", storage.shape, storage.devices[storage.positions[0]])
  done = {}
  for p, comp in zip(storage.positions, storage.components):
    starts, lengths = storage.tile_extent(p)
    device = storage.devices[p]
    with tf.device(device):
      if not all(lengths) and lengths:   # a tile of padding only
        comp.assign(tf.zeros(storage.shard_shape, storage.dtype))
        continue
      spec = storage.slice_spec(p) if split else ""
      if spec in done:
        comp.assign(done[spec].read_value())
        continue
      if not split:
        comp.assign(_read_slice(storage, prefix, key, "", storage.shape, device))
      else:
        _stream_tile(storage, comp, prefix, key, starts, lengths, device)
      done[spec] = comp
  storage.shards_newer = True
  storage.host_newer = False


def _stream_tile(storage, comp, prefix, key, starts, lengths, device):
  """Reads the tile at `starts` of `lengths` into shard `comp`, whole rows at a time (a quarter of the tile or
  RESTORE_CHUNK_BYTES, whichever is more: TF's reader holds the saved slice a read overlaps besides it, and fewer,
  larger reads re-read it less often)."""
  if tuple(lengths) != tuple(storage.shard_shape):   # the padding is zero
    comp.assign(tf.zeros(storage.shard_shape, storage.dtype))
  row_bytes = storage.dtype.size * int(np.prod(lengths[1:], dtype=np.int64))
  step = max(1, max(RESTORE_CHUNK_BYTES, row_bytes * lengths[0] // 4) // max(1, row_bytes))
  with initializers.large_blocks_unmapped():
    for r in range(0, lengths[0], step):
      n = min(step, lengths[0] - r)
      chunk_spec = storage.slice_spec_of((starts[0] + r,) + tuple(starts[1:]), (n,) + tuple(lengths[1:]))
      chunk = _read_slice(storage, prefix, key, chunk_spec, (n,) + tuple(lengths[1:]), device)
      comp[(slice(r, r + n),) + tuple(slice(0, m) for m in lengths[1:])].assign(chunk)
      del chunk


def _read_slice(storage, prefix, key, spec, lengths, device):
  """Slice `spec` of checkpoint tensor `key`, read on the host of `device`; InputError unless of `lengths`."""
  with tf.device(host_of(device)):
    piece = tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=[key], shape_and_slices=[spec],
                                 dtypes=[storage.dtype])[0]
  if tuple(piece.shape.as_list()) != tuple(lengths):
    raise InputError(f"checkpoint tensor {key!r} of {prefix!r} restores as shape {piece.shape.as_list()} for "
                     f"slice {spec!r}, expected {list(lengths)}: the checkpoint holds a value of another shape "
                     f"than the variable's {list(storage.shape)}")
  return piece


def restore(storage, restored):
  """Assigns restored slices ({spec: tensor}, or one whole tensor) to the shards of `storage` that hold them."""
  if not isinstance(restored, dict):
    restored = {"": restored}
  for p, comp in zip(storage.positions, storage.components):
    spec = "" if "" in restored else storage.slice_spec(p)
    starts, lengths = storage.tile_extent(p)
    if spec in restored:
      piece = restored[spec]
      if spec == "" and not (storage.sharding.is_maximal or storage.sharding.is_replicated):
        piece = piece[tuple(slice(s, s + n) for s, n in zip(starts, lengths))]
    else:   # a tile that holds padding only, or a replica of a tile restored elsewhere
      donor = next((q for q in range(len(storage.devices)) if storage.tile_extent(q) == (starts, lengths)
                    and storage.slice_spec(q) in restored), None)
      piece = restored[storage.slice_spec(donor)] if donor is not None else None
    with tf.device(storage.devices[p]):
      comp.assign(storage.padded(piece) if piece is not None else tf.zeros(storage.shard_shape, storage.dtype))
  storage.shards_newer = True
  storage.host_newer = False


class StreamingRestore(_compat.SaveableObject):
  """A managed variable being restored eagerly: TF is asked for one element only; `restore` reads the variable's
  tiles from the checkpoint one at a time (`stream_restore`)."""

  def __init__(self, variable, name, prefix):
    storage = variable._gspmd_storage  # pylint: disable=protected-access
    self._storage, self._prefix, self._key = storage, prefix, name
    spec = storage.probe_spec()
    super().__init__(variable, [_compat.SaveSpec(functools.partial(probe_value, storage), spec, name,
                                                 dtype=variable.dtype, device=host_of(storage.devices[
                                                     storage.positions[0]]))], name)

  def restore(self, restored_tensors, restored_shapes):
    del restored_tensors, restored_shapes
    stream_restore(self._storage, self._prefix, self._key)
    return None
