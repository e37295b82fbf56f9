"""Keras weight files with sharded variables: written variable by variable and tile by tile, read slice by slice.

`model.save_weights("*.weights.h5")`, `model.load_weights(...)` and keras-hub's `save_to_preset` / `from_preset`
(which call them) write and read one variable at a time through Keras's H5IOStore. Left alone, each variable
tf_gspmd stores sharded would be put together whole on the host for writing, and read whole from the file for
loading. With `import tf_gspmd.keras`:

* saving a sharded variable creates its dataset in the file and writes every distinct tile from the device that
  holds it (`ds[index] = tile`): the extra memory is one tile; optimizer slots are handed to the store as
  variables (Keras gives it `variable.numpy()`), so they stream too.
* over several processes every process makes the same `save_weights(path)` call: process 0 writes the file, the
  tiles of a variable split over processes written by the process of their lowest device (another process's go
  through a part file that process 0 copies in tile by tile; see "several processes" below).
* reading a dataset of a weights file on disk gives a NumPy array mapped from the file (copy-on-write), not read
  into memory; assigning a NumPy array to a sharded Keras variable writes each device's slice to its shard and
  touches only those slices of the array. So a load reads only the slices this process keeps, one tile at a
  time, and the mapped pages are handed back after each tile. Arrays that outlive the load (a layer keeping a
  value from the store) are made private copies when the store closes, so later writes to the file cannot
  change them.

The files are Keras's own: plain Keras reads what a sharded model saved, and the other way round; a file loads
onto any mesh and layout.
"""

import ctypes
import ctypes.util
import io
import itertools
import math
import mmap
import os
import pathlib
import weakref

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import cluster as _cluster
from tf_gspmd._platform import compat as _compat
from tf_gspmd import initializers
from tf_gspmd.errors import InputError
from tf_gspmd.runtime import checkpoint as _checkpoint
from tf_gspmd.runtime import state as _state

# madvise(2)'s MADV_PAGEOUT (Linux 5.4+): reclaim the range's pages now. Clean file pages are dropped (read again
# from the file when touched), copy-on-write pages are kept, so nothing written to a mapping is ever lost.
_MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)

_READ_SPAN = 8 << 20   # bytes of a mapped file read between two hand-backs of its pages

_installed = []


# ---- which variables stream -----------------------------------------------------------------------------------

def _local_tiles(storage):
  """{(starts, lengths): [this process's positions holding that tile]} for every non-empty tile held here."""
  out = {}
  for p in storage.positions:
    extent = storage.tile_extent(p)
    if all(extent[1]):
      out.setdefault(extent, []).append(p)
  return out


def _save_tiles(storage):
  """The tiles to write, one position each to read it from, when this process holds every distinct tile of the
  variable; else None."""
  if storage.sharding.is_maximal:
    p = storage.sharding.maximal
    return {storage.tile_extent(p): [p]} if p in storage.positions else None
  local = _local_tiles(storage)
  every = {storage.tile_extent(p) for p in range(len(storage.devices)) if all(storage.tile_extent(p)[1])}
  return local if every <= set(local) else None


def _sharded(value):
  """The ShardedStorage of `value` when it is a variable tf_gspmd stores sharded (and has created its shards),
  else None."""
  if not tf.executing_eagerly() or isinstance(value, (np.ndarray, tf.Tensor)):
    return None
  try:
    storage = _state.storage_of(value)
  except (AttributeError, TypeError):
    return None
  return storage if storage is not None and storage.components else None


def _streamable(value):
  """The ShardedStorage of `value` when it is stored sharded and every tile of it lives in this process (so it
  can be written from here), else None."""
  storage = _sharded(value)
  return storage if storage is not None and _save_tiles(storage) is not None else None


def _index(starts, lengths):
  return tuple(slice(s, s + n) for s, n in zip(starts, lengths))


# ---- saving -----------------------------------------------------------------------------------------------------

