"""The groups of a mesh's devices: who takes part in a collective, worked out once.

Groups are sets of mesh devices that differ only along some mesh axes (`MeshGroups.groups`). Where the groups of
some axes join several processes with L > 1 members in each, they split in two levels (`MeshGroups.levels`):
within each process, and across processes among the members of one local rank. `ranked_groups` is the record of a
collective's groups, members in TF's runtime rank order, which the collectives' records carry (report.Emitted) and
the one-graph form reads. Group keys derive from the member device names (the same in every process); instance
keys come from one process-wide counter.
"""

import functools
import itertools
import threading
import zlib

import numpy as np
import tensorflow as tf

from tf_gspmd.rewriter.report import Groups

_lock = threading.Lock()
_group_keys = {}          # key -> member device names
_instance_counter = itertools.count(1 << 16)


def group_key(members):
  """A stable int32 key for a group of devices, unique within the process.

  The order of `members` counts: a collective-permute's transfer a -> b and one b -> a get different keys.
  """
  with _lock:
    key = (zlib.crc32("|".join(members).encode()) & 0x3FFFFFFF) + 1
    while key in _group_keys and _group_keys[key] != tuple(members):
      key = key % 0x3FFFFFFF + 1
    _group_keys[key] = tuple(members)
    return key


def group_members(key):
  """The member device names of the group with `key`, in the order they were given to `group_key`."""
  with _lock:
    return _group_keys[key]


def next_instance_key():
  with _lock:
    return next(_instance_counter)


def rank_key(name):
  """The order of TF's collective runtime among group members (their runtime ranks)."""
  spec = tf.DeviceSpec.from_string(name)
  return (spec.job or "", spec.replica or 0, spec.task or 0, spec.device_type or "", spec.device_index or 0)



class Levels:
  """The two levels of a mesh axes' groups that join several processes with L > 1 members in each.

  `within` and `across` are (group index per position, members per group in runtime rank order): the groups of
  the members of one process, and those of the members of one local rank j (one per process). `order[p]`, per
  position, lists the group's members (their indices in mesh order) by slot j * processes + q: the member of
  local rank j and, among its peers across processes, rank q.
  """

  def __init__(self, per_process, processes, within, across, order):
    self.per_process, self.processes = per_process, processes
    self.within, self.across, self.order = within, across, order

  def note(self, kind):
    first = {"all-gather": "across processes, then within each",
             "all-reduce": "reduce-scatter within each process, all-reduce across, all-gather within",
             "reduce-scatter": "within each process, then across"}[kind]
    return (f"hierarchical ({self.per_process} members in each of {self.processes} processes): {first}; "
            f"1/{self.per_process} of the data crosses processes")


class MeshGroups:
  """The groups of `mesh`'s devices (`devices`, one per position) along any mesh axes, their levels across
  `processes` (per position the process that drives it; None: all in one) and their records."""

  def __init__(self, mesh, devices, processes=None):
    self.mesh = mesh
    devices = devices or mesh.devices   # planned without them: the devices the mesh names, if any
    self.devices = tuple(devices) if devices else tuple(f"/job:localhost/replica:0/task:0/device:CPU:{p}"
                                                         for p in range(mesh.size))
    self.processes = processes
    self._groups = {}
    self._levels = {}
    self._ranked = {}
    self._transfers = {}

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

  def group_size(self, axes):
    """The number of members of each group of `axes`."""
    return len(self.groups(axes)[1][0])

  def _crosses_processes(self, axes):
    """Whether the groups along `axes` join devices of different processes."""
    if self.processes is None or not axes:
      return False
    return any(len({self.processes[p] for p in m}) > 1 for m in self.groups(axes)[1])

  def levels(self, axes):
    """The two levels of the groups of `axes` (a `Levels`), or None where a collective over them stays flat: in one
    process, or where a group has one member in some process, or processes hold different numbers of its members."""
    axes = tuple(axes)
    if axes not in self._levels:
      self._levels[axes] = self._split_levels(axes) if self._crosses_processes(axes) else None
    return self._levels[axes]

  def _split_levels(self, axes):
    of, members = self.groups(axes)
    ranked = functools.partial(sorted, key=lambda p: rank_key(self.devices[p]))
    local_of, cross_of = np.zeros(self.mesh.size, np.int32), np.zeros(self.mesh.size, np.int32)
    local, cross, orders, shapes = [], [], [], set()
    for m in members:
      by_process = {}
      for p in m:
        by_process.setdefault(self.processes[p], []).append(p)
      rows = [ranked(v) for v in by_process.values()]
      shapes.update((len(r), len(rows)) for r in rows)
      if len(shapes) > 1 or len(rows[0]) < 2:
        return None
      for row in rows:
        local_of[row] = len(local)
        local.append(row)
      order = []
      for j in range(len(rows[0])):   # the members of local rank j, one per process, in runtime rank order
        peers = ranked(row[j] for row in rows)
        cross_of[peers] = len(cross)
        cross.append(peers)
        order.extend(m.index(p) for p in peers)
      orders.append(order)
    (per_process, processes), = shapes
    return Levels(per_process, processes, (local_of, local), (cross_of, cross), np.array(orders, np.int32)[of])

  def _groups_at(self, axes, level):
    """(group index per position, members per group) of `axes`, or of one of its levels ("within", "across")."""
    if level is None:
      return self.groups(axes)
    levels = self.levels(axes)
    return levels.within if level == "within" else levels.across

  def ranked_groups(self, axes, level=None):
    """The `Groups` of `axes` (or of one of its levels), members in runtime rank order: the record of who takes
    part in an op over them (one object per groups)."""
    key = (tuple(axes), level)
    if key not in self._ranked:
      of, members = self._groups_at(axes, level)
      self._ranked[key] = Groups(tuple(int(g) for g in of), tuple(
          tuple(sorted(m, key=lambda p: rank_key(self.devices[p]))) for m in members))
    return self._ranked[key]

  def transfer_groups(self, axes, peer):
    """The `Groups` of a collective-permute's sends and of its receives within the groups of `axes`, where member k
    of every group sends to member peer[k]: per position, (sender, receiver). One pair of objects per transfer
    pattern, however many permutes use it (a halo exchange in every layer)."""
    key = (tuple(axes), tuple(sorted(peer.items())))
    if key not in self._transfers:
      _, members = self.groups(axes)
      sender_of = {b: a for a, b in peer.items()}
      n = self.mesh.size
      sends, gets = [None] * n, [None] * n
      for m in members:
        for k, p in enumerate(m):
          sends[p], gets[p] = (p, m[peer[k]]), (m[sender_of[k]], p)
      every = tuple(range(n))
      self._transfers[key] = (Groups(every, tuple(sends)), Groups(every, tuple(gets)))
    return self._transfers[key]
