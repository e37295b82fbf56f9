"""The private TensorFlow and Keras APIs tf_gspmd uses where no public API does the job, one adapter each.

Everything else under tf_gspmd/ uses public APIs only (`tf.*`, `tf.compat.v1.*`, `keras.*`); what has no public
route goes through one small adapter here, with the versions it was checked against. tests/platform/test_compat.py
checks every adapter against the installed TensorFlow and Keras (that the private API exists, with the
signature and behaviour used), so an upgrade that changes one fails there, by name, instead of inside a step.

Core layer: imports only tensorflow, keras (lazily: the core does not need Keras) and numpy.
"""

import functools
import sys
import threading

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla as _tf2xla
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2 as _coordination_config_pb2
from tensorflow.compiler.xla import xla_data_pb2 as _xla_data_pb2
from tensorflow.core.framework import cpp_shape_inference_pb2 as _cpp_shape_inference_pb2
from tensorflow.python.compiler.xla.experimental import xla_sharding as _xla_sharding
from tensorflow.python.distribute.parallel_device import parallel_device as _parallel_device
from tensorflow.python.eager import context as _context
from tensorflow.python.checkpoint import async_checkpoint_helper as _async_checkpoint_helper
from tensorflow.python.checkpoint import functional_saver as _functional_saver
from tensorflow.python.checkpoint import restore as _checkpoint_restore
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import function_def_to_graph as _function_def_to_graph
from tensorflow.python.framework import graph_to_function_def as _graph_to_function_def
from tensorflow.python.framework import op_def_registry as _op_def_registry
from tensorflow.python.grappler import cluster as _grappler_cluster
from tensorflow.python.grappler import tf_optimizer as _tf_optimizer
from tensorflow.python.ops import handle_data_util as _handle_data_util
from tensorflow.python.ops import resource_variable_ops as _resource_variable_ops
from tensorflow.python.trackable import base as _trackable
from tensorflow.python.training.saving import saveable_object as _saveable_object

CHECKED_TF = "2.21"
CHECKED_KERAS = "3.15"


# ---- ParallelDevice (TF 2.21) ------------------------------------------------------------------------------------
# DTensor's runtime: one function per component device, each on its own thread, which TF's collectives need
# (several logical devices running collectives inside one tf.function deadlock). No public equivalent.

def parallel_device(devices):
  """A ParallelDevice over `devices` (raises tf.errors.AlreadyExistsError if its custom-device name is taken)."""
  return _parallel_device.ParallelDevice(list(devices))


def parallel_device_name(pd):
  """The custom-device name to place ops on `pd` with (`with tf.device(name)`)."""
  return pd._name  # pylint: disable=protected-access


# ---- Aborting collectives (TF 2.21) ------------------------------------------------------------------------------
# The only way to unblock collectives that wait for a peer that never comes (a deadline over a whole program).

def abort_collectives(code, message):
  """Aborts every pending collective of the process with error `code` (e.g. tf.errors.DEADLINE_EXCEEDED)."""
  _context.context().abort_collective_ops(code, message)


# ---- Several processes: TF's collective runtime over a cluster (TF 2.21) ------------------------------------------
# What MultiWorkerMirroredStrategy does to let collectives span processes: collective leader and device filters,
# the coordination service, then the eager context enabled for collectives with the cluster's ServerDef. No public
# API does this without also building a tf.distribute strategy.

