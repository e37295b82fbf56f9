"""Sharding annotations inside a tf.function: `mesh_split` (the GSPMD paper's API), `shard`, `replicate`.

An annotation is an Identity op carrying the `_XlaSharding` attribute, the same serialized OpSharding that
TensorFlow's own `xla_sharding` writes, so graphs annotated either way read the same. An annotation that leaves
dims open (`P.UNCONSTRAINED`, `unspecified_dims`) is TF's XlaSharding op with those `unspecified_dims`, as
`xla_sharding.mesh_split(..., use_sharding_op=True, unspecified_dims=...)` writes it. Outside a graph (eager)
the annotations check their arguments and return the tensor unchanged.
"""

import contextlib
import dataclasses
import json
import threading
from typing import Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd._layout.mesh import Mesh, P
from tf_gspmd._layout.schedule import Schedule
from tf_gspmd._layout.sharding import Sharding, as_spec, to_annotation
from tf_gspmd.errors import InputError, MeshError, ShapeError, SpecError

SHARDING_ATTR = "_XlaSharding"
SPEC_ATTR = "_gspmd_spec"   # a named-axis spec awaiting the mesh of the gs.function that traces it

_state = threading.local()


@contextlib.contextmanager
def _scoped(attr, value):
  """Sets this thread's `_state.<attr>` to `value` while the block runs (yields it), then restores it."""
  prev = getattr(_state, attr, None)
  setattr(_state, attr, value)
  try:
    yield value
  finally:
    setattr(_state, attr, prev)


def mesh_scope(mesh):
  """Makes `mesh` the mesh of `shard`/`replicate` while a gs.function traces."""
  return _scoped("mesh", mesh)


def current_mesh():
  return getattr(_state, "mesh", None)


def sharding_ops():
  """While active, annotations are TF's XlaSharding op, which tf2xla lowers to XLA's Sharding custom-call, for a
  program XLA partitions (TPUs). The default form, an Identity carrying `_XlaSharding`, is dropped by tf2xla: an
  Identity builds no XLA instruction to carry the sharding."""
  return _scoped("ops", True)


def _tensor_name(t):
  try:
    return t.name
  except (AttributeError, ValueError):
    return "<eager tensor>"


def _as_tensor(value, api):
  """`value` as a tensor; InputError naming `api` (the annotation called) for what TF cannot convert."""
  try:
    return tf.convert_to_tensor(value)
  except (TypeError, ValueError) as e:
    raise InputError(f"{api} annotates a tensor; got {type(value).__name__} {value!r:.80}, which is not one ({e})",
                     node=api) from None


def _checked_mesh(mesh, api):
  """`mesh` unless it is given and is not a gs.Mesh (MeshError naming `api`)."""
  if mesh is not None and not isinstance(mesh, Mesh):
    raise MeshError(f"{api}(mesh={mesh!r}): give a gs.Mesh, or leave mesh out inside a gs.function (its mesh is "
                    "used)", node="mesh")
  return mesh


def _open_dims(dims, what):
  """`unspecified_dims` as a sorted list of ints (SpecError for anything else)."""
  if isinstance(dims, (str, bytes)) or not hasattr(dims, "__iter__") or not all(
      isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in dims):
    raise SpecError(f"unspecified_dims={dims!r}: give the tensor dimensions left open as a list of ints, e.g. [1]",
                    node=what)
  return sorted({int(d) for d in dims})


def _annotate(t, sharding, name=None, open_dims=()):
  t = tf.convert_to_tensor(t)
  rank = t.shape.rank
  if rank is None:
    raise ShapeError("cannot annotate a tensor of unknown rank; give the tf.function an input_signature or "
                     "TensorSpecs with static shapes", node=_tensor_name(t))
  sharding = sharding.with_rank(rank, what=_tensor_name(t)) if sharding.dims else sharding
  open_dims = _open_dims(open_dims, _tensor_name(t))
  if open_dims and (open_dims[0] < 0 or open_dims[-1] >= rank):
    raise SpecError(f"open dims {open_dims} are not dimensions of a tensor of rank {rank}", node=_tensor_name(t))
  if tf.executing_eagerly():
    return t
  proto = sharding.to_proto().SerializeToString()
  if open_dims or getattr(_state, "ops", False):
    return _compat.xla_sharding_op(t, proto, open_dims, name)
  return _annotated_identity(t, SHARDING_ATTR, proto, name)


