"""`ShardedTensor`: a global value held as per-device components laid out by a `Sharding`."""

import numpy as np
import tensorflow as tf


class ShardedTensor:
  """A global tensor stored as one component per mesh device.

  Attributes:
    components: per-device tf.Tensors (mesh row-major order), each of the sharding's shard shape.
    sharding: the `Sharding` of the global value.
    shape: the global shape; dtype: the element type.

  Passing a ShardedTensor to a `gs.function` uses the components in place (no data moves when the
  function wants this sharding). `.numpy()` assembles the global value, with padding removed.
  """

  def __init__(self, components, sharding, shape, dtype, packed=None):
    self._components = tuple(components) if components is not None else None
    self._packed = packed    # (parallel device, packed tensor): how a gs.function result arrives
    self.sharding = sharding
    self.shape = tf.TensorShape(shape)
    self.dtype = tf.as_dtype(dtype)

  @property
  def components(self):
    if self._components is None:
      pd, packed = self._packed
      self._components = tuple(pd.unpack(packed))
    return self._components

  def packed_for(self, pd):
    """The components as one parallel tensor of `pd` (kept from the producing call, or packed once)."""
    if self._packed is None or self._packed[0] is not pd:
      self._packed = (pd, pd.pack(list(self.components)))
    return self._packed[1]

  def numpy(self):
    shape = tuple(self.shape.as_list())
    s = self.sharding
    if s.is_maximal:
      return self.components[s.maximal].numpy()
    s = s.with_rank(len(shape))
    local = s.shard_shape(shape)
    padded = np.zeros([c * s.tiles(d) for d, c in enumerate(local)], self.dtype.as_numpy_dtype)
    done = set()
    for p, comp in enumerate(self.components):
      idx = tuple(s.tile_index(p, d) for d in range(len(shape)))
      if idx in done:
        continue
      done.add(idx)
      padded[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, local))] = comp.numpy()
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


def shard_host_value(value, sharding, shape):
  """Split a global host value into per-position shards (zero-padded to the shard shape)."""
  value = np.asarray(value)
  if sharding.is_maximal or sharding.is_replicated:
    return [value] * sharding.mesh.size
  s = sharding.with_rank(len(shape))
  local = s.shard_shape(shape)
  shards = []
  for p in range(s.mesh.size):
    idx = [s.tile_index(p, d) for d in range(len(shape))]
    piece = value[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, local))]
    pad = [(0, c - n) for c, n in zip(local, piece.shape)]
    shards.append(np.pad(piece, pad) if any(p[1] for p in pad) else piece)
  return shards
