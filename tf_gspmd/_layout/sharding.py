"""`Sharding`: how one tensor is laid out over a mesh, convertible to and from XLA's OpSharding.

A sharding is stored by mesh axis names: for each tensor dimension, the (ordered, major first) mesh axes
that split it. Mesh axes used by no dimension replicate the tensor (partial replication). A *maximal*
sharding puts the whole tensor on one device. This is the GSPMD paper's sharding vocabulary: replicated,
tiled, partially tiled, maximal.
"""

import dataclasses
import itertools
import math
from typing import Optional, Tuple

import numpy as np

from tf_gspmd._platform import compat as _compat
from tf_gspmd._layout.mesh import Mesh, P
from tf_gspmd.errors import InputError, SpecError


def _xla_data_pb2():
  return _compat.xla_data_pb2()


# (axis names, mesh shape, dims, maximal) of the shardings already validated (validation depends on nothing else)
_VALID = set()


@dataclasses.dataclass(frozen=True)
class Sharding:
  """The layout of one tensor over a `Mesh`.

  Attributes:
    mesh: the mesh.
    dims: for each tensor dimension, the tuple of mesh axis names splitting it (major first). An empty
      tuple ``()`` for ``dims`` means fully replicated, any rank.
    maximal: device position (0..mesh.size-1) holding the whole tensor, or None.

  Example:
    >>> mesh = Mesh((2, 4), ("data", "model"))
    >>> s = Sharding.from_spec(mesh, P("data", None))
    >>> s.num_tiles, s.spec
    (2, P('data', None))
  """

  mesh: Mesh
  dims: Tuple[Tuple[str, ...], ...] = ()
  maximal: Optional[int] = None

  def __post_init__(self):
    if not isinstance(self.mesh, Mesh):
      raise SpecError(f"a Sharding is over a gs.Mesh; got mesh={self.mesh!r}", node="mesh")
    dims = self.dims
    if type(dims) is not tuple or any(type(d) is not tuple for d in dims):  # pylint: disable=unidiomatic-typecheck
      dims = _dims(dims)
      object.__setattr__(self, "dims", dims)
    if self.maximal is not None and type(self.maximal) is not int:  # pylint: disable=unidiomatic-typecheck
      if isinstance(self.maximal, bool) or not isinstance(self.maximal, (int, np.integer)):
        raise SpecError(f"maximal={self.maximal!r}: give the mesh position (0..{self.mesh.size - 1}) of the device "
                        "that holds the whole tensor, or None", node="maximal")
      object.__setattr__(self, "maximal", int(self.maximal))
    key = (self.mesh.axis_names, self.mesh.shape, dims, self.maximal)
    try:
      if key in _VALID:   # completion builds tens of thousands of the same few shardings
        return
    except TypeError:   # an unhashable axis: validation says what is wrong
      self._validate(dims)
    self._validate(dims)
    _VALID.add(key)

  def _validate(self, dims):
    seen = {}
    for i, axes in enumerate(dims):
      for a in axes:
        if not isinstance(a, str):
          raise SpecError(f"mesh axes must be names; got {a!r} for dimension {i}")
        self.mesh.axis_index(a)  # raises on unknown axis
        if a in seen:
          raise SpecError(f"mesh axis {a!r} is used for dimensions {seen[a]} and {i}; each mesh axis may split "
                          "at most one dimension (leave one of them None)")
        seen[a] = i
    if self.maximal is not None:
      if dims:
        raise SpecError("a maximal sharding has no tiled dimensions")
      if not 0 <= self.maximal < self.mesh.size:
        raise SpecError(f"maximal device {self.maximal} is outside the mesh of {self.mesh.size} devices")

  # ---- constructors -------------------------------------------------------------------------------------
  @classmethod
  def replicated(cls, mesh, rank=None):
    return cls(mesh, ((),) * rank if rank else ())

  @classmethod
  def from_spec(cls, mesh, spec, rank=None, what=None):
    """Sharding of a tensor of rank `rank` (default len(spec)) split as `spec` over `mesh`."""
    spec = as_spec(spec, what)
    if spec.open_dims:
      raise SpecError(f"{spec} leaves dimension {spec.open_dims[0]} of {what or 'the tensor'} open "
                      "(P.UNCONSTRAINED), but a layout is needed here; leave dimensions to completion only in "
                      "annotations (gs.shard) and in gs.function's in_shardings/out_shardings", node=what)
    if rank is not None and len(spec) > rank:
      raise SpecError(f"{spec} has {len(spec)} entries but {what or 'the tensor'} has rank {rank}; "
                      f"give at most {rank} entries", node=what)
    n = len(spec) if rank is None else rank
    try:
      return cls(mesh, tuple(spec.axes(i) for i in range(n)))
    except SpecError as e:
      raise SpecError(f"{spec} does not fit {mesh}: {e}", node=what) from None

  @classmethod
  def from_dims_mapping(cls, mesh, dims_mapping, what=None):
    """The sharding of `mesh_split(t, mesh.device_ids, dims_mapping)`."""
    spec = []
    if isinstance(dims_mapping, (str, bytes)) or not hasattr(dims_mapping, "__iter__"):
      raise SpecError(f"dims_mapping={dims_mapping!r}: give one mesh dimension (or -1) per tensor dimension, e.g. "
                      "[0, -1]", node=what)
    for i, d in enumerate(dims_mapping):
      if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
        raise SpecError(f"dims_mapping[{i}] = {d!r} is not a mesh dimension: give an int, 0..{mesh.ndim - 1}, or -1 "
                        "(not split)", node=what)
      d = int(d)
      if d < -1 or d >= mesh.ndim:
        raise SpecError(f"dims_mapping[{i}] = {d} is not a mesh dimension of {mesh} (use -1 or 0..{mesh.ndim - 1})",
                        node=what)
      spec.append(None if d < 0 else mesh.axis_names[d])
    return cls.from_spec(mesh, P(*spec), what=what)

  # ---- properties ---------------------------------------------------------------------------------------
  @property
  def rank(self):
    return len(self.dims)

  @property
  def is_maximal(self):
    return self.maximal is not None

  @property
  def is_replicated(self):
    return self.maximal is None and all(not a for a in self.dims)

  @property
  def used_axes(self):
    return tuple(a for axes in self.dims for a in axes)

  @property
  def replicated_axes(self):
    used = set(self.used_axes)
    return tuple(a for a in self.mesh.axis_names if a not in used)

  def tiles(self, i):
    """Number of shards of dimension i."""
    if i >= len(self.dims):
      return 1
    return math.prod(self.mesh.axis_size(a) for a in self.dims[i])

  @property
  def num_tiles(self):
    return math.prod(self.tiles(i) for i in range(self.rank))

  @property
  def spec(self):
    """The `P` of this sharding, or None for a maximal sharding."""
    if self.maximal is not None:
      return None
    return P(*[a if a else None for a in self.dims])

  def with_rank(self, rank, what=None):
    """This sharding for a tensor of the given rank (a rank-free replicated sharding adapts)."""
    if self.maximal is not None or len(self.dims) == rank:
      return self
    if len(self.dims) < rank and all(not a for a in self.dims):
      return Sharding(self.mesh, ((),) * rank)
    if len(self.dims) < rank:
      return Sharding(self.mesh, self.dims + ((),) * (rank - len(self.dims)))
    raise SpecError(f"sharding {self} has {len(self.dims)} dimensions but {what or 'the tensor'} has rank {rank}",
                    node=what)

  def tiled(self, rank, what=None):
    """This sharding as a tiling of a rank-`rank` tensor; a maximal sharding counts as replicated (its device
    holds the whole value, as every device of a replicated one does)."""
    return Sharding(self.mesh, ((),) * rank) if self.maximal is not None else self.with_rank(rank, what)

  def shard_shape(self, shape):
    """Per-device (padded) shape: ceil(S/T) in every sharded dimension."""
    return tuple(-(-int(s) // self.tiles(i)) for i, s in enumerate(shape))

  def tile_index(self, position, i):
    """Index of the shard of dimension i held by the device at mesh position `position`."""
    coords = self.mesh.coords(position)
    idx = 0
    for a in self.dims[i] if i < len(self.dims) else ():
      k = self.mesh.axis_index(a)
      idx = idx * self.mesh.shape[k] + int(coords[k])
    return idx

  # ---- XLA OpSharding ------------------------------------------------------------------------------------
  def tile_assignment(self):
    """(tile dims, flat device ids, replicate_on_last_tile_dim) exactly as TF's mesh_split builds them."""
    mesh = self.mesh
    perm = [mesh.axis_index(a) for axes in self.dims for a in axes]
    rest = [k for k in range(mesh.ndim) if k not in perm]
    tiles = [self.tiles(i) for i in range(self.rank)]
    partial = len(perm) < mesh.ndim
    if partial:
      tiles.append(mesh.size // math.prod(tiles))
    assign = np.transpose(mesh.device_ids, perm + rest).reshape(tiles)
    return tiles, assign.reshape(-1), partial

  def to_proto(self):
    """The `xla_data_pb2.OpSharding`, identical to what `xla_sharding.mesh_split` writes for this layout."""
    pb = _xla_data_pb2()
    if self.maximal is not None:
      return pb.OpSharding(type=pb.OpSharding.MAXIMAL, tile_assignment_dimensions=[1],
                           tile_assignment_devices=[self.maximal])
    if not self.dims:
      return pb.OpSharding(type=pb.OpSharding.REPLICATED)
    tiles, devices, partial = self.tile_assignment()
    return pb.OpSharding(type=pb.OpSharding.OTHER, tile_assignment_dimensions=tiles,
                         tile_assignment_devices=list(devices), replicate_on_last_tile_dim=partial or None)

  @classmethod
  def from_proto(cls, proto, mesh, what=None):
    """The inverse of `to_proto`: any OpSharding whose tile assignment is expressible by mesh axes."""
    pb = _xla_data_pb2()
    if isinstance(proto, (bytes, str)):
      raw = proto.encode("latin-1") if isinstance(proto, str) else proto
      proto = pb.OpSharding()
      try:
        proto.ParseFromString(raw)
      except Exception as e:  # pylint: disable=broad-except  (protobuf's DecodeError, from the C++ or Python parser)
        raise SpecError(f"{raw[:40]!r} is not a serialized OpSharding ({e}); pass gs.P(...), a gs.Sharding or "
                        "xla_data_pb2.OpSharding(...).SerializeToString()", node=what) from None
    if not (hasattr(proto, "type") and hasattr(proto, "tile_assignment_dimensions")):   # (any copy of the class)
      raise SpecError(f"cannot read an OpSharding from {proto!r:.80} ({type(proto).__name__}); pass an "
                      "xla_data_pb2.OpSharding or its serialized bytes", node=what)
    t = proto.type
    if t == pb.OpSharding.REPLICATED:
      return cls(mesh)
    if t == pb.OpSharding.MAXIMAL:
      return cls(mesh, maximal=_proto_devices(proto)[0])
    if t != pb.OpSharding.OTHER:
      raise SpecError(f"OpSharding type {pb.OpSharding.Type.Name(t)} is not supported (only replicated, maximal, "
                      "tiled and partially tiled)", node=what)
    tiles = list(proto.tile_assignment_dimensions)
    devices = _proto_devices(proto)
    last = list(proto.last_tile_dims)
    if any(m != pb.OpSharding.REPLICATED for m in last):
      raise SpecError("manual subgroup shardings are not supported", node=what)
    partial = bool(proto.replicate_on_last_tile_dim) or bool(last)
    if math.prod(tiles) != mesh.size or len(devices) != mesh.size:
      raise SpecError(f"OpSharding {_text(proto)} covers {len(devices)} devices but {mesh} has {mesh.size}; "
                      "annotate with the function's mesh", node=what)
    rank = len(tiles) - (1 if partial else 0)
    target = _canonical(np.asarray(devices).reshape(tiles), partial)
    for dims in _axis_assignments(mesh, tiles[:rank]):
      cand = cls(mesh, dims)
      ctiles, cdev, cpartial = cand.tile_assignment()
      if list(ctiles[:rank]) != tiles[:rank]:
        continue
      if np.array_equal(_canonical(np.asarray(cdev).reshape(ctiles), cpartial), target):
        return cand
    raise SpecError(f"OpSharding {_text(proto)} is not expressible over {mesh}: its device order matches no "
                    "assignment of mesh axes to dimensions; build it with mesh_split over this mesh's device_ids",
                    node=what)

  # ---- text ------------------------------------------------------------------------------------------------
  def __str__(self):
    if self.maximal is not None:
      return f"{{maximal device={self.maximal}}}"
    if self.is_replicated:
      return "{replicated}"
    return str(self.spec)

  def __repr__(self):
    """The layout as `P(...)` (what a user writes, and what the README and docs show `gs.sharding_of(v)` and
    `y.sharding` as; the mesh is `.mesh`); a maximal sharding, which no P expresses, with its mesh and device."""
    if self.maximal is not None:
      return f"Sharding({self.mesh}, maximal={self.maximal})"
    return repr(self.spec)


def as_spec(value, what=None):
  """`value` (a P, or a tuple or list of its entries) as a P; SpecError for anything else -- a bare string would
  otherwise be read as one entry per character."""
  if isinstance(value, P):
    return value
  if isinstance(value, (str, bytes)):
    raise SpecError(f"the spec {value!r} is a string; give gs.P({value!r}) to split the first dimension over axis "
                    f"{value!r}, or gs.P(...) with one entry per dimension", node=what)
  if not isinstance(value, (tuple, list)):
    raise SpecError(f"cannot read a partition spec from {value!r} ({type(value).__name__}); give gs.P(...) with one "
                    "entry (None, an axis name or a tuple of them) per tensor dimension", node=what)
  return P(*value)


def _dims(dims):
  """A Sharding's `dims` as a tuple of tuples of axis names; SpecError for anything else (a string would be read as
  its characters, a bare axis name per dimension as the letters of the name)."""
  if isinstance(dims, (str, bytes)) or not hasattr(dims, "__iter__"):
    raise SpecError(f"dims={dims!r}: give one tuple of mesh axis names per tensor dimension, e.g. (('data',), ()), "
                    "or build the sharding with Sharding.from_spec(mesh, P('data', None))", node="dims")
  dims = tuple(dims)
  for i, d in enumerate(dims):
    if isinstance(d, (str, bytes)) or not hasattr(d, "__iter__"):
      raise SpecError(f"dims[{i}] = {d!r} is not a tuple of mesh axis names: give e.g. ('data',) for a dimension "
                      "split over 'data' and () for one not split, or use Sharding.from_spec(mesh, P(...))",
                      node="dims")
  return tuple(tuple(d) for d in dims)


def _proto_devices(proto):
  if proto.tile_assignment_devices:
    return [int(d) for d in proto.tile_assignment_devices]
  if proto.iota_reshape_dims:
    n = math.prod(proto.iota_reshape_dims)
    perm = list(proto.iota_transpose_perm) or list(range(len(proto.iota_reshape_dims)))
    return [int(d) for d in np.arange(n).reshape(list(proto.iota_reshape_dims)).transpose(perm).reshape(-1)]
  return [0]


def _canonical(assign, partial):
  """Sort devices inside each replication group, as XLA does, so equal layouts compare equal."""
  if not partial:
    return assign
  return np.sort(assign, axis=-1)


def _axis_assignments(mesh, tiles):
  """Every way to give each dimension an ordered tuple of distinct mesh axes whose sizes multiply to its tiles."""
  names = mesh.axis_names

  def rec(i, used):
    if i == len(tiles):
      yield ()
      return
    free = [n for n in names if n not in used]
    for r in range(len(free) + 1):
      for combo in itertools.permutations(free, r):
        if math.prod(mesh.axis_size(a) for a in combo) == tiles[i]:
          for rest in rec(i + 1, used | set(combo)):
            yield (combo,) + rest

  return rec(0, frozenset())


def _text(proto):
  return "{" + ",".join(f"{f.name}={v}" for f, v in proto.ListFields()).replace("\n", " ") + "}"


def per_value(raw, n, what, values):
  """`in_shardings` or `out_shardings` (named by `what`) as one entry per value, for the `n` values that `values`
  describes ("the function was called with {n} arguments"): None gives None for each, one spec (a P, a Sharding,
  a proto, "auto") the same spec for each, a list or tuple one entry each -- it must then have n entries, or an
  InputError says so. The one reading of both arguments of gs.function."""
  if raw is None:
    return (None,) * n
  if not isinstance(raw, (tuple, list)) or isinstance(raw, P):
    return (raw,) * n
  if len(raw) != n:
    raise InputError(f"{what} has {len(raw)} entries but {values.format(n=n)}; give one spec per value or a single "
                     "spec for all")
  return tuple(raw)


def to_annotation(value, mesh, rank=None, what=None):
  """`(Sharding, open dims)` of an annotation: like `to_sharding`, but a `P` may leave dims open
  (`P.UNCONSTRAINED`): they start unsplit and completion may split them; the other dims are pinned."""
  if isinstance(value, (tuple, list)) and not isinstance(value, P):
    value = P(*value)
  if isinstance(value, P) and value.open_dims:
    return to_sharding(value.closed(), mesh, rank, what), value.open_dims
  return to_sharding(value, mesh, rank, what), ()


def to_sharding(value, mesh, rank=None, what=None):
  """The single parser of user sharding input: P, Sharding, tuple spec, OpSharding proto or bytes, or None."""
  if value is None:
    return None
  if isinstance(value, Sharding):
    if value.mesh != mesh:
      raise SpecError(f"sharding {value} is over {value.mesh}, but the function runs on {mesh}", node=what)
    return value.with_rank(rank, what) if rank is not None else value
  if isinstance(value, P):
    return Sharding.from_spec(mesh, value, rank, what)
  if isinstance(value, (bytes,)) or type(value).__name__ == "OpSharding":
    s = Sharding.from_proto(value, mesh, what)
    return s.with_rank(rank, what) if rank is not None else s
  if isinstance(value, (tuple, list)):
    return Sharding.from_spec(mesh, P(*value), rank, what)
  raise SpecError(f"cannot read a sharding from {value!r}; pass gs.P(...), a gs.Sharding or an OpSharding",
                  node=what)
