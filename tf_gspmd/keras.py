"""Keras 3 on the TensorFlow backend, partitioned: `model.fit / evaluate / predict` over a mesh.

Keras's distribution API (`keras.distribution.ModelParallel`, `DataParallel`, `LayoutMap`) does nothing on
the TensorFlow backend: its TF `distribution_lib` is a stub. Importing this module supplies it:

* while a distribution is active — `keras.distribution.set_distribution(...)`, `distribution.scope()`, or
  `gs.keras.scope(...)` with a Keras distribution or tf_gspmd's own `LayoutMap` — the train, test and
  predict functions Keras builds (`make_train_function` and friends) are gs.functions over the
  distribution's mesh: each variable annotated with its layout (`re.fullmatch` of the layout map's keys
  against `variable.path`), the batch split over the batch axis, everything else completed;
* `"<layer path>/output"` keys annotate that layer's output (Keras calls the backend's
  `distribute_tensor` after every layer call);
* a keras-hub CausalLM's `generate()` runs partitioned too, whichever of keras_hub and this module is imported
  first;
* `keras.distribution.distribute_tensor` run eagerly returns the value laid out (a gs.ShardedTensor), the
  backend's `distribute_variable` a variable stored sharded; `DeviceMesh.backend_mesh` is the gs.Mesh and
  `TensorLayout.backend_layout` the gs.Sharding;
* a layout map key that matches no variable or layer output of the model warns (once per key);
* `auto_layout_map(model, mesh, memory_budget, data=...)` writes a LayoutMap for a model that ships none, chosen
  by automatic sharding of its train step.

Model code, `compile`, callbacks, metrics, the progress bar, `save_weights` / `load_weights` and
`tf.train.Checkpoint` keep working: variables are stored sharded from the first step (`gs.sharding_of`)
and read back whole when Keras reads them eagerly.

Example:
  >>> import tf_gspmd as gs, tf_gspmd.keras   # noqa
  >>> mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices())
  >>> layout_map = keras.distribution.LayoutMap(mesh)
  >>> layout_map[".*_up/kernel"] = (None, "model")
  >>> keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
  ...                                                                      batch_dim_name="batch"))
  >>> model.fit(x, y, epochs=1)      # partitioned
"""

import collections
import contextlib
import importlib.abc
import math
import re
import sys
import threading
import weakref
import zlib

import keras
import numpy as np
import tensorflow as tf

from tf_gspmd._platform import cluster as _cluster
from tf_gspmd._platform import compat as _compat
from tf_gspmd import initializers
from tf_gspmd import keras_weights
from tf_gspmd._layout.annotations import current_mesh, shard
from tf_gspmd._function import function as gs_function
from tf_gspmd._keras.layouts import AutoLayoutMap, auto_layout_map  # noqa: F401  (public: gs.keras.auto_layout_map)
from tf_gspmd._keras.layouts import (backend_layout, distribute_eagerly, distribute_variable, mesh_of,
                                     warn_unmatched_keys)
from tf_gspmd._layout.mesh import Mesh, P, device_order
from tf_gspmd._layout.plan_scope import in_plan_scope
from tf_gspmd._layout.sharding import Sharding, as_spec, to_sharding
from tf_gspmd.errors import InputError, MeshError, SpecError
from tf_gspmd.runtime import create as _create
from tf_gspmd.runtime import state as _state
from tf_gspmd.runtime.sharded_tensor import ShardedTensor

_local = threading.local()


class LayoutMap(collections.abc.MutableMapping):
  """tf_gspmd's layout map: regex keys (matched with `re.fullmatch` against `variable.path`, or
  `"<layer path>/output"`) to partition specs, over one mesh, with the batch split over `batch_axis`.

  Example:
    >>> layouts = gs.keras.LayoutMap(gs.Mesh((2, 4), ("data", "model")), batch_axis="data")
    >>> layouts[".*_up/kernel"] = P(None, "model")
    >>> with gs.keras.scope(layouts):
    ...   model.fit(x, y)
  """

  def __init__(self, mesh, batch_axis="data"):
    if not isinstance(mesh, Mesh):
      raise InputError(f"LayoutMap needs a gs.Mesh; got {mesh!r}")
    if batch_axis is not None:
      mesh.axis_index(batch_axis)
    self.mesh = mesh
    self.batch_axis = batch_axis
    self._rules = collections.OrderedDict()

  def __setitem__(self, pattern, spec):
    spec = as_spec(spec, what=pattern)
    unknown = [a for entry in spec for a in ((entry,) if isinstance(entry, str) else
                                             tuple(entry) if isinstance(entry, (tuple, list)) else ())
               if a not in self.mesh.axis_names]
    if unknown:
      raise SpecError(f"layout_map[{pattern!r}] = {spec!r} names {unknown}, not axes of {self.mesh}; use "
                      f"{self.mesh.axis_names}", node=pattern)
    self._rules[pattern] = spec

  def __getitem__(self, path):
    if path in self._rules:
      return self._rules[path]
    hits = [p for p in self._rules if re.fullmatch(p, path)]
    if len(hits) > 1:
      raise InputError(f"path {path!r} matches several layout keys {hits}; make each path match at most one")
    return self._rules[hits[0]] if hits else None

  def __delitem__(self, pattern):
    del self._rules[pattern]

  def __iter__(self):
    return iter(self._rules)

  def __len__(self):
    return len(self._rules)


