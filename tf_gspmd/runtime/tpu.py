"""TPUs: meshes over a slice's cores, the DeviceAssignment XLA's SPMD partitioner runs under, the TPUStrategy that
runs a sharding-annotated program, and the run itself.

On TPU, TensorFlow's bridge runs XLA's own SPMD partitioner on a program whose tensors carry XLA sharding
annotations (`tf.distribute.TPUStrategy(..., experimental_spmd_xla_partitioning=True)`); what tf_gspmd adds is
everything around the partitioner: which cores form the mesh and in what order, the device assignment that makes
XLA's partition p the mesh's device p, the strategy, and the annotated program with its inputs.

Conventions (TF 2.21, read from its sources):

- A `tf.tpu.experimental.Topology` has four dims, `(x, y, z, core)`: chips on a 3-D grid (a torus on slices
  with wrap-around links), cores within a chip. `device_coordinates[task, ordinal]` is the coordinate of TF's
  device `/job:J/task:task/device:TPU:ordinal`.
- A `DeviceAssignment`'s `core_assignment[replica, logical_core]` is a core's coordinate. The bridge builds
  XLA's device assignment from it (`tpu_rewrite_device_util.cc`): device (replica, logical core), with XLA
  device id `(x + X * (y + Y * z)) * C + core`. Under SPMD partitioning the computation (partition) index is
  the logical core, and the device ids of an OpSharding's tile assignment are logical cores
  (`xla_sharding_util.cc`: tile i of an input goes to logical core `tile_assignment_devices[i]`).
  tf_gspmd's OpShardings number the mesh's devices row-major, so with one replica whose logical core p is mesh
  device p, XLA's partition p is mesh device p.
- Under `experimental_spmd_xla_partitioning=True` every input of the computation is either split or
  replicated by an annotation on it (`experimental_split_to_logical_devices` /
  `experimental_replicate_to_logical_devices` write the same XlaSharding op); with one replica,
  `strategy.run` takes each argument whole, and the bridge splits it on the host along its annotation (and
  concatenates a split result), so arguments and results cross `strategy.run` as global values.
- Variables created under such a strategy's scope are stored whole on every core of the replica
  (`TPUReplicatedVariable`); XLA splits their use inside the program as its annotations say.

Imports only the core floor and public TensorFlow (`tf.tpu.experimental`, `tf.distribute`).
"""

import dataclasses
import math
import threading
from typing import Any, Callable, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd._layout.annotations import mesh_scope, sharding_ops
from tf_gspmd._layout.mesh import Mesh, P
from tf_gspmd._layout.sharding import Sharding, per_value, to_sharding
from tf_gspmd.errors import InputError, MeshError

TOPOLOGY_DIMS = ("x", "y", "z", "core")
# The topology's dims from the closest cores to the farthest: the cores of one chip, then chips along x, y, z.
NEAR_TO_FAR = (3, 0, 1, 2)
CHIPS_PER_HOST = (2, 2, 1)   # a TPU host (v2, v3, v4) drives a 2x2 block of chips


# ---- topologies -----------------------------------------------------------------------------------------------

