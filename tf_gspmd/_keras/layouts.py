"""Keras layouts on tf_gspmd's values: meshes and layouts as the TF backend's (`backend_mesh`, `backend_layout`),
eager `distribute_tensor` / `distribute_variable`, the check of a layout map's keys against a model, and
`auto_layout_map` (a Keras LayoutMap chosen by automatic sharding). `tf_gspmd.keras` installs them."""

import difflib
import re
import warnings

import keras
import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd import initializers
from tf_gspmd._layout.annotations import shard
from tf_gspmd._function import function as gs_function
from tf_gspmd._layout.mesh import Mesh, P
from tf_gspmd._layout.sharding import Sharding, to_sharding
from tf_gspmd.errors import InputError, MeshError, SpecError
from tf_gspmd.rewriter.graph.graph_view import ref
from tf_gspmd.runtime import parallel as _parallel
from tf_gspmd.runtime import create as _create
from tf_gspmd.runtime import state as _state
from tf_gspmd.runtime.sharded_tensor import ShardedTensor, shard_host_value


def mesh_of(device_mesh):
  devices = []
  for d in np.asarray(device_mesh.devices).reshape(-1):
    if str(d).startswith("/job:"):   # a full name (list_devices over several processes)
      devices.append(str(d))
      continue
    kind, _, index = str(d).rpartition(":")
    devices.append(f"/device:{kind.split('/')[-1].upper()}:{index}")
  return Mesh(tuple(device_mesh.shape), tuple(device_mesh.axis_names), devices=devices)


def paths_of(model):
  """Every path a layout map key may name in `model`: its variables' (optimizer and metrics included) and
  `"<layer path>/output"` for each of its layers (and nested layers)."""
  paths = set()
  groups = [getattr(model, "variables", ()), getattr(model, "weights", ()), getattr(model, "metrics_variables", ())]
  if getattr(model, "optimizer", None) is not None:
    groups.append(model.optimizer.variables)
  for group in groups:
    paths.update(v.path for v in group if getattr(v, "path", None))
  for layer in [model] + _compat.keras_nested_layers(model):
    for name in {getattr(layer, "path", None), layer.name}:
      if name:
        paths.add(f"{name}/output")
  return paths


def warn_unmatched_keys(keys, model):
  """Warns, once per key, about each layout map key in `keys` that names none of `model`'s variables or layer
  outputs: such a key does nothing, and what it was meant to split stays replicated (a renamed layer, a typo in a
  regex)."""
  if not keys:
    return
  paths = sorted(paths_of(model))
  for key in keys:
    try:
      matches = any(key == p or re.fullmatch(key, p) for p in paths)
    except re.error as e:
      warnings.warn(f"layout map key {key!r} is not a valid regular expression ({e}); it matches nothing in model "
                    f"{model.name!r}", stacklevel=4)
      continue
    if not matches:
      near = difflib.get_close_matches(key, paths, n=3, cutoff=0.5)
      hint = f"; nearest paths: {near}" if near else ""
      warnings.warn(f"layout map key {key!r} matches no variable path or \"<layer path>/output\" of model "
                    f"{model.name!r} ({len(paths)} paths, matched with re.fullmatch): what it was meant to lay out "
                    f"stays replicated. Fix the key{hint}", stacklevel=4)


# Keras's own words for a layout without a mesh (its backends' ValueError; SpecError is one): callers match them.
NO_MESH = "Cannot create sharding when device mesh is not set"