class _Plan:
  """What the partitioned Keras functions need: mesh, batch axis, spec for a path (or None), and the layout map's
  keys (checked once per model against its variables and layer outputs: `_check_keys`)."""

  def __init__(self, mesh, batch_axis, spec_for, keys=()):
    self.mesh = mesh
    self.batch_axis = batch_axis
    self.spec_for = spec_for
    self.keys = keys
    self.checked = weakref.WeakSet()   # the models whose paths were checked against the keys


def _plan_of(source):
  if source is None:
    return None
  if isinstance(source, _Plan):
    return source
  if isinstance(source, LayoutMap):
    return _Plan(source.mesh, source.batch_axis, lambda path: source[path], keys=lambda: list(source))
  if isinstance(source, _compat.keras_distribution_class()):
    mesh = mesh_of(source.device_mesh)
    batch = source.batch_dim_name
    if batch is not None and batch not in mesh.axis_names:
      raise MeshError(f"{type(source).__name__}(batch_dim_name={batch!r}): the device mesh "
                      f"{dict(zip(mesh.axis_names, mesh.shape))} has no axis {batch!r} to split the batch over; give "
                      f"batch_dim_name one of {list(mesh.axis_names)}", node="batch_dim_name")

    def spec_for(path):
      try:
        layout = source.get_tensor_layout(path)   # ModelParallel: its layout map's entry; DataParallel: None
      except NotImplementedError:
        layout = None
      return P(*layout.axes) if layout is not None else None
    layout_map = getattr(source, "_layout_map", None)   # ModelParallel's (DataParallel has none)
    return _Plan(mesh, source.batch_dim_name, spec_for, keys=lambda: list(layout_map or ()))
  raise InputError(f"gs.keras.scope takes a Keras distribution or a gs.keras.LayoutMap; got {source!r}")


def _active_plan():
  _partition_generate()   # keras_hub may have been imported after this module
  plan = getattr(_local, "plan", None)
  if plan is not None:
    return plan
  dist = keras.distribution.distribution()
  if dist is None:
    return None
  cached = getattr(_local, "from_keras", None)
  if cached is None or cached[0] is not dist:
    _local.from_keras = (dist, _plan_of(dist))
  return _local.from_keras[1]


def _slot_layout(variable, plan):
  """(mesh, layout) of an optimizer slot being created for a reference variable stored sharded (Adam's moments,
  momentum...): its reference's -- on the plan's mesh, or outside a distribution wherever the reference is stored
  (gs.auto_parallel's stage submeshes) -- so the slot is created sharded (shard by shard when large) instead of
  whole until a step lays it out; None for any other variable."""
  reference = getattr(_local, "slot_reference", None)
  storage = _state.storage_of(reference) if reference is not None else None
  shape, _ = _compat.keras_variable_shape_dtype(variable)
  if (storage is None or storage.sharding.is_maximal or tuple(shape) != storage.shape
      or (plan is not None and storage.devices != tuple(plan.mesh.resolve_devices()))):
    return None
  return storage.sharding.mesh, storage.sharding


def _check_keys(plan, model):
  """Warns about the plan's layout map keys that match nothing in `model` (once per model)."""
  if model in plan.checked:
    return
  plan.checked.add(model)
  warn_unmatched_keys(plan.keys() if callable(plan.keys) else plan.keys, model)


def _distribute_variable(value, layout):
  """The backend's `distribute_variable` (see `_keras_layouts.distribute_variable`), over the active distribution's
  mesh where the layout has none."""
  plan = _active_plan()
  return distribute_variable(value, layout, plan.mesh if plan is not None else None)


