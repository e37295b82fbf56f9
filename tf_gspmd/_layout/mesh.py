"""Device meshes and partition specs: small frozen values, no TF runtime state."""

import dataclasses
import math
from typing import Optional, Tuple

import numpy as np

from tf_gspmd.errors import MeshError, SpecError


AXES_SEPARATOR = ","


def axes_text(axes):
  """Mesh axes as reports print them ("data,model"); no axis name contains the separator."""
  return AXES_SEPARATOR.join(axes)

class _Unconstrained:
  """The `P.UNCONSTRAINED` entry: a dimension whose split completion decides (the annotation leaves it open)."""

  _instance = None

  def __new__(cls):
    if cls._instance is None:
      cls._instance = super().__new__(cls)
    return cls._instance

  def __repr__(self):
    return "P.UNCONSTRAINED"

  def __reduce__(self):
    return (_Unconstrained, ())


class P(tuple):
  """A partition spec: one entry per tensor dimension.

  Each entry is ``None`` (dimension not split), a mesh axis name, a tuple of mesh axis names (the
  dimension is split over several axes, major first), or ``P.UNCONSTRAINED`` (the dimension is left open:
  completion chooses its split, as XLA's unspecified dims and JAX's ``P.UNCONSTRAINED``; only annotations
  and in/out shardings take it). A spec shorter than the tensor's rank leaves the trailing dimensions
  unsplit; ``P()`` is fully replicated for any rank.

  Example:
    >>> P("data", None)
    P('data', None)
    >>> P("data", P.UNCONSTRAINED).open_dims
    (1,)
  """

  UNCONSTRAINED = _Unconstrained()

  def __new__(cls, *entries):
    norm = []
    for e in entries:
      if e is None or isinstance(e, (str, _Unconstrained)):
        norm.append(e)
      elif isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e):
        e = tuple(e)
        norm.append(None if not e else (e[0] if len(e) == 1 else e))
      else:
        raise SpecError(f"partition spec entries must be None, an axis name or a tuple of axis names; got {e!r}")
    return super().__new__(cls, norm)

  def axes(self, i):
    """Mesh axes (a tuple, possibly empty) that split dimension i."""
    if i >= len(self):
      return ()
    e = self[i]
    if e is None or e is P.UNCONSTRAINED:
      return ()
    return (e,) if isinstance(e, str) else tuple(e)

  @property
  def open_dims(self):
    """The dimensions left to completion (`P.UNCONSTRAINED` entries)."""
    return tuple(i for i, e in enumerate(self) if e is P.UNCONSTRAINED)

  def closed(self):
    """This spec with its open dimensions unsplit (what they start from before completion refines them)."""
    return P(*[None if e is P.UNCONSTRAINED else e for e in self])

  def __repr__(self):
    return "P(" + ", ".join(repr(e) for e in self) + ")"

  __str__ = __repr__

  def __getnewargs__(self):
    return tuple(self)