def enable_cluster_collectives(cluster_spec, job_name, task_index, leader, heartbeat_timeout_s, register_timeout_s):
  """Starts this process's gRPC server and lets collectives span every task of `cluster_spec` (before TF runs);
  the coordination service gives up when not every task has registered within `register_timeout_s`."""
  ctx = _context.context()
  ctx.configure_collective_ops(collective_leader=leader, device_filters=(f"/job:{job_name}/task:{task_index}",))
  jobs = [_coordination_config_pb2.CoordinatedJob(name=j, num_tasks=cluster_spec.num_tasks(j))
          for j in cluster_spec.jobs]
  ctx.configure_coordination_service(service_type="standalone", service_leader=leader, coordinated_jobs=jobs,
                                     heartbeat_timeout_in_ms=int(heartbeat_timeout_s * 1000),
                                     cluster_register_timeout_in_ms=int(register_timeout_s * 1000))
  # Registration as a barrier: every task's Connect fails when a task has not connected within the timeout (not
  # only the leader's service), so a missing peer is an error instead of a wait in WaitForAllTasks.
  ctx._coordination_service_config.cluster_register_with_barrier = True  # pylint: disable=protected-access
  config = tf.compat.v1.ConfigProto()
  config.CopyFrom(ctx.config)
  server_def = tf.compat.v1.train.ServerDef(cluster=cluster_spec.as_cluster_def(), job_name=job_name,
                                            task_index=task_index, protocol="grpc", default_session_config=config)
  ctx.enable_collective_ops(server_def)
  ctx.ensure_initialized()


def coordination_barrier(name, timeout_s):
  """Waits until every task of the cluster reaches barrier `name` (the coordination service's)."""
  _context.context().wait_at_barrier(name, int(timeout_s * 1000))


# ---- Flat calls of a concrete function (TF 2.21) -----------------------------------------------------------------
# `fn(*args)` binds the arguments to a structured signature, which for hundreds of arguments costs more than a
# training step; `_call_flat` takes the flat tensors as they are.

def call_flat(fn, args):
  """Calls ConcreteFunction `fn` with flat tensor arguments `args` (its captured inputs appended)."""
  return fn._call_flat(list(args), fn.captured_inputs)  # pylint: disable=protected-access


# ---- The configuration a function call carries (TF 2.21) ---------------------------------------------------------
# An eager call passes the context's ConfigProto (its Grappler options) to the runtime, which instantiates the
# function once per distinct configuration: a call under other options instantiates (and optimizes) it again.

def call_options_without_graph_optimizer():
  """Function-call options that carry the context's configuration with TF's graph optimizer turned off."""
  config = tf.compat.v1.ConfigProto.FromString(_context.context().function_call_options.config_proto_serialized)
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  return _context.FunctionCallOptions(config_proto=config)


class calls_with:  # pylint: disable=invalid-name
  """Context manager: eager function calls of this thread carry `options` (from `call_options_...`)."""

  __slots__ = ("_options", "_before")

  def __init__(self, options):
    self._options = options

  def __enter__(self):
    ctx = _context.context()
    self._before = ctx._thread_local_data.function_call_options  # pylint: disable=protected-access
    ctx.function_call_options = self._options

  def __exit__(self, *exc):
    _context.context().function_call_options = self._before


# ---- Setting an attribute of a graph op (TF 2.21) ----------------------------------------------------------------
# Annotations are attributes of an existing Identity op (as TF's own xla_sharding writes them).

def set_op_attr(op, name, attr_value):
  """Sets attribute `name` of graph op `op` to `attr_value` (a tf.compat.v1.AttrValue)."""
  op._set_attr(name, attr_value)  # pylint: disable=protected-access


# ---- Identity with its own gradient on the tape (TF 2.21) --------------------------------------------------------
# The public route, tf.custom_gradient, in a graph routes the value through an IdentityN (the value and the
# function's inputs) and leaves a dead Identity behind (`_get_dependent_variables`), per annotation and per
# annotated gradient: extra nodes in every traced step, and today's IdentityN rule (ops/basic.py through
# FactorRule) does not let its two copies share mesh axes, so the second copy is all-gathered. Recording the
# Identity's gradient on the tape keeps one Identity per annotation.

def identity_with_gradient(t, name, backward):
  """tf.identity(t, name=name) whose gradient, on a GradientTape, is `backward(dy)` instead of `dy`."""
  with _record.stop_recording():
    out = tf.identity(t, name=name)
  _record.record_operation("Identity", [out], [t], lambda dy: [backward(dy)])
  return out


# ---- XLA sharding protos (TF 2.21) -------------------------------------------------------------------------------
# OpSharding is the format of the `_XlaSharding` attribute; TF exports neither the proto nor xla_sharding publicly.

