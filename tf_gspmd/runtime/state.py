"""Sharded variable storage: the state a `gs.function` keeps on the mesh devices across calls.

A variable captured by a gs.function is *managed* from its first run: its value lives as one shard per mesh
device (a tf.Variable of the shard shape on that device), laid out by the sharding completion gave its
handle. The partitioned program reads and updates the shards in place; the full value is never put together
during a step. A program run as one graph on the CPUs of a process keeps a small variable's shards there as the
rows of one tf.Variable instead (`ShardedStorage.stacked`), which it reads and writes in one op for every device.

The user's `tf.Variable` object stays the variable: tf_gspmd changes its class to a subclass whose eager
reads (`numpy()`, `value()`, `read_value()`, `tf.convert_to_tensor`) first copy the current shards into it,
whose eager writes (`assign*`) reach the shards before the next step, and whose checkpoint serialisation saves
and restores slices shard by shard (TF's `SaveV2` slice specs), so checkpoints hold global tensors that any
mesh, or plain TF, can read.
"""

import contextlib
import threading
import weakref

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd._layout.annotations import current_mesh
from tf_gspmd._layout.plan_scope import is_shape_only
from tf_gspmd.errors import InputError
from tf_gspmd.runtime import checkpoint
from tf_gspmd.runtime import parallel
from tf_gspmd.runtime.sharded_tensor import ShardedTensor, padded

_lock = threading.RLock()


def _inner(v):
  """The tf.Variable behind `v` (`v` itself, or the one a Keras variable keeps), or None."""
  if _compat.is_resource_variable(v):
    return v
  inner = _compat.keras_inner_variable(v)
  return inner if _compat.is_resource_variable(inner) else None


def storage_of(v):
  """The `ShardedStorage` of a managed variable (tf.Variable or Keras variable), or None."""
  inner = _inner(v)
  return getattr(inner, "_gspmd_storage", None) if inner is not None else None


def layout_of(v, mesh=None):
  """The sharding a managed variable is stored in, or a shape-only variable (gs.plan_scope()) was given (when
  `mesh` is given: only if on it), or None."""
  s = storage_of(v)
  sharding = s.sharding if s is not None else getattr(_inner(v), "_gspmd_planned", None)   # (see _plan)
  if sharding is None or (mesh is not None and sharding.mesh != mesh):
    return None
  return sharding


def sharding_of(x):
  """The `Sharding` of a ShardedTensor or of a variable tf_gspmd stores sharded; None when it does not manage `x`."""
  if isinstance(x, ShardedTensor):
    return x.sharding
  return layout_of(x)


_over_processes = weakref.WeakSet()   # the live storages whose mesh spans several processes


def any_over_processes():
  """Whether this process holds a variable stored on a mesh that spans several processes."""
  return len(_over_processes) > 0


class _Row:
  """Position i's shard of a stacked storage: row i of its one tf.Variable, read and written as a per-device
  shard is (`read_value`, `numpy`, `assign`, and `[index].assign` for part of it)."""

  def __init__(self, storage, i):
    self._storage, self._i = storage, i

  @property
  def shape(self):
    return tf.TensorShape(self._storage.shard_shape)

  @property
  def dtype(self):
    return self._storage.dtype

  @property
  def device(self):
    return self._storage.stack.device

  def read_value(self):
    with tf.device(self.device):
      return self._storage.stack[self._i]

  def numpy(self):
    return self.read_value().numpy()

  def assign(self, value, read_value=False):
    del read_value
    self._storage.stack[self._i].assign(value)

  def __getitem__(self, index):
    return _RowPart(self._storage.stack, (self._i,) + tuple(index))


class _RowPart:
  """A block of one row of a stacked storage (`assign` only)."""

  def __init__(self, stack, index):
    self._stack, self._index = stack, index

  def assign(self, value):
    self._stack[self._index].assign(value)