@initializers.large_blocks_unmapped()   # tiles freed by one eager thread, allocated anew by another
def _write(group, key, storage):
  """Dataset `key` of `group`: the variable's global value, written tile by tile from the devices."""
  storage.before_step()   # an eager assign since the last step reaches the shards first
  dtype = storage.dtype.as_numpy_dtype
  ds = group.create_dataset(key, shape=storage.shape, dtype=dtype)
  if storage.dtype == tf.bfloat16:
    ds.attrs["dtype"] = "bfloat16"   # as Keras marks it
  for (starts, lengths), positions in _save_tiles(storage).items():
    p = positions[0]
    comp = storage.components[storage.positions.index(p)]
    with tf.device(storage.devices[p]):
      piece = comp.read_value()
      if tuple(lengths) != tuple(piece.shape.as_list()):
        piece = piece[_index((0,) * len(lengths), lengths)]
    ds[_index(starts, lengths) if lengths else ()] = piece.numpy()
    del piece


def _store_setitem(original):
  def __setitem__(self, key, value):  # pylint: disable=invalid-name
    shared = self.__dict__.get("_gspmd_shared")
    if shared is not None:
      storage = _sharded(value)
      if storage is not None and _save_tiles(storage) is None:   # tiles in several processes
        return _write_own_tiles(self, shared, key, storage)
      if _cluster.process_index() != 0:
        return None   # the chief writes what it holds whole
    elif self.mode in ("w", "a") and _cluster.is_multi_process():
      split = _sharded(value)
      if split is not None and _save_tiles(split) is None:
        raise InputError(f"weights entry {key!r} is a variable of shape {list(split.shape)} whose tiles are in "
                         f"several processes, and this store (a .keras archive or an in-memory file) would be "
                         f"written whole by every process: save its weights with model.save_weights(path) to a "
                         f"'.weights.h5' path (process 0 writes it from every process's tiles) or with "
                         f"tf.train.Checkpoint")
    storage = _streamable(value)
    if storage is None or self.mode not in ("w", "a"):
      return original(self, key, value)
    return _write(_compat.keras_store_entry_group(self, create=True), key, storage)
  return __setitem__


def _sharded_store_setitem(original, base_setitem):
  def __setitem__(self, key, value):  # pylint: disable=invalid-name
    storage = _streamable(value)
    if storage is None:
      split = _sharded(value)
      if split is not None and _cluster.is_multi_process():
        raise InputError(f"weights file entry {key!r} is a variable of shape {list(split.shape)} whose tiles are in "
                         f"several processes; a file split by max_shard_size is written whole by every process: "
                         f"call save_weights without max_shard_size (one .weights.h5 file, which process 0 "
                         f"writes from every process's tiles)")
      return original(self, key, value)
    record = _compat.keras_sharded_store_add(self, key, math.prod(storage.shape) * storage.dtype.size)
    base_setitem(self, key, value)
    record()
    return None
  return __setitem__


def _optimizer_save_own_variables(original):
  def save_own_variables(self, store):
    """Keras's (each variable as `store[str(i)]`), handing sharded slots to the store as variables, which write
    tile by tile, instead of as whole NumPy values."""
    if not isinstance(store, _compat.keras_weight_store_classes()) or not any(
        _sharded(v) is not None for v in self.variables):
      return original(self, store)
    for i, variable in enumerate(self.variables):
      store[str(i)] = variable if _sharded(variable) is not None else variable.numpy()
    return None
  return save_own_variables


# ---- several processes: one file ----------------------------------------------------------------------------------
# While the process holds variables on a mesh of several processes, every process makes the same
# `save_weights(path)` call. Process 0 (the chief) writes the file; the others' stores are in memory and keep
# nothing but Keras's groups. A variable with tiles in several processes is written tile by
# tile, each distinct tile by the process of its lowest device (the checkpoint's rule): the chief's into the file's
# dataset, another process's into a part file beside it (`<path>.gspmd-part-K-of-N`). When the stores close the
# processes check that they saved to one path, the chief copies each part's tiles into the file one tile at a time
# and removes the part, and a barrier ends the save. No process holds more than one tile of a variable.

_weight_saves = itertools.count()