def xla_data_pb2():
  """TF's copy of XLA's xla_data_pb2 module (OpSharding)."""
  return _xla_data_pb2


def xla_mesh_split_sharding(device_mesh, dims_mapping):
  """The OpSharding proto TF's `xla_sharding.mesh_split` writes for `device_mesh` (device ids) and `dims_mapping`."""
  return _xla_sharding.mesh_split_sharding(device_mesh, dims_mapping).proto


def xla_sharding_op(t, sharding, unspecified_dims, name=None):
  """TF's XlaSharding op on `t`, as `xla_sharding.mesh_split(..., use_sharding_op=True, unspecified_dims=...)`
  builds it (the serialized OpSharding `sharding` as its `sharding` and `_XlaSharding` attributes): the one
  encoding TF has for an annotation that leaves dims open. TF registers its gradient (the same annotation on the
  gradient). No public API builds the op."""
  out = _tf2xla.sharding(t, sharding=sharding, unspecified_dims=list(unspecified_dims), name=name)
  out.op._set_attr("_XlaSharding", tf.compat.v1.AttrValue(s=sharding))  # pylint: disable=protected-access
  return out


# ---- Resource variables (TF 2.21) --------------------------------------------------------------------------------
# Sharded storage keeps the user's tf.Variable object and hooks its reads; a variable is created without a value
# when its shards are initialised one by one.

BaseResourceVariable = _resource_variable_ops.BaseResourceVariable


def is_resource_variable(v):
  return isinstance(v, _resource_variable_ops.BaseResourceVariable)


def read_unhooked(v):
  """The value of resource variable `v`, read past any subclass's read hook."""
  return _resource_variable_ops.BaseResourceVariable._read_variable_op(v)  # pylint: disable=protected-access


def assign_unhooked(v, value):
  """Assigns `value` to resource variable `v` past any subclass's assign override."""
  _resource_variable_ops.BaseResourceVariable.assign(v, value, read_value=False)


def uninitialized_variable(shape, dtype, name=None, trainable=True):
  """A resource variable of `shape` and `dtype` with no value (nothing allocated until it is assigned)."""
  return _resource_variable_ops.UninitializedVariable(shape=shape, dtype=dtype, name=name, trainable=trainable)


class ReadHook:
  """Mixin for a BaseResourceVariable subclass: `self._gspmd_before_read()` runs before every read of its value
  (`numpy()`, `value()`, `read_value()`, `tf.convert_to_tensor`, reads traced into a function); the ops it
  returns (in a graph being traced) run before the read."""

  def _gspmd_before_read(self):
    raise NotImplementedError

  def _read_variable_op(self, no_copy=False):
    with tf.control_dependencies(self._gspmd_before_read() or []):
      return super()._read_variable_op(no_copy=no_copy)

  def read_value_no_copy(self):
    with tf.control_dependencies(self._gspmd_before_read() or []):
      return super().read_value_no_copy()


# ---- Checkpoint saveables (TF 2.21) ------------------------------------------------------------------------------
# A variable saved as several slices of one global tensor, each from its device (SaveV2 slice specs). TF's public
# `_serialize_to_tensors` route hands a trackable only the first slice of a multi-slice key on restore.

SaveableObject = _saveable_object.SaveableObject
Trackable = _trackable.Trackable
SaveSpec = _saveable_object.SaveSpec
VARIABLE_VALUE_KEY = _trackable.VARIABLE_VALUE_KEY


class CheckpointHook:
  """Mixin for a trackable variable: saved as the SaveableObject `self._gspmd_saveable(name)` returns; a whole
  restored value that reaches it through a wrapper (a Keras variable) goes to `self._gspmd_restore(tensor)`."""

  def _gspmd_saveable(self, name):
    raise NotImplementedError

  def _gspmd_restore(self, tensor):
    raise NotImplementedError

  def _gather_saveables_for_checkpoint(self):
    return {VARIABLE_VALUE_KEY: self._gspmd_saveable}

  def _restore_from_tensors(self, restored_tensors):
    self._gspmd_restore(restored_tensors[VARIABLE_VALUE_KEY])
    return None