def _annotated_identity(t, attr, value, name):
  """Identity(t) carrying the annotation `attr`; its gradient carries it too (as JAX transposes a sharding
  constraint into one on the cotangent), so a layout chosen for a tensor also holds for its gradient.

  The gradient is recorded on the tape directly (see `_compat.identity_with_gradient` for why not with
  tf.custom_gradient): the graph holds one Identity per annotation and one per annotated gradient.
  """
  out = _compat.identity_with_gradient(t, name, lambda dy: _annotated_identity(dy, attr, value, None))
  _compat.set_op_attr(out.op, attr, tf.compat.v1.AttrValue(s=value))
  return out


def _mesh_from_device_mesh(device_mesh, mesh):
  """The Mesh to use for a `mesh_split` device_mesh array."""
  device_mesh = np.asarray(device_mesh)
  if mesh is not None and mesh.shape == device_mesh.shape:
    return mesh
  names = tuple(f"mesh_dim{k}" for k in range(device_mesh.ndim))
  return Mesh(device_mesh.shape, names)


def mesh_split(tensor, device_mesh, dims_mapping, name=None, unspecified_dims=None):
  """Annotates `tensor` as split over `device_mesh` (GSPMD's `mesh_split`).

  Args:
    tensor: the tensor to annotate.
    device_mesh: an np.ndarray of device ids (mesh positions) or a `gs.Mesh`.
    dims_mapping: one entry per tensor dimension: the mesh dimension that splits it, or -1.
    name: optional name of the annotated tensor (its key in `Lowered.shardings`).
    unspecified_dims: optional tensor dimensions left open (give them -1 in `dims_mapping`): completion
      chooses their split, the other dimensions are pinned (TF's `xla_sharding.mesh_split` argument).

  Returns:
    The annotated tensor (use it in place of `tensor`).

  Example:
    >>> y = mesh_split(x, np.arange(8).reshape(2, 4), [0, -1])   # rows split over mesh dim 0
    >>> y = mesh_split(x, np.arange(8).reshape(2, 4), [0, -1], unspecified_dims=[1])   # columns: completion's
  """
  t = _as_tensor(tensor, "mesh_split")
  what = _tensor_name(t)
  if isinstance(device_mesh, Mesh):
    mesh, ids = device_mesh, device_mesh.device_ids
  else:
    ids = np.asarray(device_mesh)
    if ids.ndim == 0 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
      raise SpecError(f"device_mesh must be a non-empty integer array of device ids; got {device_mesh!r}", node=what)
    if sorted(ids.reshape(-1).tolist()) != list(range(ids.size)):
      raise SpecError(f"device_mesh must hold each device id 0..{ids.size - 1} once; got {ids.tolist()}", node=what)
    mesh = _mesh_from_device_mesh(ids, current_mesh())
  if isinstance(dims_mapping, (str, bytes)) or not hasattr(dims_mapping, "__iter__") or not all(
      isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in dims_mapping):
    raise SpecError(f"dims_mapping={dims_mapping!r}: give one int per tensor dimension, the mesh dimension that "
                    "splits it or -1 (not split), e.g. [0, -1]", node=what)
  dims_mapping = [int(d) for d in dims_mapping]
  if t.shape.rank is not None and len(dims_mapping) != t.shape.rank:
    raise SpecError(f"dims_mapping {dims_mapping} has {len(dims_mapping)} entries but the tensor has rank "
                    f"{t.shape.rank}; give one entry per dimension (-1 = not split)", node=what)
  used = [d for d in dims_mapping if d >= 0]
  dup = {d for d in used if used.count(d) > 1}
  if dup:
    raise SpecError(f"dims_mapping {dims_mapping} uses mesh dimension {sorted(dup)[0]} for more than one tensor "
                    "dimension; each mesh dimension may split at most one", node=what)
  sharding = Sharding.from_dims_mapping(mesh, dims_mapping, what=what)
  if not np.array_equal(ids, mesh.device_ids):
    # A permuted device_mesh: write exactly what TF would, then read it back over the mesh.
    proto = _compat.xla_mesh_split_sharding(ids, dims_mapping)
    sharding = Sharding.from_proto(proto, mesh, what=what)
  return _annotate(t, sharding, name, unspecified_dims or ())