@contextlib.contextmanager
def scope(distribution):
  """Within the block, Keras models train, evaluate and predict partitioned by `distribution`."""
  previous = getattr(_local, "plan", None)
  _local.plan = _plan_of(distribution)
  try:
    yield
  finally:
    _local.plan = previous


# gs.function options of the steps Keras builds under a distribution (`step_options`).
STEP_OPTIONS = ("exchange", "jit_compile", "collective_timeout", "strict")
_step_options = {}


def step_options(**options):
  """Sets the gs.function options (`exchange`, `jit_compile`, `collective_timeout`, `strict`) of the train, test
  and predict steps Keras builds under a distribution from now on (each batch signature's step is built on its first
  call); no arguments resets them to gs.function's defaults. Returns the options in force before."""
  unknown = sorted(set(options) - set(STEP_OPTIONS))
  if unknown:
    raise InputError(f"gs.keras.step_options takes {', '.join(STEP_OPTIONS)}; got {', '.join(unknown)}",
                     node=unknown[0])
  previous = dict(_step_options)
  _step_options.clear()
  _step_options.update(options)
  return previous


def _eager(value):
  if isinstance(value, ShardedTensor):
    return tf.constant(value.numpy())
  return value


class _Partitioned:
  """One of Keras's step functions (train, test, predict, a causal LM's generate) as gs.functions, one per batch
  signature."""

  def __init__(self, model, kind, plan):
    self.model = model
    self.kind = kind
    self.plan = plan
    self.step = {"train": model.train_step, "test": model.test_step, "predict": model.predict_step,
                 "generate": getattr(model, "generate_step", None)}[kind]
    self.functions = {}

  def _function(self, data, **options):
    leaves = tf.nest.flatten(data)
    # ShardedTensors (keras.distribution.distribute_tensor's eager results) go in as they are laid out
    flat = [t if isinstance(t, ShardedTensor) else tf.convert_to_tensor(t)
            for t in leaves if t is not None]   # e.g. no sample weights
    key = (tf.nest.map_structure(lambda t: t is None, data).__repr__(),
           tuple((tuple(t.shape.as_list()), t.dtype) for t in flat), repr(sorted(options.items())))
    if key not in self.functions:
      model, plan, structure = self.model, self.plan, data
      present = [t is not None for t in leaves]

      optimizer = getattr(model, "optimizer", None)
      variables = list(model.weights) + (list(optimizer.variables) if optimizer is not None else [])
      specs = [(v, plan.spec_for(v.path)) for v in variables]   # (the optimizer's too: a map may name its slots)
      devices = plan.mesh.resolve_devices()
      for v, spec in specs:
        # Stored as the layout map says (as under JAX), also when created before the distribution: the step then
        # keeps it so (a variable stored sharded is pinned) instead of storing what its update is computed in.
        if spec is not None and _compat.keras_inner_variable(v) is not None:
          shape = tuple(v.shape)
          _state.manage(v, to_sharding(spec, plan.mesh, rank=len(shape), what=v.path), devices, what=v.path)

      def step(*xs):
        for v, spec in specs:
          if spec is not None:
            shard(v, spec)
        it = iter(xs)
        return self.step(tf.nest.pack_sequence_as(structure, [next(it) if p else None for p in present]), **options)

      if self.kind != "generate":   # Keras's own step functions are not autograph-converted either
        step = tf.autograph.experimental.do_not_convert(step)

      batch = plan.batch_axis
      ins = tuple(P(batch) if t.shape.rank and batch else P() for t in flat)
      self.functions[key] = gs_function(step, mesh=plan.mesh, in_shardings=ins, **_step_options)
    return self.functions[key], flat

  def run(self, data, **options):
    f, flat = self._function(data, **options)
    return tf.nest.map_structure(_eager, f(*flat))

  def __call__(self, iterator_or_data, stop_token_ids=None):
    if self.kind == "generate":   # keras-hub's CausalLM: one batch of prompts, the sampling loop inside
      stop = None if stop_token_ids is None else tuple(int(t) for t in np.asarray(stop_token_ids).reshape(-1))
      return self.run(iterator_or_data, stop_token_ids=stop)
    if self.kind == "predict":   # Keras passes a list of steps_per_execution batches
      outs = [self.run(batch) for batch in iterator_or_data]
      if len(outs) == 1:
        return outs[0]
      return tf.nest.map_structure(lambda *ts: tf.concat(ts, 0), *outs)
    logs = None
    for _, data in zip(range(self.model.steps_per_execution), iterator_or_data):
      logs = self.run(data)
    if logs is None:
      raise StopIteration
    return logs