class SerializeHook:
  """Mixin after `CheckpointHook`: what a wrapper that saves through `_serialize_to_tensors()` of its variable (a
  Keras variable) gets is `self._gspmd_serialize()` ({VARIABLE_VALUE_KEY: tensor or {slice spec: tensor}}). TF
  itself keeps saving the variable through `CheckpointHook` (its MRO walk meets `_gather_saveables_for_checkpoint`
  first)."""

  def _gspmd_serialize(self):
    raise NotImplementedError

  def _serialize_to_tensors(self):
    return self._gspmd_serialize()


def install_checkpoint_save_hook(hook):
  """Every checkpoint save of the process (tf.train.Checkpoint, CheckpointManager, Keras) runs
  `hook(saver, save, file_prefix, options)` instead of TF's `save(saver, file_prefix, options)`; `saver` is the
  object whose `checkpoint_saver_tensors(saver)` lists what it writes. Installed once; TF 2.21's one place where
  a process writes its checkpoint files and merges them (`MultiDeviceSaver.save`)."""
  cls = _functional_saver.MultiDeviceSaver
  if getattr(cls.save, "_gspmd_hook", None) is hook:
    return
  original = getattr(cls.save, "_gspmd_original", cls.save)

  def save(self, file_prefix, options=None):
    return hook(self, original, file_prefix, options)
  save._gspmd_hook = hook   # pylint: disable=protected-access
  save._gspmd_original = original   # pylint: disable=protected-access
  cls.save = save


def install_async_checkpoint_copy_key(key_fn):
  """Asynchronous checkpoints (CheckpointOptions(enable_async=True)) retrace their copy to the host whenever
  `key_fn(trackables)` changes. TF 2.21's AsyncCheckpointHelper traces `_copy_to_cpu` (each trackable's
  `_copy_trackable_to_cpu`) once and reruns that trace for every save: a variable whose storage changed since
  (tf_gspmd's, stored sharded after a first save) would be copied from where it was, a stale value. Installed
  once."""
  cls = _async_checkpoint_helper.AsyncCheckpointHelper
  if getattr(cls._copy_to_cpu, "_gspmd_key", None) is key_fn:  # pylint: disable=protected-access
    return
  python_fn = getattr(cls._copy_to_cpu, "_gspmd_python_fn", None) or \
      cls._copy_to_cpu.python_function  # pylint: disable=protected-access

  def copy_to_cpu(self):
    key = key_fn(self._saveable_trackables)  # pylint: disable=protected-access
    traced = self.__dict__.get("_gspmd_copy")
    if traced is None or traced[0] != key:
      traced = self.__dict__["_gspmd_copy"] = (key, tf.function(functools.partial(python_fn, self)))
    return traced[1]()
  copy_to_cpu._gspmd_key = key_fn   # pylint: disable=protected-access
  copy_to_cpu._gspmd_python_fn = python_fn   # pylint: disable=protected-access
  cls._copy_to_cpu = copy_to_cpu


def checkpoint_saver_tensors(saver):
  """What a checkpoint saver writes: (checkpoint key, slice spec, the object that provided it, a zero-argument
  function returning the tensor) for each value, in order. The object is the trackable itself (a variable saved
  through SaveableObjects is unwrapped from TF's compatibility converter)."""
  out = []
  for shard in saver._shardable_tensors_by_task.values():  # pylint: disable=protected-access
    for t in shard:
      obj = t.trackable
      obj = getattr(obj, "obj", obj) if type(obj).__name__ == "SaveableCompatibilityConverter" else obj
      spec = t._tensor_save_spec  # pylint: disable=protected-access
      out.append((t.checkpoint_key, t.slice_spec, obj, (lambda s=spec: s.tensor)))
  return out


def config_key_value_set(key, value):
  """Stores `value` under `key` in the cluster's coordination service (visible to every process)."""
  _context.context().set_config_key_value(key, value)