class ShardedStorage:
  """One shard of a variable per mesh device.

  Attributes:
    sharding: the layout (a `Sharding` of the variable's rank, or maximal/replicated).
    components: this process's per-device tf.Variables of the shard shape (padding included for uneven dims),
      one per position of `positions` (every mesh position unless the mesh spans several processes).
    devices: the mesh's device names, in mesh order.
    stacked: the shards are rows of one tf.Variable of shape [positions] + the shard shape (`stack`), on the
      first local device, and `components` are views of its rows. What a program run as one graph on the CPUs of
      a process (rewriter/one_graph/in_process.py) reads and writes in one op instead of one per device; a program that
      runs per device (TF's collectives) has them stored per device (`manage` converts, shard by shard).
  """

  def __init__(self, variable, sharding, devices, stacked=False):
    self._variable = weakref.ref(variable)
    # Held by a step that reads or writes the shards and by an eager write or read of the variable (`holding`):
    # another thread's write never lands between two devices' reads of one step.
    self.lock = threading.RLock()
    self.shape = tuple(variable.shape.as_list())
    self.dtype = variable.dtype
    self.sharding = sharding if sharding.is_maximal else sharding.with_rank(len(self.shape))
    self.devices = tuple(devices)
    self.positions = parallel.local(self.devices).positions
    self.components = []
    self.stacked = bool(stacked)
    self.stack = None
    self.shards_newer = False   # the shards hold the current value; the tf.Variable's own buffer is stale
    self.host_newer = False     # the tf.Variable was assigned outside a gs.function since the last step
    self._packed = {}
    self._slice_specs = None
    if len(self.positions) < len(self.devices):
      _over_processes.add(self)

  # ---- layout ----------------------------------------------------------------------------------------------
  @property
  def shard_shape(self):
    return self.shape if self.sharding.is_maximal else self.sharding.shard_shape(self.shape)

  def tile_extent(self, p):
    """(starts, lengths) of the global slice device p holds (lengths exclude padding; may be 0)."""
    if self.sharding.is_maximal or self.sharding.is_replicated:
      return (0,) * len(self.shape), self.shape
    local = self.shard_shape
    starts = tuple(self.sharding.tile_index(p, d) * local[d] for d in range(len(self.shape)))
    lengths = tuple(max(0, min(c, n - s)) for c, n, s in zip(local, self.shape, starts))
    return starts, lengths

  def owners(self):
    """One device position per distinct tile (this process's when it holds the tile, else the lowest), for
    saving each slice once."""
    seen, out = set(), []
    order = list(self.positions) + [p for p in range(len(self.devices)) if p not in set(self.positions)]
    for p in order:
      key = self.tile_extent(p)
      if key not in seen:
        seen.add(key)
        out.append(p)
    return out

  # ---- creation and bulk transfer ----------------------------------------------------------------------------
  def create(self, shard_fn):
    """Creates the per-device shards; `shard_fn(p, starts, lengths)` gives device p's unpadded slice."""
    pieces = []
    for p in self.positions:
      with tf.device(self.devices[p]):
        piece = self.padded(shard_fn(p, *self.tile_extent(p)))
        pieces.append(piece if self.stacked else tf.Variable(piece, trainable=False, name=f"gspmd_shard_{p}"))
    if self.stacked:
      with tf.device(self.devices[self.positions[0]]):
        self.stack = tf.Variable(tf.stack(pieces), trainable=False, name="gspmd_shards")
      pieces = [_Row(self, i) for i in range(len(self.positions))]
    self.components = pieces
    self._packed.clear()

  def handles(self):
    """The resource handles a program takes: the stack's, or one per component."""
    return [self.stack.handle] if self.stacked else [c.handle for c in self.components]

  def padded(self, piece):
    """`piece` (a tile) padded with zeros to the shard shape."""
    return padded(tf.convert_to_tensor(piece, self.dtype), self.shard_shape)

  def load(self, value):
    """Writes a global host value into the shards."""
    value = np.asarray(value)
    if self.stacked:
      self._load_ops(tf.constant(value))
      return
    for p, comp in zip(self.positions, self.components):
      starts, lengths = self.tile_extent(p)
      with tf.device(self.devices[p]):
        comp.assign(self.padded(value[tuple(slice(s, s + n) for s, n in zip(starts, lengths))]))

  def gather(self):
    """The global value on the host, assembled from one copy of every tile (when the mesh spans several
    processes and some tile lives only elsewhere: one all-gather over the mesh, which every process must run)."""
    out = np.empty(self.shape, self.dtype.as_numpy_dtype)
    local = dict(zip(self.positions, self.components))
    owners = self.owners()
    if all(p in local for p in owners):
      pieces = {p: local[p].numpy() for p in owners}
    else:
      pieces = parallel.gather_to_host(self.devices, [c.read_value() for c in self.components])
    for p in owners:
      starts, lengths = self.tile_extent(p)
      if all(lengths) or not lengths:
        out[tuple(slice(s, s + n) for s, n in zip(starts, lengths))] = pieces[p][tuple(slice(0, n) for n in lengths)]
    return out

  def packed(self, pd):
    """The shards' handles packed as one parallel tensor of `pd` (cached)."""
    if self.stacked:
      raise AssertionError("a stacked storage has no per-device handles to pack (manage(..., stacked=False))")
    key = id(pd)
    if key not in self._packed:
      self._packed[key] = pd.pack([c.handle for c in self.components])
    return self._packed[key]

  # ---- synchronisation with the tf.Variable object ---------------------------------------------------------------
  def before_step(self):
    """An eager assign since the last step is copied into the shards."""
    if self.host_newer:
      v = self._variable()
      self.load(_plain_read(v))
      self.host_newer = False

  def _load_ops(self, value):
    """Writes the host value `value` (a tensor) into the shards: one assign per component, each of its device's
    tile (eagerly, or traced into the function that loads several variables at once); a stacked storage's in one
    assign of every tile."""
    whole = self.sharding.is_maximal or self.sharding.is_replicated   # every tile is the whole value
    if whole:
      pieces = [self.padded(value)] * len(self.positions)
    else:
      pieces = [self.padded(value[tuple(slice(s, s + n) for s, n in zip(*self.tile_extent(p)))])
                for p in self.positions]
    if self.stacked:
      with tf.device(self.stack.device):
        self.stack.assign(tf.broadcast_to(pieces[0], [len(pieces)] + list(self.shard_shape)) if whole
                          else tf.stack(pieces), read_value=False)
      return
    for p, comp, piece in zip(self.positions, self.components, pieces):
      with tf.device(self.devices[p]):
        comp.assign(piece, read_value=False)

  def after_step(self, written):
    if written:
      self.shards_newer = True

  def flush(self):
    """The tf.Variable's own buffer is brought up to date with the shards (for an eager read)."""
    with self.lock:
      if self.shards_newer:
        v = self._variable()
        _compat.assign_unhooked(v, self.gather())
        self.shards_newer = False

  # ---- checkpoints -------------------------------------------------------------------------------------------------
  def slice_spec(self, p):
    return self.slice_spec_of(*self.tile_extent(p))

  def slice_spec_of(self, starts, lengths):
    """The SaveV2/RestoreV2 slice spec of the block at `starts` of `lengths` ("" for a scalar)."""
    full = " ".join(str(n) for n in self.shape)
    if not self.shape:
      return ""
    parts = ["-" if s == 0 and n == d else f"{s},{n}" for s, n, d in zip(starts, lengths, self.shape)]
    return f"{full} {':'.join(parts)}"

  @property
  def has_elements(self):
    """Whether the value has any element (a split value of none has only empty tiles: it is saved whole)."""
    return all(self.shape)

  def slice_specs(self):
    """{slice spec: device position} with every distinct non-empty tile once ("" = the whole value: replicated,
    a scalar, or a value of no elements, which has no non-empty tile and is saved whole as plain TF saves it)."""
    if self._slice_specs is None:
      if self.sharding.is_maximal or self.sharding.is_replicated or not self.shape or not self.has_elements:
        self._slice_specs = {"": self.sharding.maximal if self.sharding.is_maximal else self.positions[0]}
      else:
        self._slice_specs = {self.slice_spec(p): p for p in self.owners() if all(self.tile_extent(p)[1])}
    return self._slice_specs

  def written_slices(self):
    """{slice spec: device position} of what this process writes in a checkpoint. In one process: every distinct
    tile. Over several processes: the tiles whose lowest device is this process's, so each is written once and by
    one process; a value not split (replicated, or a scalar) by the process of the mesh's first device."""
    specs = self.slice_specs()
    if len(self.positions) == len(self.devices):
      return specs
    if list(specs) == [""]:
      owner = self.sharding.maximal if self.sharding.is_maximal else 0
      return {"": owner} if owner in self.positions else {}
    lowest = {}
    for p in range(len(self.devices)):
      extent = self.tile_extent(p)
      if all(extent[1]):
        lowest.setdefault(extent, p)
    return {self.slice_spec(p): p for p in lowest.values() if p in self.positions}

  def read_slice(self, spec):
    """The current value of one slice this process holds (an eager tensor on its device)."""
    self.before_step()
    p = self.written_slices()[spec]
    if not self.has_elements:   # saved whole: an empty tensor of the global shape (a tile has the shard's)
      with tf.device(self.devices[p]):
        return tf.zeros(self.shape, self.dtype)
    starts, lengths = self.tile_extent(p)
    comp = self.components[self.positions.index(p)]
    with tf.device(self.devices[p]):
      x = comp.read_value()
      if tuple(lengths) != tuple(self.shard_shape):
        x = x[tuple(slice(0, n) for n in lengths)]
    return x

  def probe_spec(self):
    """A one-element slice at the origin of the value ("" for a scalar or an empty value): what TF's own restore is
    asked for while `checkpoint.stream_restore` reads the real slices."""
    if not self.shape or not all(self.shape):
      return ""
    return " ".join(str(n) for n in self.shape) + " " + ":".join("0,1" for _ in self.shape)