def lower_train_step(model, x, y=None, sample_weight=None):
  """The lowering of `model`'s compiled train step for one batch (x, y, sample_weight), under the distribution
  that is set: the plan `explore` and `lowered.report.save_html(path)` draw, in plan mode too."""
  if getattr(model, "optimizer", None) is None:
    raise InputError(f"{model.name} is not compiled: model.compile(optimizer, loss) first; its train step is what "
                     "gets drawn", node=model.name)
  fn = model.make_train_function()
  if not isinstance(fn, _Partitioned):
    raise InputError("no tf_gspmd distribution is set: keras.distribution.set_distribution(keras.distribution."
                     "ModelParallel(layout_map=...)) (or DataParallel) before drawing the train step",
                     node=model.name)
  data = (x,) + tuple(t for t in (y, sample_weight) if t is not None)
  f, flat = fn._function(data)  # pylint: disable=protected-access
  return f.lower(*flat)


def explore(model, x, y=None, sample_weight=None, **options):
  """Opens Model Explorer on `model`'s compiled train step for one batch (`gs.explore`'s options)."""
  return lower_train_step(model, x, y, sample_weight).explore(**options)


# Variables with a layout up to this size (bytes) are initialised exactly as Keras does without a distribution
# (the same seed gives the same weights) and then split; larger ones are created shard by shard from a
# mesh-independent equivalent of their initializer (values depend on the seed and the variable's path, not on
# the mesh), so that no device ever holds the whole value.
WHOLE_INIT_MAX_BYTES = 256 << 20


def _sharded_initializer(initializer, path):
  """The mesh-independent equivalent of a Keras initializer, seeded per variable; None if it has none."""
  if callable(initializer) and not isinstance(initializer, keras.initializers.Initializer):
    return None
  seed = int(keras.random.randint((), 0, 2 ** 31 - 1)) ^ zlib.crc32(path.encode())
  try:
    return initializers.from_keras(initializer, seed=seed & 0x7FFFFFFF)
  except InputError:
    return None


def _initialize_processes(job_addresses=None, num_processes=None, process_id=None):
  """The TF backend's `keras.distribution.initialize`: joins the processes of a multi-process run (gs.initialize).

  Keras passes its arguments (or the KERAS_DISTRIBUTION_JOB_ADDRESSES / _NUM_PROCESSES / _PROCESS_ID environment
  variables) through unchanged. TF's collective runtime needs the address of every process (JAX's needs only the
  coordinator's): `job_addresses` lists them all, in process order. Without a description, the cluster comes
  from TF_CONFIG (as `python -m tf_gspmd.launch` sets it), and without TF_CONFIG this is one process.
  """
  addresses = [a.strip() for a in str(job_addresses).split(",") if a.strip()] if job_addresses is not None else []
  got = f"job_addresses={job_addresses!r}, num_processes={num_processes!r}, process_id={process_id!r}"
  if num_processes is None and not addresses:
    resolver = None   # TF_CONFIG, or one process
  elif int(num_processes if num_processes is not None else len(addresses)) == 1:
    if process_id not in (None, 0):
      raise MeshError(f"keras.distribution.initialize({got}): a single process has process_id 0")
    return
  else:
    n = int(num_processes if num_processes is not None else len(addresses))
    if len(addresses) != n or process_id is None or not 0 <= int(process_id) < n:
      raise MeshError(f"keras.distribution.initialize({got}) describes {n} processes, but TensorFlow's collective "
                      f"runtime needs the host:port of every one of them in job_addresses (in process order) and "
                      f"this process's process_id in 0..{n - 1}; or set TF_CONFIG and call it without arguments")
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": addresses}), task_type="worker", task_id=int(process_id))
  _cluster.initialize(resolver)


def _list_devices(device_type=None):
  """Keras's `list_devices` over every process (full TF names, processes major), as `gs.Mesh` orders them."""
  kind = (device_type or ("gpu" if tf.config.list_logical_devices("GPU") else "cpu")).upper()
  names = sorted((d.name for d in tf.config.list_logical_devices(kind)), key=device_order)
  if not _cluster.is_multi_process():
    return [f"{kind.lower()}:{tf.DeviceSpec.from_string(n).device_index}" for n in names]
  return names