def _shared_file(original):
  def _get_h5_file(self, path_or_io, mode=None):
    if ((mode or self.mode) != "w" or type(self) is not _compat.keras_weight_store_classes()[0] or self.archive
        or not isinstance(path_or_io, pathlib.Path) or not _cluster.is_multi_process()
        or not _state.any_over_processes()):   # no variable on a mesh of several processes: Keras's own save
      return original(self, path_or_io, mode)
    self.__dict__["_gspmd_shared"] = {"path": str(path_or_io), "part": None}
    if _cluster.process_index() == 0:
      return original(self, path_or_io, mode)
    import h5py  # pylint: disable=g-import-not-at-top
    return h5py.File(io.BytesIO(), "w")
  return _get_h5_file


@initializers.large_blocks_unmapped()   # tiles freed by one eager thread, allocated anew by another
def _write_own_tiles(store, shared, key, storage):
  """Entry `key`: this process's tiles of a variable split over processes (the chief's into the file, another
  process's into its part file), one at a time."""
  import h5py  # pylint: disable=g-import-not-at-top
  storage.before_step()
  group = _compat.keras_store_entry_group(store, create=True)
  k, n = _cluster.process_index(), _cluster.process_count()
  if k == 0:
    target = group.create_dataset(key, shape=storage.shape, dtype=storage.dtype.as_numpy_dtype)
    if storage.dtype == tf.bfloat16:
      target.attrs["dtype"] = "bfloat16"   # as Keras marks it
  else:
    if shared["part"] is None:
      shared["part"] = h5py.File(f"{shared['path']}.gspmd-part-{k:05d}-of-{n:05d}", "w")
    target = shared["part"].require_group(f"{group.name}/{key}")
  for i, (spec, p) in enumerate(storage.written_slices().items()):
    starts, lengths = storage.tile_extent(p)
    piece = storage.read_slice(spec)
    data = piece.numpy()
    del piece
    if k == 0:
      target[_index(starts, lengths)] = data
    else:
      target.create_dataset(str(i), data=data).attrs["starts"] = list(starts)
    del data


@initializers.large_blocks_unmapped()   # tiles freed by one eager thread, allocated anew by another
def _merge_part(h5_file, part_path):
  """Copies the tiles of part file `part_path` into the datasets of `h5_file`, one tile at a time."""
  import h5py  # pylint: disable=g-import-not-at-top
  with h5py.File(part_path, "r") as part:
    tiles = []
    part.visititems(lambda name, obj: tiles.append(name) if isinstance(obj, h5py.Dataset) else None)
    for name in tiles:
      tile = part[name]
      starts = [int(s) for s in tile.attrs["starts"]]
      h5_file[name.rsplit("/", 1)[0]][_index(starts, tile.shape)] = tile[()]


def _finish_shared_save(store, shared, close):
  """Ends a save over several processes (see above); `close` closes the store's file."""
  part = shared["part"]   # (None when nothing of this model is split over processes: the chief's file is whole;
  # the processes still check their paths and wait for it, so that none reads the file before it is written)
  k, n = _cluster.process_index(), _cluster.process_count()
  path, tag = shared["path"], f"tf_gspmd_weights_{next(_weight_saves)}"
  part_path = part.filename if part is not None else ""
  if part is not None:
    part.close()
  ex = _checkpoint.exchange(path, "weights")
  ex.publish(f"{tag}/path/{k}", path, "publishing its path")
  ex.publish(f"{tag}/part/{k}", part_path, "writing its part")
  try:
    paths = [ex.lookup(f"{tag}/path/{j}", j, "publishing its path") for j in range(n)]
    if len(set(paths)) > 1:
      if part_path:
        os.remove(part_path)
      raise InputError(f"the processes save one weights file to different paths ({dict(enumerate(paths))}): every "
                       f"process must call save_weights with the same path (process 0 writes the file from every "
                       f"process's tiles); give them one path")
    if k == 0:
      for j in range(1, n):
        other = ex.lookup(f"{tag}/part/{j}", j, "writing its part")
        if other:
          _merge_part(store.h5_file, other)
          os.remove(other)
  finally:
    close(store)
  ex.barrier(f"{tag}/merged", "waiting for process 0 to assemble the file")