@tf.autograph.experimental.do_not_convert   # library code: converting it only costs tracing time
def shard(tensor, spec, mesh=None, name=None):
  """Annotates `tensor` with a named-axis partition spec, e.g. ``shard(x, P("data", None))``.

  The mesh is `mesh`, else the enclosing `gs.function`'s. Traced by plain TF (no mesh known yet), the
  annotation is kept by name and resolved when a gs.function lowers the graph; run eagerly it is a no-op,
  so the same model code runs unpartitioned. A `P.UNCONSTRAINED` entry leaves that dim to completion (it may
  split it over mesh axes the other dims do not use); the other dims are pinned as given.

  Example:
    >>> h = shard(h, P("data", P.UNCONSTRAINED))   # rows over "data"; columns as the neighbours want
  """
  t = _as_tensor(tensor, "shard")
  mesh = _checked_mesh(mesh, "shard") or current_mesh()
  spec = spec if isinstance(spec, Sharding) else as_spec(spec, what=_tensor_name(t))
  if mesh is None:
    if isinstance(spec, Sharding):
      return _annotate(t, spec, name)
    if tf.executing_eagerly():
      return t
    return _annotated_identity(t, SPEC_ATTR, encode_spec(spec), name)
  sharding, open_dims = to_annotation(spec, mesh, rank=t.shape.rank, what=_tensor_name(t))
  return _annotate(t, sharding, name, open_dims)


_OPEN = "UNCONSTRAINED"   # a P.UNCONSTRAINED entry in an encoded spec


def encode_spec(spec):
  return json.dumps([_OPEN if e is P.UNCONSTRAINED else list(spec.axes(i)) for i, e in enumerate(spec)]).encode()


def decode_spec(raw):
  return P(*[P.UNCONSTRAINED if e == _OPEN else tuple(e) if e else None for e in json.loads(raw)])


def replicate(tensor, mesh=None, name=None):
  """Annotates `tensor` as replicated on every device."""
  t = _as_tensor(tensor, "replicate")
  mesh = _checked_mesh(mesh, "replicate") or current_mesh() or Mesh((1,), ("_",))
  return _annotate(t, Sharding(mesh), name)


# ---- pipeline schedules --------------------------------------------------------------------------------------
# `gs.pipeline` describes the schedule it builds here while a gs.function traces; the trace pass keeps the
# descriptions with the program, and the report states them (the partitioner itself only sees ops).

@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  """A pipeline as `gs.pipeline` built it: its schedule and the names of the ops and tensors that carry it."""

  name: str
  stage_axis: str
  schedule: Schedule          # "circular": S stage slots per repeat (the buffer's stage dim), M microbatches, R repeats
  shift: str                  # the loop body's Roll node (the stage shift)
  buffers: Tuple[Tuple[str, Tuple[int, ...], int], ...]   # (tensor name, global shape, dtype bytes) per buffer


def recording_schedules():
  """Collects the `PipelineSpec`s built while the block runs (a trace); yields the list."""
  return _scoped("schedules", [])


def record_schedule(spec):
  """Called by `gs.pipeline` for each pipeline it builds (a no-op outside a gs.function's trace)."""
  schedules = getattr(_state, "schedules", None)
  if schedules is not None:
    schedules.append(spec)
