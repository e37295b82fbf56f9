"""`gs.shards_of`: each device's piece of a ShardedTensor or of a variable tf_gspmd stores sharded."""

import tensorflow as tf

from tf_gspmd.errors import InputError
from tf_gspmd.runtime.cross_mesh import tile_extent
from tf_gspmd.runtime.sharded_tensor import ShardedTensor
from tf_gspmd.runtime.state import storage_of


class Shard:
  """One device's piece of a sharded value (as JAX's `Array.addressable_shards` lists them).

  Attributes:
    device: the mesh device's name.
    position: its position in the mesh (row-major).
    index: a tuple of slices, one per dimension, into the global value: the rows this piece holds. Padding of an
      uneven split is excluded, so the index ends at the global size and a device whose tile holds padding only
      has an empty slice (`slice(n, n)`) there.
    shape: the piece's shape, the lengths of `index` (padding excluded).
  `numpy()` (or `value()`, a tf.Tensor on the device) reads this piece only.
  """

  def __init__(self, device, position, index, read):
    self.device = device
    self.position = position
    self.index = index
    self.shape = tuple(s.stop - s.start for s in index)
    self._read = read

  def value(self):
    """The piece as a tf.Tensor on its device (padding removed)."""
    return self._read()

  def numpy(self):
    return self._read().numpy()

  def __repr__(self):
    return f"Shard(device={self.device!r}, index={self.index}, shape={self.shape})"


def _cut(component, device, lengths):
  def read():
    with tf.device(device):
      x = tf.identity(component.read_value() if hasattr(component, "read_value") else component)
      return x if tuple(x.shape.as_list()) == tuple(lengths) else x[tuple(slice(0, n) for n in lengths)]
  return read


def shards_of(x):
  """Each device's piece of a ShardedTensor or of a variable tf_gspmd stores sharded: a list of `Shard`s (device,
  index into the global value, shard shape, `numpy()`), one per mesh device this process holds, in mesh order.

  Padding of uneven splits is excluded from every index and shape (and from the values read). Raises InputError
  for anything else (a plain tensor, a variable tf_gspmd does not manage).
  """
  if isinstance(x, ShardedTensor):
    shape = tuple(x.shape.as_list())
    s = x.sharding
    devices = x._mesh_devices or s.mesh.resolve_devices()  # pylint: disable=protected-access
    out = []
    for p, comp in zip(x.positions, x.components):
      if s.is_maximal and p != s.maximal:
        continue
      starts, lengths = tile_extent(s, shape, p)
      out.append(_shard_record(devices[p], p, shape, starts, lengths, comp))
    return out
  storage = storage_of(x)
  if storage is None:
    raise InputError(f"gs.shards_of needs a ShardedTensor or a variable tf_gspmd stores sharded; got {type(x).__name__} "
                     f"of shape {getattr(x, 'shape', None)} "
                     f"(gs.sharding_of(x) is None for it)")
  storage.before_step()   # an eager assign since the last step reaches the shards first
  return [_shard_record(storage.devices[p], p, storage.shape, *storage.tile_extent(p), comp)
          for p, comp in zip(storage.positions, storage.components)]


def _shard_record(device, p, shape, starts, lengths, component):
  starts = tuple(min(a, n) for a, n in zip(starts, shape))   # a padding-only tile: an empty slice at the end
  index = tuple(slice(a, a + n) for a, n in zip(starts, lengths))
  return Shard(device, p, index, _cut(component, device, lengths))