def _plain_read(v):
  return _compat.read_unhooked(v)


def _tracing_for_gspmd():
  return current_mesh() is not None


class _ManagedVariable(_compat.ReadHook, _compat.CheckpointHook, _compat.SerializeHook):
  """Mixin for a managed tf.Variable: eager reads see the shards, eager writes reach them, checkpoints save and
  restore the shards.

  Checkpoints go through the SaveableObject API: one SaveSpec per slice. (TF's `_serialize_to_tensors` restore
  path hands a trackable only the first slice of a multi-slice key.)
  """

  def _gspmd_before_read(self):
    """Eagerly: the shards' current value is copied into the variable before it is read. In a plain tf.function
    being traced: a host callback that does the same each time the function runs, before the read (returned, for
    the read to depend on it)."""
    if tf.executing_eagerly():
      self._gspmd_storage.flush()
      return []
    if _tracing_for_gspmd():
      return []
    storage = self._gspmd_storage
    return [tf.py_function(lambda: storage.flush() or True, [], tf.bool, name="gspmd_sync_from_shards")]

  def _gspmd_write(self, method, *args, **kwargs):
    storage = self._gspmd_storage
    if tf.executing_eagerly():
      with storage.lock:   # not while a step reads the shards (it would see the write on some devices only)
        if method == "assign":   # the whole value is replaced: the shards' current value is not needed first
          out = super().assign(*args, **kwargs)
          storage.shards_newer = False
        else:
          storage.flush()
          out = getattr(super(), method)(*args, **kwargs)
        storage.host_newer = True
        return out
    with tf.control_dependencies(self._gspmd_before_read()):
      out = getattr(super(), method)(*args, **kwargs)
    if not _tracing_for_gspmd():   # the next step copies what a plain tf.function wrote into the shards
      written = _plain_read(self)     # (ordered after the write: same variable)
      tf.py_function(lambda _: setattr(storage, "host_newer", True) or True, [written], tf.bool,
                     name="gspmd_mark_host_newer")
    return out

  def assign(self, *args, **kwargs):
    return self._gspmd_write("assign", *args, **kwargs)

  def assign_add(self, *args, **kwargs):
    return self._gspmd_write("assign_add", *args, **kwargs)

  def assign_sub(self, *args, **kwargs):
    return self._gspmd_write("assign_sub", *args, **kwargs)

  def scatter_update(self, *args, **kwargs):
    return self._gspmd_write("scatter_update", *args, **kwargs)

  def scatter_add(self, *args, **kwargs):
    return self._gspmd_write("scatter_add", *args, **kwargs)

  def scatter_sub(self, *args, **kwargs):
    return self._gspmd_write("scatter_sub", *args, **kwargs)

  def scatter_nd_update(self, *args, **kwargs):
    return self._gspmd_write("scatter_nd_update", *args, **kwargs)

  def _gspmd_saveable(self, name):
    target = _compat.checkpoint_restore_target()
    if target is not None and target[1] is self:
      return checkpoint.StreamingRestore(self, name, target[0])
    return checkpoint.SliceSaveable(self, name)

  def _gspmd_serialize(self):
    # Reached when a wrapper (a Keras variable) saves or restores through its tf.Variable.
    storage = self._gspmd_storage
    target = _compat.checkpoint_restore_target()
    key = target[2].get(_compat.VARIABLE_VALUE_KEY) if target is not None and _inner(target[1]) is self else None
    if key is not None:   # a restore: TF reads one element, the slices are streamed by _gspmd_restore
      self._gspmd_pending_restore = (target[0], key)
      spec = storage.probe_spec()
      return {_compat.VARIABLE_VALUE_KEY: {spec: checkpoint.probe_value(storage)} if spec else checkpoint.probe_value(storage)}
    self._gspmd_pending_restore = None
    specs = storage.written_slices()
    if len(storage.positions) < len(storage.devices):
      checkpoint.note_split_variable()
    if list(specs) == [""]:
      return {_compat.VARIABLE_VALUE_KEY: storage.read_slice("")}
    return {_compat.VARIABLE_VALUE_KEY: {spec: storage.read_slice(spec) for spec in specs}}

  def _copy_trackable_to_cpu(self, object_map):
    # An asynchronous save (CheckpointOptions(enable_async=True)) first copies what it saves to the host, blocking
    # the step; the copy of a sharded variable is this process's written tiles (a HostSnapshot, also in place of the
    # whole host copy TF made while the variable was plain). TF makes its first copy eagerly and traces every later
    # one into a tf.function it reruns for each save: there the copy is a host callback, so every save copies the
    # variable as it is then (an eager write since the last step brought into the shards, the current layout),
    # not as it was when traced.
    snapshot = object_map.get(self)
    if not isinstance(snapshot, checkpoint.HostSnapshot):
      snapshot = object_map[self] = checkpoint.HostSnapshot(self)
    if tf.executing_eagerly():
      snapshot.refresh()
    else:
      tf.py_function(lambda: snapshot.refresh() or True, [], tf.bool, name="gspmd_async_checkpoint_copy")

  def _gspmd_restore(self, tensor):
    # Reached when a wrapper (a Keras variable) restores through its tf.Variable.
    pending = getattr(self, "_gspmd_pending_restore", None)
    if pending is not None:
      self._gspmd_pending_restore = None
      checkpoint.stream_restore(self._gspmd_storage, *pending)
    else:   # one whole tensor
      checkpoint.restore(self._gspmd_storage, tensor)