# ---- loading ------------------------------------------------------------------------------------------------------

def _mapped_dtype(ds):
  if ds.attrs.get("dtype", None) == "bfloat16" and ds.dtype.itemsize == 2:
    return np.dtype(tf.bfloat16.as_numpy_dtype)
  if ds.dtype.kind in "biufc" and not ds.dtype.hasobject:
    return ds.dtype
  return None


def _map(ds):
  """Dataset `ds` as a copy-on-write NumPy array mapped from its file, or None when it cannot be mapped (not a
  plain file, chunked or compressed storage, a scalar, no stored data, a non-numeric type)."""
  dtype = _mapped_dtype(ds)
  if _LIBC_MMAP is None or dtype is None or not ds.shape or ds.size == 0:
    return None
  if ds.chunks is not None or ds.compression is not None:
    return None
  if ds.file.driver != "sec2" or not os.path.isfile(ds.file.filename):
    return None
  offset = ds.id.get_offset()
  if offset is None:
    return None
  nbytes = ds.size * dtype.itemsize
  start = offset - offset % mmap.ALLOCATIONGRANULARITY
  with open(ds.file.filename, "rb") as f:
    if os.fstat(f.fileno()).st_size < offset + nbytes:
      return None
    mapping = mmap.mmap(f.fileno(), offset - start + nbytes, access=mmap.ACCESS_COPY, offset=start)
  return mapping, np.ndarray(ds.shape, dtype, buffer=mapping, offset=offset - start)


def _store_getitem(original):
  def __getitem__(self, key):  # pylint: disable=invalid-name
    mapped = _map(_compat.keras_store_dataset(self, key)) if self.mode == "r" else None
    if mapped is None:
      return original(self, key)
    mapping, array = mapped
    self.__dict__.setdefault("_gspmd_mappings", []).append(weakref.ref(mapping))
    return array
  return __getitem__


def _load_libc_mmap():
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = libc.mmap
  except (OSError, AttributeError, TypeError):
    return None
  fn.restype = ctypes.c_void_p
  fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
  return fn


# mmap(2) itself: a file mapping is replaced in place (MAP_FIXED) by anonymous memory holding the same bytes.
_LIBC_MMAP = _load_libc_mmap() if hasattr(mmap, "MAP_ANONYMOUS") else None
_MAP_FIXED = 0x10   # Linux's value on every architecture