def layout_sharding(layout, shape, what, mesh=None):
  """(mesh, Sharding) of a Keras TensorLayout (or a gs.Sharding, the layout's `backend_layout`) for a value of
  `shape`, over the layout's own device mesh, else `mesh` (the active distribution's). Raises SpecError naming
  the value, dimension and mesh axis for a layout that does not fit it. An uneven split is allowed: the last tiles
  are padded, as everywhere in tf_gspmd."""
  if isinstance(layout, Sharding):
    return layout.mesh, layout.with_rank(len(shape), what)
  device_mesh = getattr(layout, "device_mesh", None)
  if device_mesh is not None:
    own = mesh_of(device_mesh)
    mesh = mesh if own == mesh else own
  if mesh is None:
    raise SpecError(f"{NO_MESH} (layout {tuple(layout.axes)} for {what}, no distribution active): create the "
                    f"TensorLayout with a keras.distribution.DeviceMesh, or call this under a distribution's scope()")
  axes = tuple(layout.axes)
  if len(axes) != len(shape):
    raise SpecError(f"layout {axes} has {len(axes)} entries but {what} has rank {len(shape)}; give the layout one "
                    f"entry per dimension (None keeps a dimension whole)")
  names = tuple(mesh.axis_names)
  seen = {}
  for d, entry in enumerate(axes):
    for a in (entry if isinstance(entry, (tuple, list)) else (entry,)):
      if a is None:
        continue
      if a not in names:
        raise SpecError(f"layout {axes} splits dimension {d} of {what} over mesh axis {a!r}, which the mesh "
                        f"{dict(zip(names, mesh.shape))} does not have; use one of {list(names)} or None")
      if a in seen:
        raise SpecError(f"layout {axes} splits dimensions {seen[a]} and {d} of {what} over the same mesh axis "
                        f"{a!r}; a mesh axis may split one dimension only")
      seen[a] = d
  return mesh, to_sharding(P(*axes), mesh, rank=len(shape), what=what)


def distribute_eagerly(tensor, layout, mesh):
  """`tensor` as a ShardedTensor laid out by `layout` (a Keras TensorLayout or a gs.Sharding) over `mesh` (the
  active distribution's, or None) or the layout's own; validated as `layout_sharding` says."""
  if not isinstance(tensor, ShardedTensor):
    tensor = tf.convert_to_tensor(tensor)
  shape, dtype = tuple(tensor.shape.as_list()), tensor.dtype
  what = f"the tensor of shape {shape} ({dtype.name}) given to keras.distribution.distribute_tensor"
  mesh, sharding = layout_sharding(layout, shape, what, mesh)
  if isinstance(tensor, ShardedTensor) and tensor.sharding == sharding:
    return tensor   # already laid out so
  value = tensor.numpy()
  devices = mesh.resolve_devices()
  positions = _parallel.local(devices).positions
  comps = []
  for p, piece in zip(positions, shard_host_value(value, sharding, shape, positions)):
    with tf.device(devices[p]):
      comps.append(tf.identity(tf.constant(piece, dtype)))
  return ShardedTensor(comps, sharding, shape, dtype, devices=devices, positions=positions)


class _HostValue(initializers.Initializer):
  """An initializer that gives the blocks of one host value (each shard of a variable cut from it on its device)."""

  def __init__(self, value):
    self.value = value

  def block(self, shape, starts, lengths, dtype):
    return tf.constant(self.value[tuple(slice(s, s + n) for s, n in zip(starts, lengths))], dtype)


def distribute_variable(value, layout, mesh=None):
  """The backend's `distribute_variable`: a variable stored sharded as `layout` says (`gs.sharding_of` reads it).

  A tf.Variable or Keras variable is re-laid out in place and returned; any other value (array, tensor,
  ShardedTensor) becomes a new tf.Variable created shard by shard, each device holding only its piece. The layout
  is validated as for distribute_tensor (rank, mesh axes, an axis used once). `mesh`: the active distribution's
  (used when the layout has none)."""
  variable = value if _compat.is_resource_variable(value) or isinstance(value, keras.Variable) else None
  if variable is not None:
    shape, dtype = tuple(variable.shape), tf.as_dtype(variable.dtype)
    what = f"variable {getattr(variable, 'path', variable.name)!r} {list(shape)} given to distribute_variable"
  else:
    value = value.numpy() if isinstance(value, ShardedTensor) else np.asarray(value)
    shape, dtype = value.shape, tf.as_dtype(value.dtype)
    what = f"the value of shape {shape} ({dtype.name}) given to distribute_variable"
  mesh, sharding = layout_sharding(layout, shape, what, mesh)
  if variable is not None:
    _state.manage(variable, sharding, mesh.resolve_devices(), what=what)
    return variable
  return _create.variable(_HostValue(value), shape, dtype, mesh=mesh, spec=sharding)


def backend_layout(tensor_layout):
  """`TensorLayout.backend_layout` on the TF backend: the gs.Sharding over the layout's mesh (`backend_mesh`)."""
  if tensor_layout.device_mesh is None:
    raise SpecError(f"{NO_MESH} (TensorLayout {tuple(tensor_layout.axes)}): give the TensorLayout a DeviceMesh (or "
                    f"put it in a LayoutMap, which sets its own)")
  axes = tuple(tensor_layout.axes)
  return layout_sharding(tensor_layout, (0,) * len(axes), f"TensorLayout {axes}")[1]