def define_functions(function_defs):
  """Defines FunctionDefs `function_defs` in the eager context (each one not defined there now): a graph imported
  into a tf.function refers to its library's functions by name, and XLA's compiler IR looks them up there."""
  ctx = _context.context()
  for fdef in function_defs:
    if not ctx.has_function(fdef.signature.name):
      ctx.add_function_def(fdef)


def config_key_value_get(key, timeout_s):
  """The value stored under `key` by some process (waits for it up to `timeout_s`; DeadlineExceededError then).
  A waiting lookup is not ended when the process that should store the value dies: poll with short timeouts and
  `check_peer` in between."""
  return _context.context().get_config_key_value(key, int(timeout_s * 1000))


def check_peer(task, timeout_s):
  """Raises (UnavailableError, ...) when task `task` ("/job:worker/replica:0/task:1") does not answer within
  `timeout_s` seconds."""
  _context.context().check_collective_ops_peer_health(task, int(timeout_s * 1000))


def checkpoint_restore_target():
  """While an eager `tf.train.Checkpoint` restore gathers what to read for one object: (checkpoint prefix, the
  object being restored, {attribute name: checkpoint key}); None otherwise (saving, graph mode, no restore).

  TF 2.21 reads every value of a process with one RestoreV2 before any object sees them; knowing the prefix lets
  an object read its values itself, one slice at a time. Found on the call stack: the frame of
  `CheckpointPosition.gather_ops_or_named_saveables`, whose `self` is the position being restored."""
  if not tf.executing_eagerly():
    return None
  code = _checkpoint_restore.CheckpointPosition.gather_ops_or_named_saveables.__code__
  f = sys._getframe(1)  # pylint: disable=protected-access
  while f is not None:
    if f.f_code is code:
      position = f.f_locals.get("self")
      path = getattr(position._checkpoint, "save_path_string", None)  # pylint: disable=protected-access
      if not isinstance(path, str):
        return None
      keys = {a.name: a.checkpoint_key for a in position.object_proto.attributes}
      return path, position.trackable, keys
    f = f.f_back
  return None


# ---- Keras variables (Keras 3.15, TensorFlow backend) ------------------------------------------------------------
# A Keras variable keeps its tf.Variable in `_value`; it is created by `_initialize_with_initializer`, which
# tf_gspmd replaces to create variables with a layout shard by shard.

def keras_inner_variable(v):
  """The tf.Variable behind Keras variable `v` (None for anything else)."""
  return getattr(v, "_value", None)


def keras_set_inner_variable(v, variable):
  """Makes tf.Variable `variable` the storage of Keras variable `v`."""
  v._value = variable  # pylint: disable=protected-access


def keras_variable_shape_dtype(v):
  """(shape, dtype) Keras variable `v` is stored in (its public `dtype` is the autocast dtype in an autocast scope)."""
  return v._shape, v._dtype  # pylint: disable=protected-access


def _keras_tf_variable_class():
  from keras.src.backend.tensorflow import core  # pylint: disable=g-import-not-at-top
  return core.Variable


def keras_variable_initializer():
  """The TF backend Variable's `_initialize_with_initializer(self, initializer)` (as installed now)."""
  return _keras_tf_variable_class()._initialize_with_initializer  # pylint: disable=protected-access


def set_keras_variable_initializer(fn):
  """Installs `fn(self, initializer)` as the TF backend Variable's `_initialize_with_initializer`."""
  _keras_tf_variable_class()._initialize_with_initializer = fn  # pylint: disable=protected-access


# ---- Keras distribution (Keras 3.15, TensorFlow backend) ---------------------------------------------------------
# `keras.distribution` exports DataParallel and ModelParallel but not their base class; the TF backend's
# distribution_lib is the module whose functions Keras's distribution API calls (a stub that tf_gspmd fills in).

def keras_hub_causal_lm_class():
  """keras-hub's CausalLM base class (its `make_generate_function` builds the `generate()` step), or None while
  keras_hub is not loaded (it is never imported from here)."""
  if "keras_hub" not in sys.modules:
    return None
  return sys.modules["keras_hub"].models.CausalLM