def _make_private(mapping):
  """The pages of `mapping` replaced, at the same addresses, by anonymous memory with the same bytes: arrays over
  it keep their values however the file changes later (a truncated file would fault every reader of its pages,
  copy-on-write ones included)."""
  anchor = ctypes.c_char.from_buffer(mapping)
  address, length = ctypes.addressof(anchor), len(mapping)
  data = ctypes.create_string_buffer(length)
  ctypes.memmove(data, address, length)
  got = _LIBC_MMAP(address, length, mmap.PROT_READ | mmap.PROT_WRITE,
                   mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
  if got != address:
    raise OSError(ctypes.get_errno(), f"mmap(MAP_FIXED) could not replace a weights file mapping at {address:#x}")
  ctypes.memmove(address, data, length)
  del anchor


def _sharded_store_getitem(original):
  def __getitem__(self, key):  # pylint: disable=invalid-name
    # A key in another shard file is read after switching to it, then the newest file is reopened (closing the
    # other): the array being returned is not made private then.
    self.__dict__["_gspmd_reading"] = True
    try:
      return original(self, key)
    finally:
      self.__dict__["_gspmd_reading"] = False
  return __getitem__


def _store_close(original):
  def close(self):
    if self.__dict__.get("_gspmd_reading"):
      return original(self)
    shared = self.__dict__.pop("_gspmd_shared", None)
    if shared is not None:
      return _finish_shared_save(self, shared, original)
    try:
      for ref in self.__dict__.pop("_gspmd_mappings", []):
        mapping = ref()
        if mapping is not None:   # an array from this store outlives the load
          _make_private(mapping)
    finally:
      original(self)
    return None
  return close


def _mapping_of(array):
  base = array.base
  while isinstance(base, np.ndarray):
    base = base.base
  return base if isinstance(base, mmap.mmap) else None


def _release(mapping):
  try:
    mapping.madvise(_MADV_PAGEOUT)
  except (OSError, ValueError):   # an older kernel: the pages go when the array does
    pass


def _read_slice(value, starts, lengths):
  """`value[starts:starts+lengths]` as a new array. From an array mapped from a file, it is copied a few MiB of
  the file at a time, each piece's pages handed back before the next (a slice across the inner dimensions touches
  pages all over the file)."""
  index = _index(starts, lengths)
  mapping = _mapping_of(value)
  if mapping is None or not lengths:
    return np.array(value[index] if lengths else value)
  out = np.empty(lengths, value.dtype)
  span = max(1, _READ_SPAN // max(1, value[0].nbytes))   # rows of the global value per piece
  for i in range(0, lengths[0], span):
    n = min(span, lengths[0] - i)
    out[i:i + n] = value[(slice(starts[0] + i, starts[0] + i + n),) + index[1:]]
    _release(mapping)
  return out


@initializers.large_blocks_unmapped()   # tiles freed by one eager thread, allocated anew by another
def _assign_tiles(storage, value):
  """Writes NumPy array `value` (the global value) into the shards this process holds, one distinct tile at a
  time, reading only those slices of `value` (over several processes, each reads its own)."""
  shard_shape = tuple(storage.shard_shape)
  tiles = _local_tiles(storage)
  for (starts, lengths), positions in tiles.items():
    piece = tf.convert_to_tensor(_read_slice(value, starts, lengths))
    if piece.dtype != storage.dtype:
      piece = tf.cast(piece, storage.dtype)
    if tuple(lengths) != shard_shape:
      piece = tf.pad(piece, [(0, c - n) for c, n in zip(shard_shape, lengths)])
    for p in positions:
      with tf.device(storage.devices[p]):
        storage.components[storage.positions.index(p)].assign(piece)
    del piece
  if not storage.sharding.is_maximal and not storage.sharding.is_replicated:
    for p, comp in zip(storage.positions, storage.components):   # tiles of padding only
      if storage.tile_extent(p) not in tiles:
        with tf.device(storage.devices[p]):
          comp.assign(tf.zeros(shard_shape, storage.dtype))
  storage.shards_newer = True   # the variable's own buffer is stale; an eager read puts the shards together
  storage.host_newer = False


def _variable_assign(original):
  def assign(self, value):
    """Keras's `assign`; a NumPy value (a weights file's array, `set_weights`) given to a variable stored sharded
    goes to the shards slice by slice, never converted whole."""
    if isinstance(value, np.ndarray) and tf.executing_eagerly() and not _compat.keras_in_stateless_scope():
      storage = _sharded(self)
      if storage is not None and tuple(value.shape) == tuple(storage.shape):
        _assign_tiles(storage, value)
        return self
    return original(self, value)
  return assign


def install():
  """Installs the hooks on Keras's weight stores, optimizers and TF-backend variables (idempotent)."""
  if _installed:
    return
  import keras  # pylint: disable=g-import-not-at-top
  store, sharded_store = _compat.keras_weight_store_classes()
  store.__setitem__ = _store_setitem(store.__setitem__)
  sharded_store.__setitem__ = _sharded_store_setitem(sharded_store.__setitem__, store.__setitem__)
  store.__getitem__ = _store_getitem(store.__getitem__)
  sharded_store.__getitem__ = _sharded_store_getitem(sharded_store.__getitem__)
  store._get_h5_file = _shared_file(store._get_h5_file)   # pylint: disable=protected-access
  store.close = _store_close(store.close)
  sharded_store.close = _store_close(sharded_store.close)
  optimizer = keras.optimizers.Optimizer
  optimizer.save_own_variables = _optimizer_save_own_variables(optimizer.save_own_variables)
  variable = _compat.keras_variable_class()
  variable.assign = _variable_assign(variable.assign)
  _installed.append(True)