class AutoLayoutMap(keras.distribution.LayoutMap):
  """A Keras LayoutMap written by `auto_layout_map`: one key per variable (its exact path, as a regular
  expression; an optimizer variable's matches any name of its optimizer, `map_key`), the TensorLayout automatic
  sharding chose for it. Edit it as any LayoutMap; `str()` prints it as
  the Python that builds it.

  Attributes:
    auto_plan: what the solver chose and why (`rewriter.sharding.auto.AutoPlan`: each choice, its runner-up and cost).
    memory: the memory account of the train step laid out by this map (`report.memory`: the plan's count, what
      `memory_budget` bounds, and the per-device program's estimate).
    batch_dim_name: the mesh axis the batch was split over (give it to ModelParallel).
  """

  def __init__(self, device_mesh, batch_dim_name, auto_plan=None, memory=None):
    super().__init__(device_mesh)
    self.batch_dim_name = batch_dim_name
    self.auto_plan = auto_plan
    self.memory = memory

  def __str__(self):
    mesh = self.device_mesh
    lines = [f"# chosen by automatic sharding over mesh {dict(zip(mesh.axis_names, mesh.shape))}, batch over "
             f"{self.batch_dim_name!r}" + (f"; {self.memory.plan.peak_bytes:,} B per device (plan)"
                                           if self.memory is not None else ""),
             "layout_map = keras.distribution.LayoutMap(device_mesh)"]
    lines += [f"layout_map[{key!r}] = {tuple(layout.axes)!r}" for key, layout in self.items()]
    return "\n".join(lines)


def tensor_layout(sharding, rank, device_mesh):
  """The Keras TensorLayout of a gs.Sharding of a tensor of `rank` (a dim over several mesh axes: their tuple)."""
  dims = sharding.with_rank(rank).dims if rank else ()
  axes = tuple(None if not a else a[0] if len(a) == 1 else tuple(a) for a in dims)
  if any(isinstance(a, tuple) for a in axes):   # a dim split over several mesh axes
    return _compat.keras_tensor_layout(axes, device_mesh)
  return keras.distribution.TensorLayout(axes, device_mesh)


def map_key(variable, optimizer=None):
  """The layout map key of `variable`: its path as a regular expression matching it alone. For a variable of
  `optimizer` (a slot, its step counter), the optimizer's generated name in the path ("adam_3/...") matches any
  name Keras generates for it ("adam", "adam_7", ...): the same model and optimizer built again (e.g. in the
  distribution's scope) get new optimizer names, and the map must lay out their slots too."""
  parts = variable.path.split("/")
  if optimizer is None or len(parts) < 2:
    return re.escape(variable.path)
  scopes = [re.escape(re.sub(r"_\d+$", "", p)) + r"(?:_\d+)?" for p in parts[:-1]]
  return "/".join(scopes + [re.escape(parts[-1])])


def _check_data(model, data):
  """InputError naming `data` where it carries no targets for a model whose compiled loss reads them."""
  y = data[1] if isinstance(data, (tuple, list)) and len(data) in (2, 3) else None
  if getattr(model, "loss", None) is None or y is not None:
    return
  got = tf.nest.map_structure(lambda t: f"{type(t).__name__}{list(np.shape(t))}", data)
  raise InputError(f"data={got} has no targets, but model {model.name!r} computes its compiled loss from them: give "
                   f"one batch as train_step takes it, data=(x, y) or (x, y, sample_weight)", node="data")