@dataclasses.dataclass(frozen=True)
class Mesh:
  """A logical n-dimensional array of devices with named axes.

  Args:
    shape: size of each mesh axis, e.g. ``(2, 4)``.
    axis_names: one unique name per axis, e.g. ``("data", "model")``.
    devices: optional flat list (row-major) of TF device names. Default: the first ``prod(shape)``
      logical devices of the default type (GPU when present, else CPU), resolved when the mesh first
      runs, so a mesh can be planned on a machine that lacks its devices. Over several processes
      (`gs.initialize`) the devices of all of them count, processes major (the chief, then workers by
      index), so the mesh is the same in every process; `gs.local_devices(mesh)` are this process's.

  Example:
    >>> mesh = Mesh((2, 4), ("data", "model"))
    >>> mesh.axis_size("model")
    4
  """

  shape: Tuple[int, ...]
  axis_names: Tuple[str, ...]
  devices: Optional[Tuple[str, ...]] = None

  def __post_init__(self):
    shape = _whole_numbers(self.shape)
    if shape is None:
      raise MeshError(f"mesh shape must be a tuple of positive ints, one size per axis (e.g. (2, 4)); got "
                      f"{self.shape!r}", node="shape")
    if isinstance(self.axis_names, str):
      names = (self.axis_names,)
    elif not hasattr(self.axis_names, "__iter__"):
      raise MeshError(f"mesh axis names must be a tuple of names, one per axis (e.g. ('data', 'model')); got "
                      f"{self.axis_names!r}", node="axis_names")
    else:
      names = tuple(self.axis_names)
    object.__setattr__(self, "shape", shape)
    object.__setattr__(self, "axis_names", names)
    if not shape or any(s < 1 for s in shape):
      raise MeshError(f"mesh shape must be a non-empty tuple of positive ints; got {shape}")
    if len(names) != len(shape):
      raise MeshError(f"mesh shape {shape} has {len(shape)} axes but {len(names)} axis names {names} were given; "
                      "give one name per axis")
    if not all(isinstance(n, str) and n for n in names):
      raise MeshError(f"mesh axis names must be non-empty strings; got {names}")
    if len(set(names)) != len(names):
      raise MeshError(f"mesh axis names must be unique; got {names}")
    if any(AXES_SEPARATOR in n for n in names):
      raise MeshError(f"mesh axis names may not contain {AXES_SEPARATOR!r} (it separates axes in reports); got "
                      f"{names}")
    if self.devices is not None:
      devs = tuple(_device_name(d) for d in self.devices)
      if len(devs) != self.size:
        raise MeshError(f"mesh {shape} needs {self.size} devices but {len(devs)} were given")
      if len(set(devs)) != len(devs):
        raise MeshError(f"mesh devices must be distinct; got {devs}")
      object.__setattr__(self, "devices", devs)

  @property
  def size(self):
    return math.prod(self.shape)

  @property
  def ndim(self):
    return len(self.shape)

  def axis_size(self, name):
    return self.shape[self.axis_index(name)]

  def axis_index(self, name):
    try:
      return self.axis_names.index(name)
    except ValueError:
      raise SpecError(f"unknown mesh axis {name!r}; this mesh has axes {self.axis_names}") from None

  @property
  def device_ids(self):
    """Mesh positions 0..size-1 as an array of the mesh's shape (the `device_mesh` of `mesh_split`)."""
    return np.arange(self.size).reshape(self.shape)

  def coords(self, position):
    """Mesh coordinates (one per axis) of the device at flat position `position`."""
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or not 0 <= position < self.size:
      raise MeshError(f"position {position!r} is not a device of {self}: give 0..{self.size - 1}", node="position")
    return np.unravel_index(position, self.shape)

  def resolve_devices(self):
    """The TF device names of the mesh, row-major. Raises MeshError when there are too few devices."""
    if self.devices is not None:
      return self.devices
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    kind = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    avail = sorted((d.name for d in tf.config.list_logical_devices(kind)), key=device_order)
    if len(avail) < self.size:
      raise MeshError(
          f"mesh {dict(zip(self.axis_names, self.shape))} needs {self.size} devices but only {len(avail)} logical "
          f"{kind} device(s) exist; use a smaller mesh, pass devices=[...], or split the CPU before TF starts with "
          f"tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * {self.size})")
    return tuple(_device_name(d) for d in avail[:self.size])

  def __str__(self):
    return "Mesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape)) + ")"


def _whole_numbers(values):
  """`values` as a tuple of ints, or None unless it is a sequence of whole numbers (not a string, a float with a
  fraction or a bool: `int()` would turn "24" into (2, 4) and 2.5 into 2 without a word)."""
  if isinstance(values, (str, bytes)):
    return None
  try:
    items = tuple(values)
  except TypeError:
    return None
  if not all(isinstance(v, (int, np.integer, float, np.floating)) and not isinstance(v, (bool, np.bool_)) and
             float(v).is_integer() for v in items):
    return None
  return tuple(int(v) for v in items)


JOB_ORDER = ("chief", "worker")   # the jobs whose tasks drive devices, in process order


def device_order(device):
  """Sort key of a device name: process (chief first, then workers by index), then device type and index."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  spec = tf.DeviceSpec.from_string(device)
  job = JOB_ORDER.index(spec.job) if spec.job in JOB_ORDER else -1
  return (job, spec.replica or 0, spec.task or 0, spec.device_type or "", spec.device_index or 0)


def _device_name(d):
  """Canonical full device name, e.g. '/job:localhost/replica:0/task:0/device:CPU:3'."""
  name = getattr(d, "name", d)
  if not isinstance(name, str):
    raise MeshError(f"devices must be device names or tf.config.LogicalDevice objects; got {d!r}")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    spec = tf.DeviceSpec.from_string(name)
  except ValueError as e:
    raise MeshError(f"{name!r} is not a device name ({e}); give one such as '/device:CPU:0' or "
                    "'/job:worker/replica:0/task:1/device:GPU:0'") from None
  if spec.job is None:
    spec = spec.replace(job="localhost", replica=0, task=0)
  if spec.device_type is None or spec.device_index is None:
    raise MeshError(f"device {name!r} must name a device type and index, e.g. '/device:CPU:0'")
  return spec.to_string()