def keras_distribution_class():
  """The base class of Keras distributions (`keras.distribution.DataParallel`, `ModelParallel`, ...)."""
  from keras.src.distribution import distribution_lib  # pylint: disable=g-import-not-at-top
  return distribution_lib.Distribution


def keras_backend_distribution_lib():
  """The TF backend's distribution_lib module (`distribute_tensor`, `initialize`, `num_processes`, ...)."""
  from keras.src.backend.tensorflow import distribution_lib  # pylint: disable=g-import-not-at-top
  return distribution_lib


def keras_symbolic_build(model, data_batch):
  """Builds a compiled Keras model, its compile metrics, loss and optimizer from one batch's shapes, as `fit` does
  before its first step (the trainer's `_symbolic_build`)."""
  model._symbolic_build(data_batch=data_batch)  # pylint: disable=protected-access


def keras_nested_layers(model):
  """Every layer inside a Keras model or layer, nested ones included (Keras's `_flatten_layers`)."""
  return list(model._flatten_layers(include_self=False))  # pylint: disable=protected-access


def keras_tensor_layout(axes, device_mesh):
  """A Keras TensorLayout whose entries may be tuples of mesh axes (one dim split over several), which JAX's
  PartitionSpec and tf_gspmd's P take but TensorLayout's own check refuses (it accepts one axis name per dim)."""
  from keras.src.distribution import distribution_lib  # pylint: disable=g-import-not-at-top
  layout = distribution_lib.TensorLayout(tuple(None for _ in axes))
  layout._axes = tuple(axes)  # pylint: disable=protected-access
  layout._device_mesh = device_mesh  # pylint: disable=protected-access
  return layout


def set_keras_backend_converters(to_mesh, to_layout):
  """Installs what `DeviceMesh.backend_mesh` and `TensorLayout.backend_layout` call on the TF backend (Keras's
  private `_to_backend_mesh` / `_to_backend_layout` of its distribution_lib)."""
  backend_dl = keras_backend_distribution_lib()
  backend_dl._to_backend_mesh = to_mesh  # pylint: disable=protected-access
  backend_dl._to_backend_layout = to_layout  # pylint: disable=protected-access


# ---- Keras weight files (Keras 3.15) -----------------------------------------------------------------------------
# `save_weights` / `load_weights` (and keras-hub presets) go through saving_lib's H5IOStore and ShardedH5IOStore:
# `store[key] = variable` writes one variable, `store[key]` reads one into memory. Neither class is public; the
# entry group a store reads and writes is private state of theirs.

def keras_weight_store_classes():
  """(H5IOStore, ShardedH5IOStore) of Keras's saving_lib."""
  from keras.src.saving import saving_lib  # pylint: disable=g-import-not-at-top
  return saving_lib.H5IOStore, saving_lib.ShardedH5IOStore


def keras_variable_class():
  """The TF backend's Keras Variable class (its `assign` is the common KerasVariable's)."""
  return _keras_tf_variable_class()


def keras_in_stateless_scope():
  """Whether Keras is in a StatelessScope (where `assign` records an update instead of writing)."""
  from keras.src.backend.common import stateless_scope  # pylint: disable=g-import-not-at-top
  return stateless_scope.in_stateless_scope()


def keras_store_entry_group(store, create=False):
  """The h5py group of the entry `store` (an H5IOStore) is at: made as Keras's `__setitem__` makes it when
  `create`; in read mode the group `get()` found ({} when none)."""
  if create and not store._h5_entry_initialized:  # pylint: disable=protected-access
    store._create_h5_group(store._h5_entry_path)  # pylint: disable=protected-access
  return store._h5_entry_group  # pylint: disable=protected-access


def keras_store_dataset(store, key):
  """The h5py dataset `key` of the entry `store` is at, through Keras's own checks (no links, no external or
  virtual datasets, no shape bombs)."""
  from keras.src.saving import saving_lib  # pylint: disable=g-import-not-at-top
  return saving_lib.safe_get_h5_dataset(store._h5_entry_group, key)  # pylint: disable=protected-access