def _installed(cls):
  """Whether tf_gspmd's hooks are on `cls` itself (a flag in its own namespace: subclasses do not inherit it)."""
  return cls.__dict__.get("_gspmd_installed", False)


def _partition_generate():
  """Under a distribution, a keras-hub CausalLM's `generate()` runs its `generate_step` (prompt processing,
  the sampling loop and the KV cache) as a gs.function over the mesh, the cache laid out as completion derives
  it from the attention weights' layouts. Installed on CausalLM as soon as keras_hub is loaded, whichever of
  keras_hub and this module is imported first (`_KerasHubImportHook`); idempotent."""
  hub = _compat.keras_hub_causal_lm_class()
  if hub is None or _installed(hub):
    return
  original = hub.make_generate_function

  def make_generate_function(self):
    plan = _active_plan()
    if plan is None:
      return original(self)
    _check_keys(plan, self)
    current = getattr(self, "generate_function", None)
    if not (isinstance(current, _Partitioned) and current.plan is plan):
      self.generate_function = _Partitioned(self, "generate", plan)
    return self.generate_function

  hub.make_generate_function = make_generate_function
  hub._gspmd_installed = True  # pylint: disable=protected-access


class _KerasHubImportHook(importlib.abc.MetaPathFinder):
  """Installs the generate hook the moment the `keras_hub` package finishes loading, when that happens after this
  module's import (a finder that wraps the package loader's `exec_module`; it removes itself once used)."""

  def find_spec(self, fullname, path, target=None):
    if fullname != "keras_hub":
      return None
    for finder in sys.meta_path:
      if finder is self or not hasattr(finder, "find_spec"):
        continue
      spec = finder.find_spec(fullname, path, target)
      if spec is not None:
        break
    else:
      return None
    loader = spec.loader
    if loader is None or not hasattr(loader, "exec_module"):
      return spec
    exec_module = loader.exec_module

    def exec_and_install(module):
      exec_module(module)
      _remove_import_hook()
      _partition_generate()

    loader.exec_module = exec_and_install
    return spec


def _remove_import_hook():
  sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _KerasHubImportHook)]