def auto_layout_map(model, device_mesh, memory_budget=None, *, data, batch_dim_name=None, axis_cost=None,
                    flops_per_byte=1000.0, solver_time_limit=None, include_optimizer=True):
  """A Keras LayoutMap for `model` chosen by automatic sharding (`in_shardings="auto"`) of its train step.

  The compiled model's `train_step` on one batch of `data` is lowered over `device_mesh` (plan mode: no device
  runs it) with the batch split over `batch_dim_name`, as ModelParallel splits it, and every variable's layout
  left to the solver under `memory_budget` (bytes per device of the step: arguments, variables and optimizer
  state, constants and the activations live at the peak). The layouts it chose are returned as an explicit
  LayoutMap: a key per variable -- its exact path; for the optimizer's, included with `include_optimizer`, the path
  with any name of the optimizer (`map_key`), so the map also fits the model and optimizer built again -- and a
  TensorLayout. Only the batch and the variables are pinned while solving (`auto_pins="state"`), the
  rest completed as the step ModelParallel runs with the map completes it, so the count the budget bounds is that
  step's (`.memory`).

  Args:
    model: a compiled Keras model (built here from `data` if it is not yet).
    device_mesh: the `keras.distribution.DeviceMesh`.
    memory_budget: bytes per device the plan may hold at its peak, or None (then a small model stays replicated:
      the solver also prices arithmetic against bytes moved, see `flops_per_byte`).
    data: one batch as `train_step` takes it: `(x, y)` or `(x, y, sample_weight)` (arrays or tensors; only shapes
      and dtypes are used).
    batch_dim_name: the mesh axis of the batch (default: "batch" if the mesh has it, else its first axis).
    axis_cost, flops_per_byte, solver_time_limit: as for `gs.function`.
    include_optimizer: also list the optimizer's variables (slots, step counter).

  Returns:
    An `AutoLayoutMap` (a `keras.distribution.LayoutMap`; `.auto_plan`, `.memory`, `.batch_dim_name`).

  Raises:
    AutoShardingError: no layout fits the budget.

  Example:
    >>> layout_map = gs.keras.auto_layout_map(model, mesh, memory_budget=64 << 20, data=(x[:8], y[:8]))
    >>> print(layout_map)      # the Python that builds it: edit any entry
    >>> with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
    ...   model.fit(x, y, batch_size=8)
  """
  if not isinstance(device_mesh, keras.distribution.DeviceMesh):
    raise InputError(f"auto_layout_map needs a keras.distribution.DeviceMesh; got {device_mesh!r}")
  names = list(device_mesh.axis_names)
  if batch_dim_name is None:
    batch_dim_name = "batch" if "batch" in names else names[0]
  if batch_dim_name not in names:
    raise MeshError(f"batch_dim_name {batch_dim_name!r} is not an axis of the device mesh {names}; give one of them")
  if getattr(model, "optimizer", None) is None:
    raise InputError(f"auto_layout_map lays out model {model.name!r}'s train step: compile the model first")
  _check_data(model, data)
  leaves = [None if t is None else tf.convert_to_tensor(t) for t in tf.nest.flatten(data)]
  structure = data
  _compat.keras_symbolic_build(model, data)
  if not model.optimizer.built:
    model.optimizer.build(model.trainable_variables)
  mesh = mesh_of(device_mesh)
  present = [t is not None for t in leaves]
  flat = [t for t in leaves if t is not None]
  variables = list(model.weights) + (list(model.optimizer.variables) if include_optimizer else [])
  slots = {id(v) for v in model.optimizer.variables}

  def step(*xs):
    it = iter(shard(t, P(batch_dim_name)) if t.shape.rank else t for t in xs)
    return model.train_step(tf.nest.pack_sequence_as(structure, [next(it) if p else None for p in present]))

  # Only the batch and the variables are pinned (auto_pins="state"): a LayoutMap lays out nothing else, so the
  # plan the budget bounds is the one ModelParallel runs with the map, completed as it completes it.
  f = gs_function(tf.autograph.experimental.do_not_convert(step), mesh=mesh, in_shardings="auto",
                  memory_budget=memory_budget, axis_cost=axis_cost, flops_per_byte=flops_per_byte,
                  solver_time_limit=solver_time_limit, auto_pins="state")
  low = f.lower(*[tf.TensorSpec(t.shape, t.dtype) for t in flat])
  program = low.program
  chosen = {id(v): program.shardings[ref(name)] for name, v in zip(program.variable_names, program.variables)}
  layout_map = AutoLayoutMap(device_mesh, batch_dim_name, auto_plan=low.auto_plan, memory=low.report.memory)
  done = set()
  for v in variables:
    sharding = chosen.get(id(_compat.keras_inner_variable(v))) or chosen.get(id(v))
    if sharding is None or v.path in done:
      continue   # not read by the train step (or a variable listed twice)
    done.add(v.path)
    key = map_key(v, model.optimizer if id(v) in slots else None)
    layout_map[key] = tensor_layout(sharding, len(v.shape), device_mesh)
  return layout_map