def simulated_topology(shape, chips_per_host=CHIPS_PER_HOST):
  """A `tf.tpu.experimental.Topology` of `shape` = (x, y, z, cores per chip), built without a TPU.

  Each host (TF task) drives a `chips_per_host` block of chips (clipped to the slice), tasks numbered over the
  blocks x fastest, and a host's TPU ordinals run over its chips x fastest, then y, z, with the cores of a chip
  consecutive. Real slices report their own device coordinates (`initialize`); this one plans a mesh for a
  slice that is not here, and tests the mapping. Examples: v4-8 `(2, 2, 1, 1)`, v3-8 `(2, 2, 1, 2)`,
  v3-32 `(4, 4, 1, 2)` (4 hosts).
  """
  shape = whole_numbers(shape, "shape", "a TPU topology shape is (x, y, z, cores per chip), four positive ints, "
                        "e.g. (2, 2, 1, 2) for a v3-8", length=4)
  chips = whole_numbers(chips_per_host, "chips_per_host", "give the (x, y, z) block of chips one host drives, three "
                        "positive ints, e.g. (2, 2, 1)", length=3)
  block = tuple(min(b, s) for b, s in zip(chips, shape[:3]))
  if any(s % b for s, b in zip(shape[:3], block)):
    raise MeshError(f"chips_per_host {block} does not tile the chips {shape[:3]}")
  hosts = [s // b for s, b in zip(shape[:3], block)]
  per_host = math.prod(block) * shape[3]
  coords = np.zeros((math.prod(hosts), per_host, 4), np.int32)
  for task, (hz, hy, hx) in enumerate(np.ndindex(*hosts[::-1])):
    for ordinal, (lz, ly, lx, core) in enumerate(np.ndindex(block[2], block[1], block[0], shape[3])):
      coords[task, ordinal] = (hx * block[0] + lx, hy * block[1] + ly, hz * block[2] + lz, core)
  return tf.tpu.experimental.Topology(mesh_shape=list(shape), device_coordinates=coords)


def whole_numbers(values, what, fix, length=None):
  """`values` as a tuple of ints of 1 or more (`length` of them, when given); MeshError naming `what` otherwise."""
  try:
    ok = not isinstance(values, (str, bytes)) and all(
        not isinstance(v, bool) and int(v) == v and v >= 1 for v in values)
    out = tuple(int(v) for v in values) if ok else None
  except (TypeError, ValueError):
    out = None
  if out is None or (length is not None and len(out) != length):
    raise MeshError(f"{what}={values!r}: {fix}", node=what)
  return out


def as_topology(topology):
  """`topology` as a Topology: a Topology, its serialized TopologyProto (bytes), or a shape for
  `simulated_topology`."""
  if isinstance(topology, tf.tpu.experimental.Topology):
    return topology
  if isinstance(topology, (bytes, bytearray)):
    return tf.tpu.experimental.Topology(serialized=bytes(topology))
  if isinstance(topology, (tuple, list)):
    return simulated_topology(topology)
  raise MeshError(f"expected a tf.tpu.experimental.Topology, a serialized TopologyProto or a topology shape "
                  f"(x, y, z, cores); got {topology!r}")


_INITIALIZED = {}
_INIT_LOCK = threading.Lock()
_LOCAL = []   # this TPU VM's resolver, made once


def local_resolver():
  """The resolver of this TPU VM's own cores (`TPUClusterResolver(tpu="local")`), one per process."""
  with _INIT_LOCK:
    if not _LOCAL:
      _LOCAL.append(tf.distribute.cluster_resolver.TPUClusterResolver(tpu="local"))
    return _LOCAL[0]


def initialize(resolver=None):
  """Connects to the TPU of `resolver` (default: this TPU VM's, `local_resolver()`) and initialises its TPU
  system, once per process; returns its Topology. Raises MeshError when there is no TPU to initialise (a
  machine without one, or a TensorFlow built without TPU support) or it cannot be reached."""
  if resolver is None:
    resolver = local_resolver()
  elif not callable(getattr(resolver, "master", None)):
    raise MeshError(f"resolver={resolver!r} is not a cluster resolver: give a "
                    "tf.distribute.cluster_resolver.TPUClusterResolver, or None for this TPU VM's own cores",
                    node="resolver")
  key = resolver.master()
  with _INIT_LOCK:
    if key not in _INITIALIZED:
      try:
        if key:   # a remote TPU (a grpc:// master); a TPU VM's own cores need no connection
          tf.config.experimental_connect_to_cluster(resolver)
        _INITIALIZED[key] = tf.tpu.experimental.initialize_tpu_system(resolver)
      except (tf.errors.OpError, RuntimeError, ValueError) as e:
        raise no_tpu_error(key, e) from e
    return _INITIALIZED[key]


SIMULATE = ("plan for a TPU slice that is not here with topology=gs.tpu.simulated_topology((x, y, z, cores)) "
            "(e.g. gs.tpu_mesh((2, 4), (\"data\", \"model\"), topology=gs.tpu.simulated_topology((2, 2, 1, 2))), a "
            "v3-8), or run XLA's SPMD partitioner on host CPUs: gs.function(..., partitioner=\"xla\") on a CPU mesh "
            "(tools/xla_oracle.py partitions its export over 8 host CPUs; docs/hardware.md)")


def no_tpu_error(master, error):
  """MeshError for `error`, raised while connecting to or initialising the TPU system at `master` ("" for this
  machine's own): TensorFlow's own text (an unregistered ConfigureDistributedTPU kernel, "TPUs not found") does not
  say that there is simply no TPU, nor what to do without one."""
  first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
  missing = isinstance(error, tf.errors.NotFoundError) or "ConfigureDistributedTPU" in str(error)
  where = f"at {master!r}" if master else "on this machine"
  what = f"no TPU is attached: TensorFlow found none {where}" if missing else \
      f"could not initialise the TPU system {where}"
  return MeshError(f"{what} (TensorFlow: {first}). On a TPU VM, install TensorFlow's TPU build and run there (or "
                   f"pass resolver=TPUClusterResolver(tpu=...) for a remote TPU); without a TPU, {SIMULATE}",
                   node="TPU")


def job_of(resolver):
  """The TF job whose tasks hold `resolver`'s TPU cores (TPUStrategy reads it from the system metadata)."""
  for d in resolver.get_tpu_system_metadata().devices:
    if "device:TPU:" in d.name:
      return tf.DeviceSpec.from_string(d.name).job
  raise MeshError(f"the cluster of {resolver!r} lists no TPU device")


# ---- the order of the cores in a mesh ----------------------------------------------------------------------------

def snake(sizes):
  """Every index of a grid of `sizes` (minor first) in boustrophedon order: consecutive indices differ by one
  in exactly one dim."""
  out = [()]
  for n in sizes:
    out = [t + (j,) for j in range(n) for t in (out if j % 2 == 0 else out[::-1])]
  return out


def ring(a, b):
  """Every index (i, j) of an a x b grid (i minor) in a closed ring, each step one unit in one dim, the last
  next to the first; needs a >= 2 and b even (TF's DeviceAssignment rings, `_open_ring_2d`): column 0 is the
  way back."""
  out = [(0, 0)]
  for j in range(b):
    out += [(i, j) for i in (range(1, a) if j % 2 == 0 else range(a - 1, 0, -1))]
  return out + [(0, j) for j in range(b - 1, 0, -1)]


def _axis_path(sizes):
  """The order in which one mesh axis runs over the grid of its factors (`sizes`, minor first)."""
  if len(sizes) == 2 and min(sizes) >= 2 and (sizes[0] % 2 == 0 or sizes[1] % 2 == 0):
    if sizes[1] % 2 == 0:
      return ring(*sizes)
    return [(i, j) for j, i in ring(sizes[1], sizes[0])]
  return snake(sizes)


def _factor(mesh_shape, topo_shape):
  """For each mesh axis, its factors (topology dim, size, stride), minor first; None when the shape does not
  factor over the topology's dims (see `core_order`)."""
  left = [[d, int(topo_shape[d]), 1] for d in NEAR_TO_FAR if topo_shape[d] > 1]
  factors = [None] * len(mesh_shape)
  for axis in reversed(range(len(mesh_shape))):
    need, mine = int(mesh_shape[axis]), []
    while need > 1:
      if not left:
        return None
      dim, size, stride = left[0]
      if need % size == 0:            # the whole of what is left of this dim
        mine.append((dim, size, stride))
        left.pop(0)
        need //= size
      elif size % need == 0:          # its near part; the far part (stride `need`) stays for the next axes
        mine.append((dim, need, stride))
        left[0] = [dim, size // need, stride * need]
        need = 1
      else:
        return None
    factors[axis] = mine
  return factors


def core_order(topology, mesh_shape):
  """The topology coordinate (x, y, z, core) of every mesh position: an int array of shape mesh_shape + (4,).

  The rule: mesh axes, the last (minor) one first, take the closest topology dims left -- the cores of a chip,
  then chips along x, y, z. An axis takes a whole dim while the dim's size divides what the axis still needs,
  and the near part of a larger dim (consecutive coordinates; the far part, stepping by the near part's size,
  is left to the next axes). Along one axis the positions run through its dims so that consecutive positions
  are neighbours (one core apart on a chip, or one chip apart): one dim in coordinate order (a ring over the
  torus's wrap-around links where the slice has them), two dims a closed ring when one of them is even (as
  TF's DeviceAssignment.build), more a snake (boustrophedon). So along every mesh axis neighbouring positions
  are neighbouring cores, wherever the other axes are, and the minor axis (usually the one with most traffic)
  stays on a chip or a row of chips. A shape that does not factor so (an axis of 3 on a slice of 2s) takes the
  first mesh-size cores of one snake over (core, x, y, z), mesh positions row-major along it.
  """
  topology = as_topology(topology)
  topo_shape = [int(s) for s in topology.mesh_shape]
  mesh_shape = whole_numbers(mesh_shape, "mesh_shape", "give the size of each mesh axis, positive ints, e.g. (2, 4)")
  size = math.prod(mesh_shape)
  present = np.zeros(topo_shape, bool)
  for c in topology.device_coordinates.reshape(-1, 4):
    present[tuple(c)] = True
  if size > int(present.sum()):
    raise MeshError(f"mesh {mesh_shape} needs {size} TPU cores but the topology {tuple(topo_shape)} has "
                    f"{int(present.sum())}")
  out = np.zeros(mesh_shape + (4,), np.int32)
  factors = _factor(mesh_shape, topo_shape)
  if factors is None:
    near = [topo_shape[d] for d in NEAR_TO_FAR]
    path = [p for p in snake(near) if present[tuple(p[NEAR_TO_FAR.index(d)] for d in range(4))]]
    for pos, p in enumerate(path[:size]):
      out[np.unravel_index(pos, mesh_shape)] = [p[NEAR_TO_FAR.index(d)] for d in range(4)]
    return out
  paths = [_axis_path([n for _, n, _ in f]) if f else [()] for f in factors]
  for index in np.ndindex(*mesh_shape):
    for axis, i in enumerate(index):
      for (dim, _, stride), k in zip(factors[axis], paths[axis][i]):
        out[index + (dim,)] += k * stride
  for index in np.ndindex(*mesh_shape):
    if not present[tuple(out[index])]:
      raise MeshError(f"mesh position {index} maps to TPU core {tuple(out[index])}, which the topology lacks")
  return out


def device_name(topology, coords, job):
  """The full TF name of the TPU core at `coords` in the tasks of `job`."""
  topology = as_topology(topology)
  task = int(topology.task_ordinal_at_coordinates(tuple(coords)))
  ordinal = int(topology.tpu_device_ordinal_at_coordinates(tuple(coords)))
  return f"/job:{job}/replica:0/task:{task}/device:TPU:{ordinal}"


def default_job(topology):
  """The job name of a topology's cores when no resolver says: "localhost" on one host, else "worker"."""
  return "localhost" if as_topology(topology).num_tasks == 1 else "worker"


def mesh(shape, axis_names, topology, job=None):
  """A `Mesh` of `shape` over the topology's TPU cores in `core_order` (TF device names, job `job`)."""
  topology = as_topology(topology)
  order = core_order(topology, shape).reshape(-1, 4)
  job = job or default_job(topology)
  return Mesh(shape, axis_names, devices=[device_name(topology, c, job) for c in order])


def is_tpu_mesh(m):
  """Whether `m`'s devices are given and are TPU cores."""
  if not isinstance(m, Mesh):
    raise MeshError(f"{m!r} is not a gs.Mesh", node="mesh")
  return m.devices is not None and all(tf.DeviceSpec.from_string(d).device_type == "TPU" for d in m.devices)


# ---- device assignment: logical core p = XLA partition p = mesh device p ---------------------------------------

def coordinates(m, topology):
  """The topology coordinate of each of mesh `m`'s devices, row-major: an int32 array [m.size, 4]."""
  topology = as_topology(topology)
  if not is_tpu_mesh(m):
    raise MeshError(f"{m} is not a mesh of TPU cores (devices {m.devices[:2] if m.devices else None}...); build "
                    "it with gs.tpu_mesh(...) or give TPU device names")
  out = np.zeros((m.size, 4), np.int32)
  for p, d in enumerate(m.devices):
    spec = tf.DeviceSpec.from_string(d)
    task, ordinal = spec.task or 0, spec.device_index
    if task >= topology.num_tasks or ordinal >= topology.num_tpus_per_task:
      raise MeshError(f"mesh device {d} is not in the topology ({topology.num_tasks} task(s) x "
                      f"{topology.num_tpus_per_task} TPU cores)")
    out[p] = topology.device_coordinates[task, ordinal]
  return out


def device_assignment(m, topology):
  """The `tf.tpu.experimental.DeviceAssignment` of one replica whose logical core p is mesh device p:
  core_assignment [1, m.size, 4] lists the devices' coordinates in the mesh's row-major order."""
  topology = as_topology(topology)
  return tf.tpu.experimental.DeviceAssignment(topology, coordinates(m, topology)[None])


def xla_device_id(topology, coords):
  """XLA's id of the TPU core at `coords`, as TF's bridge numbers them: (x + X * (y + Y * z)) * C + core."""
  shape = tuple(int(s) for s in as_topology(topology).mesh_shape)
  x_size, y_size, _, cores = shape
  try:
    x, y, z, core = (int(c) for c in coords)
  except (TypeError, ValueError):
    raise MeshError(f"coords={coords!r}: give a TPU core's topology coordinate (x, y, z, core), four ints",
                    node="coords") from None
  if not all(0 <= c < n for c, n in zip((x, y, z, core), shape)):
    raise MeshError(f"coords={tuple(coords)} is not a core of the topology {shape}: each of (x, y, z, core) must be "
                    "at least 0 and below the topology's size along it", node="coords")
  return (x + x_size * (y + y_size * z)) * cores + core


@dataclasses.dataclass(frozen=True)
class Partition:
  """One XLA partition of a program run on a TPU mesh."""

  partition_id: int          # XLA's partition id = the logical core = the mesh position
  mesh_coords: Tuple[int, ...]
  device: str                # TF device name
  coords: Tuple[int, ...]    # topology coordinate (x, y, z, core)
  xla_device_id: int
  task: int                  # the TF task (host) that drives it


def partitions(m, topology):
  """Every partition of mesh `m` on `topology`, by partition id."""
  topology = as_topology(topology)
  da = device_assignment(m, topology)
  out = []
  for p in range(m.size):
    coords = tuple(int(c) for c in da.coordinates(0, p))
    out.append(Partition(p, tuple(int(c) for c in m.coords(p)), m.devices[p], coords, xla_device_id(topology, coords),
                         int(topology.task_ordinal_at_coordinates(coords))))
  return tuple(out)


# ---- the strategy ------------------------------------------------------------------------------------------------

def strategy_arguments(m, resolver, topology):
  """The keyword arguments of `tf.distribute.TPUStrategy` that run mesh `m`'s programs: XLA's SPMD
  partitioner over one replica of m.size logical cores, logical core p on mesh device p."""
  return dict(tpu_cluster_resolver=resolver, experimental_device_assignment=device_assignment(m, topology),
              experimental_spmd_xla_partitioning=True)


def strategy(m, resolver=None, topology=None, factory=None):
  """`tf.distribute.TPUStrategy` over mesh `m` (`strategy_arguments`); `topology` defaults to the one
  `initialize(resolver)` returns. `factory`: the class to build (default TPUStrategy)."""
  if not isinstance(m, Mesh) or not is_tpu_mesh(m):
    raise MeshError(f"{m} is not a mesh of TPU cores (devices {getattr(m, 'devices', None)}); build it with "
                    f"gs.tpu_mesh(...) on a TPU VM; without a TPU, {SIMULATE}", node="mesh")
  if resolver is None:
    resolver = local_resolver()
  if topology is None:
    topology = initialize(resolver)
  return (factory or tf.distribute.TPUStrategy)(**strategy_arguments(m, resolver, topology))


# ---- the annotated program and its run ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AnnotatedProgram:
  """A program for XLA's SPMD partitioner: `fn`, a tf.function(jit_compile=True) whose tensors carry XLA
  sharding annotations -- every argument and result at least -- over `mesh` (device ids = mesh positions).

  `in_shardings`: one Sharding (or None: not annotated) per argument; `out_shardings`: None (results not
  annotated), one Sharding for every flattened non-None result, or a tuple with one each. `body`: the Python
  function to trace inside another computation (a TPU replica), or None when only `fn` exists (then `fn` is
  called there).
  """

  fn: Callable
  mesh: Mesh
  in_shardings: Tuple[Optional[Sharding], ...]
  out_shardings: Any = None
  body: Optional[Callable] = None


def annotate(t, sharding, name=None):
  """`t` through TF's XlaSharding op carrying `sharding` (what TPUStrategy's `experimental_split_to_logical_
  devices` / `experimental_replicate_to_logical_devices` write; the bridge reads an argument's split from it)."""
  t = tf.convert_to_tensor(t)
  if sharding.dims:
    sharding = sharding.with_rank(t.shape.rank, what=name)
  return _compat.xla_sharding_op(t, sharding.to_proto().SerializeToString(), (), name)


def annotated_program(fn, m, in_shardings, out_shardings=None):
  """The AnnotatedProgram of `fn` over mesh `m`: its arguments annotated with `in_shardings` (one P, Sharding
  or None per argument), its flattened non-None results with `out_shardings` (one spec for all, one per result,
  or None), `gs.shard` inside it resolved over `m`. XLA completes every other tensor's sharding itself."""
  if in_shardings is None or not isinstance(in_shardings, (tuple, list)) or isinstance(in_shardings, P):
    raise InputError(f"in_shardings: give one spec (or None) per argument, as a tuple; got {in_shardings!r}")
  ins = tuple(to_sharding(s, m, what=f"argument {k}") for k, s in enumerate(in_shardings))
  single = out_shardings is None or not isinstance(out_shardings, (tuple, list)) or isinstance(out_shardings, P)
  outs = to_sharding(out_shardings, m, what="the results") if single else tuple(
      to_sharding(s, m, what=f"result {k}") for k, s in enumerate(out_shardings))

  def body(*args):
    if len(args) != len(ins):
      raise InputError(f"the program takes {len(ins)} arguments; got {len(args)}")
    args = [a if s is None else annotate(a, s, name=f"arg{k}_sharding") for k, (a, s) in enumerate(zip(args, ins))]
    with mesh_scope(m), sharding_ops():   # gs.shard inside: over `m`, as XlaSharding ops XLA keeps
      result = fn(*args)
    flat = tf.nest.flatten(result)
    present = [k for k, t in enumerate(flat) if t is not None]
    specs = per_value(outs, len(present), "out_shardings", "the function returns {n} results")
    for k, s in zip(present, specs):
      if s is not None:
        flat[k] = annotate(flat[k], s, name=f"result{k}_sharding")
    return tf.nest.pack_sequence_as(result, flat)

  return AnnotatedProgram(fn=tf.function(body, jit_compile=True, autograph=False), mesh=m, in_shardings=ins,
                          out_shardings=outs, body=body)


def from_exported(exported, m=None):
  """The AnnotatedProgram of a gs.function's export (`partitioner="xla"`, `rewriter.backend.xla_export.Exported`): its
  jit-compiled function of the flat arguments (flat results), traced into the TPU computation through its Python
  body; in_shardings read from the annotations on its argument Placeholders."""
  by_tensor = {r: s for r, s in exported.annotations.values()}
  ins = tuple(by_tensor.get(f"{name}:0") for name in exported.inputs)
  if m is None:
    m = next((s.mesh for _, s in exported.annotations.values()), None)
  if m is None:
    raise InputError("the exported program carries no annotation to read its mesh from; pass the mesh")
  outs = tuple(exported.annotations[o.rpartition(":")[0]][1] if o.rpartition(":")[0] in exported.annotations
               else by_tensor.get(o) for o in exported.outputs)   # a result is its XlaSharding node's output
  fn = exported.function()
  return AnnotatedProgram(fn=fn, mesh=m, in_shardings=ins, out_shardings=outs,
                          body=getattr(fn, "python_function", None))


def program_of(exported, m=None):
  """An AnnotatedProgram from what an exporter gives: an AnnotatedProgram, an `xla_export.Exported`, or any
  object with `fn` (the jit-compiled annotated tf.function), `mesh` and `in_shardings` (optionally
  `out_shardings`, `body`)."""
  if isinstance(exported, AnnotatedProgram):
    return exported
  if hasattr(exported, "annotations") and callable(getattr(exported, "function", None)):
    return from_exported(exported, m)
  fn = getattr(exported, "fn", None)
  mesh_ = getattr(exported, "mesh", None) or m
  if fn is None or mesh_ is None or not hasattr(exported, "in_shardings"):
    raise InputError(f"expected an annotated program (fn, mesh, in_shardings); got {exported!r}")
  return AnnotatedProgram(fn=fn, mesh=mesh_, in_shardings=tuple(exported.in_shardings),
                          out_shardings=getattr(exported, "out_shardings", None), body=getattr(exported, "body", None))


class Runner:
  """Runs AnnotatedPrograms with `strategy.run`, one traced step per program (kept; a call with the same
  program reuses it).

  Arguments are given whole (numpy, tf.Tensor): with one replica `strategy.run` passes each to the replica as
  it is and the bridge splits it along its annotation; results come back whole. `jit_compile`: how the step
  around `strategy.run` is compiled -- None on TPU (the TPU computation is compiled by XLA already; the program
  is traced into it through its `body`), True for a one-device strategy standing in for it on CPU.
  """

  def __init__(self, strategy_, jit_compile=None):
    self.strategy = strategy_
    self.jit_compile = jit_compile
    self._steps = {}
    self._lock = threading.Lock()

  def step(self, program):
    """The tf.function that runs `program` once through the strategy."""
    key = id(program.fn)
    with self._lock:
      hit = self._steps.get(key)
      if hit is not None and hit[0] is program.fn:
        return hit[1]
    replica_fn = program.body or program.fn
    strat = self.strategy

    def run_step(*args):
      return strat.run(replica_fn, args=args)

    step = tf.function(run_step, jit_compile=self.jit_compile, autograph=False)
    with self._lock:
      self._steps[key] = (program.fn, step)
    return step

  def __call__(self, program, *args):
    program = program_of(program)
    if len(args) != len(program.in_shardings):
      raise InputError(f"the program takes {len(program.in_shardings)} arguments; got {len(args)}")
    inputs = [tf.constant(a.numpy()) if hasattr(a, "sharding") and hasattr(a, "numpy") else tf.convert_to_tensor(a)
              for a in args]
    with self.strategy.scope():
      out = self.step(program)(*inputs)
    return tf.nest.map_structure(self._local, out)

  def _local(self, value):
    """A result of one replica as a tensor (TPUStrategy returns a one-replica value as a plain tensor)."""
    if value is None or isinstance(value, tf.Tensor):
      return value
    local = self.strategy.experimental_local_results(value)
    return local[0] if len(local) == 1 else local


_RUNNERS = {}   # mesh -> the Runner of its strategy
_RUNNERS_LOCK = threading.Lock()


def use_strategy(m, strategy_, jit_compile=None):
  """Makes `strategy_` the one that runs mesh `m`'s programs (`run_exported`, gs.function calls on `m`); returns
  its Runner. `jit_compile`: see `Runner` (True only for a one-device strategy standing in on CPU)."""
  _check_strategy(m, None)   # (the strategy may be a stand-in: `strategy(factory=...)` builds what it is given)
  runner = Runner(strategy_, jit_compile=jit_compile)
  with _RUNNERS_LOCK:
    _RUNNERS[m] = runner
  return runner


def _check_strategy(m, strategy_):
  """MeshError unless `m` is a gs.Mesh; InputError unless `strategy_` is a tf.distribute strategy."""
  if not isinstance(m, Mesh):
    raise MeshError(f"{m!r} is not a gs.Mesh: give the mesh whose programs the strategy runs (gs.tpu_mesh(...))",
                    node="mesh")
  if strategy_ is not None and not isinstance(strategy_, tf.distribute.Strategy):
    raise InputError(f"strategy={strategy_!r} is not a tf.distribute.Strategy: give gs.tpu.strategy(mesh) (a "
                     "TPUStrategy), or a one-device strategy standing in for it", node="strategy")


def runner_for(m):
  """The Runner of mesh `m`: the strategy given to `use_strategy` (or built by `strategy`), else a TPUStrategy
  built now for `m` on this TPU VM's cores (`initialize()`)."""
  with _RUNNERS_LOCK:
    runner = _RUNNERS.get(m)
  if runner is None:
    runner = use_strategy(m, strategy(m))
  return runner


_BY_STRATEGY = {}   # id(strategy) -> its Runner, for strategies passed to `run` directly


def run(program, *args, strategy_=None):
  """Runs `program` (an AnnotatedProgram, an `xla_export.Exported`, or an exporter's equivalent) on `args` (global
  values) through `strategy_`, default the strategy of the program's mesh (`runner_for`); returns its results
  as global values."""
  program = program_of(program)
  _check_strategy(program.mesh, strategy_)
  if strategy_ is None:
    return runner_for(program.mesh)(program, *args)
  with _RUNNERS_LOCK:
    runner = _BY_STRATEGY.get(id(strategy_))
    if runner is None or runner.strategy is not strategy_:
      runner = _BY_STRATEGY[id(strategy_)] = Runner(strategy_)
  return runner(program, *args)


def run_exported(exported, m, args):
  """A gs.function's exported program (`partitioner="xla"`) run on mesh `m`'s TPU cores: the flat results (what
  gs.function's call restructures), as global values."""
  return list(run(from_exported(exported, m), *args))