def _install_generate_when_keras_hub_loads():
  if _compat.keras_hub_causal_lm_class() is not None:
    _partition_generate()
  elif not any(isinstance(f, _KerasHubImportHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _KerasHubImportHook())


def _install():
  """Puts tf_gspmd's hooks into Keras: the Model's step functions, keras-hub's generate, the backend distribution
  functions, variable creation, optimizer slots and asynchronous checkpoints (once: `keras.Model` keeps a flag)."""
  keras_weights.install()   # weight files: sharded variables written tile by tile, read slice by slice
  backend_dl = _compat.keras_backend_distribution_lib()
  cls = keras.Model   # on the TF backend, its make_*_function are the TF trainer's
  if _installed(cls):
    _install_generate_when_keras_hub_loads()
    return
  _install_make_functions(cls)
  _install_generate_when_keras_hub_loads()
  distribute_tensor, get_device_count = _backend_functions(backend_dl)
  _install_sharded_initializer()
  _install_slot_layouts()
  _install_async_checkpoint_copy()
  backend_dl.distribute_tensor = distribute_tensor
  backend_dl.distribute_variable = _distribute_variable
  _compat.set_keras_backend_converters(mesh_of, backend_layout)
  backend_dl.get_device_count = get_device_count
  backend_dl.initialize = _initialize_processes
  backend_dl.list_devices = _list_devices
  backend_dl.num_processes = _cluster.process_count
  backend_dl.process_id = _cluster.process_index
  cls._gspmd_installed = True


def _install_make_functions(cls):
  """`cls.make_{train,test,predict}_function` build a `_Partitioned` step under a distribution, Keras's otherwise."""
  originals = {k: getattr(cls, f"make_{k}_function") for k in ("train", "test", "predict")}

  def make(kind):
    def make_function(self, force=False):
      plan = _active_plan()
      if plan is None:
        return originals[kind](self, force=force)
      attr = f"{kind}_function"
      current = getattr(self, attr, None)
      if isinstance(current, _Partitioned) and current.plan is plan and not force:
        return current
      if kind == "train" and self.optimizer is not None and not self.optimizer.built:
        self.optimizer.build(self.trainable_variables)
      _check_keys(plan, self)
      setattr(self, attr, _Partitioned(self, kind, plan))
      return getattr(self, attr)
    return make_function

  for kind in originals:
    setattr(cls, f"make_{kind}_function", make(kind))


def _backend_functions(backend_dl):
  """tf_gspmd's `distribute_tensor` and `get_device_count` for Keras's backend distribution module `backend_dl`."""
  def distribute_tensor(tensor, layout):
    """`keras.distribution.distribute_tensor` (also Keras's hook for `"<layer path>/output"` layouts): inside a
    partitioned function an annotation; run eagerly, the value laid out as `layout` says (a gs.ShardedTensor,
    `gs.sharding_of` its layout) over the active distribution's mesh or, with none, the layout's own (as Keras's
    JAX backend lays it out; a layout without a mesh is Keras's ValueError); in a plain tf.function the tensor
    unchanged."""
    if tf.executing_eagerly():
      plan = _active_plan()
      return distribute_eagerly(tensor, layout, None if plan is None else plan.mesh)
    if current_mesh() is None:
      return tensor
    return shard(tensor, layout if isinstance(layout, Sharding) else P(*layout.axes))

  def get_device_count(device_type=None):
    return len(backend_dl.list_devices(device_type))

  return distribute_tensor, get_device_count


def _install_sharded_initializer():
  """Keras variables with a layout are created sharded (see `initialize_sharded`)."""
  initialize = _compat.keras_variable_initializer()

  def initialize_sharded(self, initializer):
    """A variable with a layout is created sharded. Up to WHOLE_INIT_MAX_BYTES it gets the value Keras gives it
    without a distribution (same seed, same weights), then is split; a larger one is created shard by shard when
    its initializer has a mesh-independent equivalent (no full value anywhere), else from its full value."""
    plan = _active_plan()
    spec = plan.spec_for(self.path) if plan is not None else None
    mesh = plan.mesh if plan is not None else None
    if spec is None:
      mesh, spec = _slot_layout(self, plan) or (mesh, None)
    if spec is None:
      return initialize(self, initializer)
    shape, dtype = _compat.keras_variable_shape_dtype(self)
    nbytes = math.prod(shape) * tf.as_dtype(dtype).size
    # (in plan_scope every value is shape-only: Keras's own initializer makes none)
    init = _sharded_initializer(initializer, self.path) if nbytes > WHOLE_INIT_MAX_BYTES and \
        not in_plan_scope() else None
    if init is not None:
      _compat.keras_set_inner_variable(self, _create.variable(init, shape, dtype, mesh=mesh, spec=spec,
                                                             name=self.name, trainable=self.trainable))
      return None
    initialize(self, initializer)
    _state.manage(_compat.keras_inner_variable(self), to_sharding(spec, mesh, rank=len(shape), what=self.path),
                  mesh.resolve_devices(), what=self.path)
    return None

  _compat.set_keras_variable_initializer(initialize_sharded)


def _install_slot_layouts():
  """An optimizer's `add_variable_from_reference` tells the initializer its reference (see `_slot_layout`)."""
  optimizer_cls = keras.optimizers.Optimizer
  add_slot = optimizer_cls.add_variable_from_reference

  def add_variable_from_reference(self, reference_variable, *args, **kwargs):
    """Keras's; the variable is created in its reference's layout when that is stored sharded (see _slot_layout)."""
    previous = getattr(_local, "slot_reference", None)
    _local.slot_reference = reference_variable
    try:
      return add_slot(self, reference_variable, *args, **kwargs)
    finally:
      _local.slot_reference = previous

  optimizer_cls.add_variable_from_reference = add_variable_from_reference


def _install_async_checkpoint_copy():
  """An asynchronous checkpoint copies a sharded Keras variable's tiles (see `copy_trackable_to_cpu`)."""
  variable_cls = _compat.keras_variable_class()
  copy_to_cpu = variable_cls._copy_trackable_to_cpu   # pylint: disable=protected-access

  def copy_trackable_to_cpu(self, object_map):
    """An asynchronous checkpoint's host copy (CheckpointOptions(experimental_enable_async_checkpoint=True)): of a
    variable stored sharded, this process's tiles, which the background writer saves as slices (Keras's own copy
    is a whole tf.Variable)."""
    inner = _compat.keras_inner_variable(self)
    if _state.storage_of(inner) is None:
      return copy_to_cpu(self, object_map)
    inner._copy_trackable_to_cpu(object_map)   # pylint: disable=protected-access
    object_map[self] = object_map[inner]
    return None

  variable_cls._copy_trackable_to_cpu = copy_trackable_to_cpu   # pylint: disable=protected-access


_install()
