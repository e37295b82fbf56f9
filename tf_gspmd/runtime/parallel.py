"""The devices a process drives: one ParallelDevice over this process's mesh devices, and host transfers that
cross processes.

A mesh may span several processes (`gs.initialize`); each process runs the per-device program on its own
devices only, with the partition ids of their mesh positions, and TF's collective runtime joins the groups
across processes. A host value that needs shards another process holds is fetched with one all-gather over
every mesh device: a collective, so every process must ask for it, in the same order (as with any step).
"""

import itertools
import threading
import zlib

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import cluster as _cluster
from tf_gspmd._platform import compat as _compat
from tf_gspmd.errors import InputError
from tf_gspmd.rewriter.collectives import vocabulary

_lock = threading.Lock()
_parallel_devices = {}
_HOST_GATHER_GROUPS = 1 << 30       # group keys of host gathers: above every program's (those are < 2**30 + 1)
_host_instances = itertools.count(1 << 28)
HOST_GATHER_TIMEOUT = 300.0
# Dtypes an all-gather (and a cross-mesh send) carries wider (bit-exact), as in the programs.
CARRIED = {tf.bool: tf.int32, tf.int8: tf.int32, tf.uint8: tf.int32, tf.int16: tf.int32, tf.uint16: tf.int32,
            tf.bfloat16: tf.float32}


class Local:
  """This process's share of a mesh: its positions, a ParallelDevice over their devices, their partition ids."""

  def __init__(self, devices):
    self.devices = tuple(devices)
    self.positions = tuple(p for p, d in enumerate(self.devices) if _cluster.is_local(d))
    if not self.positions:
      raise InputError(f"none of the mesh devices {self.devices} belongs to this process; a mesh must include "
                       "devices of every process that runs the program")
    self.pd = _new_parallel_device([self.devices[p] for p in self.positions])
    self.pid = self.constants(self.positions)
    self.name = _compat.parallel_device_name(self.pd)

  def constants(self, values, dtype=tf.int32):
    """A parallel tensor holding `values[k]` on the k-th local device."""
    comps = []
    for p, v in zip(self.positions, values):
      with tf.device(self.devices[p]):
        comps.append(tf.identity(tf.constant(v, dtype)))
    return self.pd.pack(comps)

  def broadcast(self, value, dtype=tf.int32):
    """A value as a parallel tensor (the same on every local device)."""
    return self.constants([value] * len(self.positions), dtype)

  @property
  def fully_local(self):
    return len(self.positions) == len(self.devices)


def local(devices):
  """The (cached) `Local` of the mesh devices `devices` in this process."""
  devices = tuple(devices)
  with _lock:
    if devices not in _parallel_devices:
      _parallel_devices[devices] = Local(devices)
    return _parallel_devices[devices]


def _new_parallel_device(devices):
  """A ParallelDevice over `devices`, skipping custom-device names other libraries (DTensor) registered."""
  for _ in range(64):
    try:
      return _compat.parallel_device(devices)
    except tf.errors.AlreadyExistsError:
      continue   # the name counter has moved on; the next name is free
  raise InputError("could not register a parallel device: 64 custom device names are taken")


@tf.function(autograph=False)
def _all_gather(rows, ids, group_size, group_key, rows_key, ids_key):
  """Every device's `rows` and `ids`, gathered over the group: two all-gathers, the second launched after the first
  (a control edge: every device launches them in one order)."""
  def gather(x, instance_key):
    return vocabulary.BY_KIND["all-gather"].build(input=x, group_size=group_size, group_key=group_key,
                                                  instance_key=instance_key, ordering_token=[],
                                                  timeout_seconds=HOST_GATHER_TIMEOUT)

  gathered = gather(rows, rows_key)
  with tf.control_dependencies([gathered]):
    return gathered, gather(ids, ids_key)


def gather_to_host(devices, components):
  """{mesh position: numpy value} of every device's component, from this process's `components` (one per local
  position, all of one shape and dtype). Within one process nothing moves between devices; across processes
  this is one all-gather over all mesh devices (every process must call it for the same value)."""
  where = local(devices)
  if where.fully_local:
    return {p: c.numpy() for p, c in zip(where.positions, components)}
  dtype = components[0].dtype
  carried = CARRIED.get(dtype, dtype)
  if dtype.is_complex or dtype in (tf.string, tf.variant, tf.resource):
    raise InputError(f"a {dtype.name} value split across processes cannot be fetched to the host (TF collectives "
                     "cannot carry it); return it replicated or as numbers")
  shape = components[0].shape.as_list()
  flat = []
  for p, c in zip(where.positions, components):
    with tf.device(where.devices[p]):
      flat.append(tf.reshape(tf.cast(c, carried), [1, -1]))
  ids = where.constants([[p] for p in where.positions])
  key = _HOST_GATHER_GROUPS + (zlib.crc32("|".join(where.devices).encode()) & 0x3FFFFFF)
  consts = [where.broadcast(v) for v in (len(where.devices), key, next(_host_instances), next(_host_instances))]
  with tf.device(where.name):
    rows, order = (where.pd.unpack(t)[0] for t in _all_gather(where.pd.pack(flat), ids, *consts))
  rows = tf.cast(rows, dtype).numpy()
  return {int(p): rows[k].reshape(shape) for k, p in enumerate(order.numpy())}