def keras_sharded_store_add(store, key, nbytes):
  """ShardedH5IOStore's bookkeeping before writing `key` of `nbytes` bytes: the current shard file is made the
  newest, and a new one started when this value would overflow it (Keras's ValueError for a value larger than a
  shard). Returns a function that records the written key in the store's weight map."""
  store._restore_h5_file()  # pylint: disable=protected-access
  store.total_shard_size += nbytes
  if nbytes > store.max_shard_size:
    raise ValueError(f"The size of {key} is {nbytes} bytes, which exceeds the maximum shard size "
                     f"{int(store.max_shard_size)} bytes. You can increase the `max_shard_size` parameter to "
                     f"accommodate the size.")
  store.current_shard_size += nbytes
  if store.current_shard_size > store.max_shard_size:
    store.close()
    store.h5_file = store._create_new_shard_file()  # pylint: disable=protected-access
    store.current_shard_size = nbytes

  def record():
    path = store._h5_entry_group.name  # pylint: disable=protected-access
    shard = store.current_shard_path.name
    weight_map = store.sharding_config["weight_map"]
    if path not in weight_map:
      weight_map[path] = shard
    else:
      if not isinstance(weight_map[path], list):
        weight_map[path] = [weight_map[path]]
      if shard not in weight_map[path]:
        weight_map[path].append(shard)
  return record


# ---- Graphs and functions as data (TF 2.21) ---------------------------------------------------------------------
# TF has no public way to turn a FunctionDef into a GraphDef or a graph into a FunctionDef (tf.function builds
# them only from Python code), nor to read an op type's OpDef.


def function_def_to_graph_def(fdef, input_shapes):
  """(GraphDef of `fdef` with parameters shaped `input_shapes`, {FunctionDef tensor name: graph tensor name})."""
  return _function_def_to_graph.function_def_to_graph_def(fdef, input_shapes=input_shapes)


def function_def_to_graph(fdef, input_shapes):
  """`fdef` imported as a FuncGraph (in the current default graph's scope) with parameters shaped `input_shapes`."""
  return _function_def_to_graph.function_def_to_graph(fdef, input_shapes=input_shapes)


def eager_mode():
  """A context in which ops run eagerly, even while a graph is being built."""
  return _context.eager_mode()


def graph_to_function_def(graph, operations, inputs, outputs, out_names=None):
  """A FunctionDef computing `outputs` from the placeholders `inputs` with `operations` of `graph`."""
  return _graph_to_function_def.graph_to_function_def(graph, operations, inputs, outputs, out_names=out_names)


def op_def(op_type):
  """The registered OpDef of `op_type`, or None for an op type this TF does not know."""
  return _op_def_registry.get(op_type)


def set_resource_shape(handle, shape, dtype):
  """Tell shape inference that the variable behind the resource tensor `handle` holds `dtype[shape]`.

  (What a captured variable's placeholder carries in a tf.function; no public setter.)
  """
  data = _cpp_shape_inference_pb2.CppShapeInferenceResult.HandleData(
      is_set=True, shape_and_type=[_cpp_shape_inference_pb2.CppShapeInferenceResult.HandleShapeAndType(
          shape=shape.as_proto(), dtype=dtype.as_datatype_enum)])
  _handle_data_util.set_handle_data(handle, data)


# ---- Grappler from Python (TF 2.21) ------------------------------------------------------------------------------
# tf.function runs Grappler only when it executes a graph; running it on a GraphDef we hold, and getting the
# optimized GraphDef back, is only possible through these modules.


_CLUSTER = []
_LOCK = threading.Lock()


def grappler_cluster():
  """The process's one Grappler cluster (TF provisions one at a time; a new one per call would also start a
  thread pool each time)."""
  with _LOCK:
    if not _CLUSTER:
      _CLUSTER.append(_grappler_cluster.Cluster())
    return _CLUSTER[0]


def optimize_graph(config, metagraph, cluster):
  """Grappler's meta-optimizer on `metagraph` (a MetaGraphDef) with `config` (a ConfigProto): a GraphDef."""
  return _tf_optimizer.OptimizeGraph(config, metagraph, verbose=False, cluster=cluster)