@contextlib.contextmanager
def holding(storages):
  """Holds the locks of `storages` (taken in one order, so two steps sharing variables never wait on each other in a
  cycle): what a step reads of their shards is one version of each variable."""
  locks = [st.lock for st in sorted(set(storages), key=id)]
  for lock in locks:
    lock.acquire()
  try:
    yield
  finally:
    for lock in reversed(locks):
      lock.release()


_classes = {}


def _managed_class(cls):
  with _lock:
    if cls not in _classes:
      _classes[cls] = type(f"Sharded{cls.__name__}", (_ManagedVariable, cls), {"__module__": cls.__module__})
    return _classes[cls]


def manage(v, sharding, devices, what=None, stacked=None):
  """Stores variable `v` sharded as `sharding` on `devices` (re-laid out when it is stored otherwise); stacked
  or per device as `stacked` says (None: as it is stored, per device when new; see ShardedStorage). A shape-only
  variable (gs.plan_scope()) is not stored: its layout is recorded (`_plan`), and None returned."""
  inner = _inner(v)
  if inner is None:
    raise InputError(f"{what or v!r} is not a resource variable; tf_gspmd stores tf.Variables and Keras variables")
  if is_shape_only(inner):
    return record_plan(inner, sharding)
  with _lock:
    storage = getattr(inner, "_gspmd_storage", None)
    want = sharding if sharding.is_maximal else sharding.with_rank(inner.shape.rank)
    if storage is not None and storage.sharding == want and storage.devices == tuple(devices):
      if stacked is None or storage.stacked == bool(stacked):
        return storage
      # The same layout stored the other way: copied shard by shard on the devices.
      new = ShardedStorage(inner, want, devices, stacked=stacked)
      rows = [c.read_value() for c in storage.components]
      new.create(lambda p, starts, lengths: rows[storage.positions.index(p)][tuple(slice(0, n) for n in lengths)])
      new.shards_newer, new.host_newer = storage.shards_newer, storage.host_newer
      inner._gspmd_storage = new   # pylint: disable=protected-access
      return new
    if storage is not None:   # another layout: through the host, once
      value = storage.gather() if storage.shards_newer else _plain_read(inner).numpy()
    else:
      value = None
    new = ShardedStorage(inner, want, devices, stacked=bool(stacked))
    if value is None and getattr(inner, "_gspmd_init", None) is not None:
      new.create(inner._gspmd_init)   # pylint: disable=protected-access  (each shard on its own device)
      new.shards_newer = True
      inner._gspmd_init = None   # pylint: disable=protected-access
    else:
      if value is None:
        value = _plain_read(inner).numpy()
      new.create(lambda p, starts, lengths: value[tuple(slice(s, s + n) for s, n in zip(starts, lengths))])
      new.shards_newer = storage is not None
    inner._gspmd_storage = new   # pylint: disable=protected-access
    if not isinstance(inner, _ManagedVariable):
      inner.__class__ = _managed_class(type(inner))
    return new


def record_plan(inner, sharding):
  """A shape-only variable (created in gs.plan_scope()) has no value to store: the layout it is given is recorded
  for lowering to pin (`layout_of`), as a stored variable's is, and nothing is created on the devices. (Running a
  gs.function that captures it raises InputError naming it.)"""
  # pylint: disable-next=protected-access
  inner._gspmd_planned = sharding if sharding.is_maximal else sharding.with_rank(inner.shape.rank)
  return None


_compat.install_checkpoint_save_hook(checkpoint.save_hook(storage_of))

_compat.install_async_checkpoint_copy_key(checkpoint.async_copy_key(storage_of))
