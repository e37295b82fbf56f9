"""The private TF/Keras APIs behind tf_gspmd._platform.compat: each adapter against the installed TensorFlow and Keras.

One test per adapter; a failure here names the private API that changed (see the section of _compat.py for
what it is used for and the versions it was checked against).
"""

import inspect
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
from tf_gspmd._platform import compat as _compat


def _params(fn):
  return list(inspect.signature(fn).parameters)


def _cpus(n):
  return [d.name for d in tf.config.list_logical_devices("CPU")[:n]]


# ---- ParallelDevice ----------------------------------------------------------------------------------------------

def test_parallel_device_runs_one_component_per_device():
  devices = _cpus(2)
  pd = _compat.parallel_device(devices)
  name = _compat.parallel_device_name(pd)
  assert isinstance(name, str) and name
  comps = []
  for k, d in enumerate(devices):
    with tf.device(d):
      comps.append(tf.identity(tf.constant([float(k)])))
  packed = pd.pack(comps)
  with tf.device(name):
    doubled = packed * 2.0
  out = pd.unpack(doubled)
  assert [float(t.numpy()[0]) for t in out] == [0.0, 2.0]
  where = [(s.device_type, s.device_index) for s in map(tf.DeviceSpec.from_string, [t.device for t in out])]
  assert where == [(s.device_type, s.device_index) for s in map(tf.DeviceSpec.from_string, devices)]


# ---- Aborting collectives ----------------------------------------------------------------------------------------

def test_abort_collectives_unblocks_a_waiting_collective():
  """In a subprocess: an abort poisons the process's collective executor."""
  script = textwrap.dedent("""
      import threading, time
      import tensorflow as tf
      cpu = tf.config.list_physical_devices("CPU")[0]
      tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
      from tf_gspmd._platform import compat as _compat
      threading.Timer(1.0, _compat.abort_collectives, (tf.errors.DEADLINE_EXCEEDED, "aborted by test")).start()
      try:
        with tf.device("/device:CPU:0"):   # a group of 2 whose second member never comes
          tf.raw_ops.CollectiveReduceV2(input=tf.ones([2]), group_size=2, group_key=1, instance_key=1,
                                        ordering_token=[], merge_op="Add", final_op="Id")
      except tf.errors.DeadlineExceededError as e:
        print("ABORTED", "aborted by test" in str(e))
      """)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
  assert "ABORTED True" in out.stdout, out.stdout + out.stderr[-3000:]


# ---- Flat calls of a concrete function ---------------------------------------------------------------------------

def test_call_flat_passes_flat_tensors_and_captures():
  v = tf.Variable(10.0)
  fn = tf.function(lambda a, b: (a + b + v, a * b)).get_concrete_function(tf.TensorSpec([]), tf.TensorSpec([]))
  assert fn.captured_inputs   # the variable's handle
  out = _compat.call_flat(fn, [tf.constant(2.0), tf.constant(3.0)])
  assert [float(t) for t in out] == [15.0, 6.0]


# ---- The configuration a function call carries -------------------------------------------------------------------

def test_calls_with_sets_this_threads_call_configuration_and_restores_it():
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  before = context.context().function_call_options.config_proto_serialized
  options = _compat.call_options_without_graph_optimizer()
  config = tf.compat.v1.ConfigProto.FromString(options.config_proto_serialized)
  assert config.graph_options.rewrite_options.disable_meta_optimizer
  assert not tf.compat.v1.ConfigProto.FromString(before).graph_options.rewrite_options.disable_meta_optimizer
  fn = tf.function(lambda a: (a * 2.0, a + 1.0)).get_concrete_function(tf.TensorSpec([]))
  with _compat.calls_with(options):
    assert context.context().function_call_options is options
    assert [float(t) for t in _compat.call_flat(fn, [tf.constant(3.0)])] == [6.0, 4.0]
  assert context.context().function_call_options.config_proto_serialized == before


# ---- Setting an attribute of a graph op --------------------------------------------------------------------------

def test_set_op_attr_is_written_into_the_graph_def():
  g = tf.Graph()
  with g.as_default():
    y = tf.identity(tf.constant(1.0), name="y")
    _compat.set_op_attr(y.op, "_XlaSharding", tf.compat.v1.AttrValue(s=b"abc"))
  assert y.op.get_attr("_XlaSharding") == b"abc"
  node = next(n for n in g.as_graph_def().node if n.name == "y")
  assert node.attr["_XlaSharding"].s == b"abc"


# ---- Identity with its own gradient on the tape ------------------------------------------------------------------

def test_identity_with_gradient_uses_backward_on_the_tape_and_adds_one_identity():
  @tf.function
  def f(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = _compat.identity_with_gradient(x * 2.0, "marked", lambda dy: dy * 3.0)
      z = tf.reduce_sum(y)
    return y, tape.gradient(z, x)

  x = tf.constant([1.0, 2.0])
  y, dx = f(x)
  assert_close(y, [2.0, 4.0])
  assert_close(dx, [6.0, 6.0])   # 2 (x * 2) times 3 (backward)
  graph = f.get_concrete_function(x).graph
  assert graph.get_operation_by_name("marked").type == "Identity"
  assert "IdentityN" not in {op.type for op in graph.get_operations()}


# ---- XLA sharding protos -----------------------------------------------------------------------------------------

def test_xla_data_pb2_has_op_sharding():
  pb = _compat.xla_data_pb2()
  s = pb.OpSharding(type=pb.OpSharding.OTHER, tile_assignment_dimensions=[2, 1], tile_assignment_devices=[1, 0])
  s.replicate_on_last_tile_dim = False
  s.last_tile_dims.append(pb.OpSharding.REPLICATED)
  assert pb.OpSharding.FromString(s.SerializeToString()) == s


def test_xla_mesh_split_sharding_writes_tile_assignment():
  proto = _compat.xla_mesh_split_sharding(np.array([[1, 0], [3, 2]]), [0, -1])
  pb = _compat.xla_data_pb2()
  assert isinstance(proto, pb.OpSharding) and proto.type == pb.OpSharding.OTHER
  assert list(proto.tile_assignment_dimensions) == [2, 1, 2] and proto.replicate_on_last_tile_dim
  assert list(proto.tile_assignment_devices) == [1, 0, 3, 2]


def test_xla_sharding_op_matches_tf_mesh_split_with_unspecified_dims():
  from tensorflow.python.compiler.xla.experimental import xla_sharding  # pylint: disable=g-import-not-at-top
  proto = _compat.xla_mesh_split_sharding(np.arange(8).reshape(2, 4), [0, -1]).SerializeToString()

  def annotated(build):
    @tf.function
    def f(x):
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = build(x * 1.0)
        loss = tf.reduce_sum(y * y)
      return y, tape.gradient(loss, x)

    graph = f.get_concrete_function(tf.TensorSpec([8, 8])).graph
    ops = [op for op in graph.get_operations() if op.type == "XlaSharding"]
    return [(op.get_attr("sharding"), list(op.get_attr("unspecified_dims")), op.get_attr("_XlaSharding"))
            for op in ops], f

  ours, f = annotated(lambda x: _compat.xla_sharding_op(x, proto, [1], name="h"))
  theirs, _ = annotated(lambda x: xla_sharding.mesh_split(x, np.arange(8).reshape(2, 4), [0, -1],
                                                          use_sharding_op=True, unspecified_dims=[1]))
  assert ours == theirs and len(ours) == 2 and ours[0] == (proto, [1], proto)   # the gradient is annotated too
  x = np.arange(64, dtype=np.float32).reshape(8, 8)
  y, g = f(x)
  assert_close(y, x)
  assert_close(g, 2 * x)


# ---- Resource variables ------------------------------------------------------------------------------------------

def test_resource_variable_reads_writes_and_uninitialized_creation():
  v = tf.Variable([1.0, 2.0])
  assert _compat.is_resource_variable(v) and not _compat.is_resource_variable(tf.constant(1.0))
  assert isinstance(v, _compat.BaseResourceVariable)
  _compat.assign_unhooked(v, [3.0, 4.0])
  assert_close(_compat.read_unhooked(v), [3.0, 4.0])
  u = _compat.uninitialized_variable((2, 3), tf.float16, name="u", trainable=False)
  assert _compat.is_resource_variable(u) and u.shape == (2, 3) and u.dtype == tf.float16 and not u.trainable
  assert not u.is_initialized()
  u.assign(tf.ones((2, 3), tf.float16))
  assert u.is_initialized()


def test_read_hook_runs_before_every_read():
  class Hooked(_compat.ReadHook, type(tf.Variable(0.0))):
    pass

  v = tf.Variable([1.0, 2.0])
  v.__class__ = Hooked   # as runtime.state does with a managed variable
  calls = []
  v._gspmd_before_read = lambda: calls.append(1)   # pylint: disable=protected-access
  reads = [v.numpy, v.value, v.read_value, lambda: tf.convert_to_tensor(v), tf.function(lambda: v + 1.0)]
  for k, read in enumerate(reads):
    read()
    assert calls, f"read {k} did not call the hook"
    calls.clear()
  assert_close(_compat.read_unhooked(v), [1.0, 2.0])
  assert not calls   # past the hook


# ---- Checkpoint saveables ----------------------------------------------------------------------------------------

def test_checkpoint_hook_saves_slices_and_restores_them(tmp_path):
  restored = {}

  class Sliced(_compat.CheckpointHook, type(tf.Variable(0.0))):
    pass

  class Saveable(_compat.SaveableObject):
    def __init__(self, var, name):
      specs = [_compat.SaveSpec(var[:2], "4 0,2", name, dtype=tf.float32),
               _compat.SaveSpec(var[2:], "4 2,2", name, dtype=tf.float32)]
      super().__init__(var, specs, name)

    def restore(self, restored_tensors, restored_shapes):
      del restored_shapes
      restored["slices"] = [t.numpy().tolist() for t in restored_tensors]

  v = tf.Variable([1.0, 2.0, 3.0, 4.0])
  v.__class__ = Sliced
  v._gspmd_saveable = lambda name: Saveable(v, name)   # pylint: disable=protected-access
  v._gspmd_restore = lambda tensor: restored.setdefault("whole", tensor)   # pylint: disable=protected-access
  path = tf.train.Checkpoint(v=v).write(str(tmp_path / "ckpt"))
  key = next(k for k, _ in tf.train.list_variables(path) if k.startswith("v/"))
  assert_close(tf.train.load_variable(path, key), [1.0, 2.0, 3.0, 4.0])   # one global tensor
  tf.train.Checkpoint(v=v).read(path).assert_consumed()
  assert restored["slices"] == [[1.0, 2.0], [3.0, 4.0]]
  restore_whole = v._restore_from_tensors  # pylint: disable=protected-access  (how a Keras variable restores it)
  assert restore_whole({_compat.VARIABLE_VALUE_KEY: tf.constant(5.0)}) is None
  assert float(restored["whole"]) == 5.0


def test_checkpoint_restore_target_names_the_prefix_object_and_keys_only_while_restoring(tmp_path):
  seen = []

  class Hooked(_compat.CheckpointHook, _compat.SerializeHook, type(tf.Variable(0.0))):
    pass

  class Saveable(_compat.SaveableObject):
    def __init__(self, var, name):
      super().__init__(var, [_compat.SaveSpec(var.read_value(), "", name, dtype=tf.float32)], name)

    def restore(self, restored_tensors, restored_shapes):
      del restored_shapes
      seen.append(("restored", restored_tensors[0].numpy().tolist()))

  v = tf.Variable([1.0, 2.0])
  v.__class__ = Hooked

  def saveable(name):
    seen.append(("target", _compat.checkpoint_restore_target()))
    return Saveable(v, name)
  v._gspmd_saveable = saveable   # pylint: disable=protected-access
  v._gspmd_serialize = lambda: {_compat.VARIABLE_VALUE_KEY: tf.constant([7.0, 8.0])}  # pylint: disable=protected-access
  assert _compat.checkpoint_restore_target() is None
  path = tf.train.Checkpoint(v=v).write(str(tmp_path / "ckpt"))
  assert seen == [("target", None)]   # saving: no restore target
  # TF still saves the variable through its SaveableObject (not the wrapper-facing _serialize_to_tensors).
  assert_close(tf.train.load_variable(path, "v/.ATTRIBUTES/VARIABLE_VALUE"), [1.0, 2.0])
  assert_close(v._serialize_to_tensors()[_compat.VARIABLE_VALUE_KEY], [7.0, 8.0])  # pylint: disable=protected-access
  seen.clear()
  tf.train.Checkpoint(v=v).read(path).assert_consumed()
  (_, target), restored = seen
  assert target[0] == path and target[1] is v and target[2] == {_compat.VARIABLE_VALUE_KEY: "v/.ATTRIBUTES/VARIABLE_VALUE"}
  assert restored == ("restored", [1.0, 2.0])


def test_checkpoint_save_hook_sees_every_value_and_wraps_the_save(tmp_path):
  from tf_gspmd.runtime import checkpoint, state  # pylint: disable=g-import-not-at-top
  seen = []

  def hook(saver, save, file_prefix, options):
    seen.extend((key, spec, obj, read().numpy().tolist()) for key, spec, obj, read in
                _compat.checkpoint_saver_tensors(saver) if key != "_CHECKPOINTABLE_OBJECT_GRAPH")
    return save(saver, file_prefix, options)

  v = tf.Variable([1.0, 2.0])
  try:
    _compat.install_checkpoint_save_hook(hook)
    _compat.install_checkpoint_save_hook(hook)   # once
    path = tf.train.Checkpoint(v=v).write(str(tmp_path / "ckpt"))
  finally:
    _compat.install_checkpoint_save_hook(checkpoint.save_hook(state.storage_of))
  assert seen == [("v/.ATTRIBUTES/VARIABLE_VALUE", "", v, [1.0, 2.0])]
  assert_close(tf.train.load_variable(path, "v/.ATTRIBUTES/VARIABLE_VALUE"), [1.0, 2.0])


def test_async_checkpoint_copy_key(tmp_path):
  """TF's asynchronous checkpoint copies through `_copy_to_cpu` (a tf.function over `_saveable_trackables`); the
  adapter asks the key before each copy and traces again when it changed."""
  from tensorflow.python.checkpoint import async_checkpoint_helper  # pylint: disable=g-import-not-at-top
  from tf_gspmd.runtime import checkpoint, state  # pylint: disable=g-import-not-at-top
  assert hasattr(async_checkpoint_helper.AsyncCheckpointHelper._copy_to_cpu, "_gspmd_python_fn")  # installed
  keys = []

  def key_fn(trackables):
    keys.append(len(keys) // 2)   # a new key every second save
    return keys[-1], len(trackables)

  v = tf.Variable([1.0, 2.0])
  ckpt = tf.train.Checkpoint(v=v)
  options = tf.train.CheckpointOptions(enable_async=True)
  try:
    _compat.install_async_checkpoint_copy_key(key_fn)
    _compat.install_async_checkpoint_copy_key(key_fn)   # once
    paths = []
    for k in range(4):
      v.assign([float(k), 2.0])
      paths.append(ckpt.write(str(tmp_path / f"ck{k}"), options=options))
      ckpt.sync()
  finally:
    _compat.install_async_checkpoint_copy_key(checkpoint.async_copy_key(state.storage_of))
  assert len(keys) >= 3   # asked at each copy after TF's first, eager one
  for k, path in enumerate(paths):
    assert_close(tf.train.load_variable(path, "v/.ATTRIBUTES/VARIABLE_VALUE"), [float(k), 2.0])


# ---- Keras -------------------------------------------------------------------------------------------------------

def test_keras_variable_storage():
  keras = pytest.importorskip("keras")
  v = keras.Variable(np.ones((2, 3), np.float32), dtype="float32")
  inner = _compat.keras_inner_variable(v)
  assert _compat.is_resource_variable(inner)
  assert _compat.keras_variable_shape_dtype(v) == ((2, 3), "float32")
  other = tf.Variable(tf.zeros((2, 3)))
  _compat.keras_set_inner_variable(v, other)
  assert _compat.keras_inner_variable(v) is other and float(tf.reduce_sum(v.value)) == 0.0
  assert _compat.keras_inner_variable(tf.constant(1.0)) is None


def test_keras_variable_initializer_is_the_creation_hook():
  keras = pytest.importorskip("keras")
  installed = _compat.keras_variable_initializer()
  assert _params(installed) == ["self", "initializer"]
  calls = []

  def spy(self, initializer):
    calls.append((self.path, initializer))
    return installed(self, initializer)

  _compat.set_keras_variable_initializer(spy)
  try:
    v = keras.Variable(keras.initializers.Zeros(), shape=(3,), name="spied")
  finally:
    _compat.set_keras_variable_initializer(installed)
  assert calls and calls[0][0].endswith("spied") and float(tf.reduce_sum(v.value)) == 0.0
  assert _compat.keras_variable_initializer() is installed


def test_keras_hub_causal_lm_class_and_its_generate_hooks():
  keras_hub = pytest.importorskip("keras_hub")
  base = _compat.keras_hub_causal_lm_class()
  assert base is keras_hub.models.CausalLM and issubclass(keras_hub.models.GemmaCausalLM, base)
  assert _params(keras_hub.models.GemmaCausalLM.generate_step)[:3] == ["self", "inputs", "stop_token_ids"]
  assert _params(base.make_generate_function) == ["self"]


def test_keras_distribution_class_and_backend_module(monkeypatch):
  keras = pytest.importorskip("keras")
  base = _compat.keras_distribution_class()
  assert issubclass(keras.distribution.DataParallel, base) and issubclass(keras.distribution.ModelParallel, base)
  for attr in ("device_mesh", "batch_dim_name", "get_tensor_layout"):
    assert hasattr(base, attr)
  backend = _compat.keras_backend_distribution_lib()
  assert backend.list_devices("cpu")   # the stub tf_gspmd.keras fills in (distribute_tensor, initialize, ...)
  calls = []
  monkeypatch.setattr(backend, "initialize", lambda *args: calls.append(args), raising=False)
  for var in ("KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID"):
    monkeypatch.delenv(var, raising=False)
  keras.distribution.initialize("h:1", 1, 0)   # Keras's public function calls this module's, positionally
  assert calls == [("h:1", 1, 0)]
  monkeypatch.setattr(backend, "distribute_tensor", lambda tensor, layout: ("distributed", layout), raising=False)
  assert keras.distribution.distribute_tensor(tf.ones([2]), "L") == ("distributed", "L")


# ---- Graphs and functions as data, Grappler -----------------------------------------------------------------------

def _square_fdef():
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
    y = tf.square(x, name="y")
  return _compat.graph_to_function_def(graph, graph.get_operations(), [x], [y], out_names=["out"]), graph


def test_graph_to_function_def_and_back():
  fdef, _ = _square_fdef()
  assert [a.name for a in fdef.signature.input_arg] == ["x"]
  assert [a.name for a in fdef.signature.output_arg] == ["out"]
  gd, names = _compat.function_def_to_graph_def(fdef, [tf.TensorShape([3])])
  assert {n.op for n in gd.node} >= {"Placeholder", "Square"}
  ret = names[fdef.ret["out"]]
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(gd, name="")
    assert graph.get_tensor_by_name(ret).shape.as_list() == [3]   # the parameter shape reached the body


def test_op_def():
  op = _compat.op_def("ResourceApplyAdam")
  assert op.is_stateful and "grad" in [a.name for a in op.input_arg]
  assert not _compat.op_def("Square").is_stateful
  assert _compat.op_def("NoSuchOpType") is None


def test_set_resource_shape_reaches_shape_inference():
  graph = tf.Graph()
  with graph.as_default():
    handle = tf.compat.v1.placeholder(tf.resource, [])
    _compat.set_resource_shape(handle, tf.TensorShape([4, 2]), tf.float32)
    read = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32)
  assert read.shape.as_list() == [4, 2]


def test_grappler_folds_a_shape_computation():
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
    y = tf.reshape(x, tf.stack([tf.shape(x)[1], tf.shape(x)[0]]), name="y")
  meta = tf.compat.v1.MetaGraphDef()
  meta.graph_def.CopyFrom(graph.as_graph_def())
  meta.collection_def["train_op"].node_list.value.append("y")
  config = tf.compat.v1.ConfigProto()
  config.graph_options.rewrite_options.optimizers.extend(["constfold", "shape"])
  config.graph_options.rewrite_options.min_graph_nodes = -1
  optimized = _compat.optimize_graph(config, meta, _compat.grappler_cluster())
  ops = {n.op for n in optimized.node}
  assert "Shape" not in ops and "Reshape" in ops
  shape_node = next(n for n in optimized.node if n.name == next(n for n in optimized.node if n.name == "y").input[1])
  assert shape_node.op == "Const"
  np.testing.assert_array_equal(tf.make_ndarray(shape_node.attr["value"].tensor), [3, 2])


# ---- Several processes -------------------------------------------------------------------------------------------

def test_cluster_collectives_span_two_processes():
  """enable_cluster_collectives + coordination_barrier: an all-reduce over 2 processes x 2 CPUs sums all four."""
  from tf_gspmd import launch  # pylint: disable=g-import-not-at-top
  code = textwrap.dedent("""
      import json, os
      import tensorflow as tf
      from tf_gspmd._platform import compat as _compat
      conf = json.loads(os.environ["TF_CONFIG"])
      k = conf["task"]["index"]
      cpu = tf.config.list_physical_devices("CPU")[0]
      tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
      spec = tf.train.ClusterSpec(conf["cluster"])
      _compat.enable_cluster_collectives(spec, "worker", k, "/job:worker/replica:0/task:0", 10.0, 60.0)
      _compat.coordination_barrier("test", 60.0)
      mine = [d.name for d in tf.config.list_logical_devices("CPU") if f"/task:{k}/" in d.name]
      pd = _compat.parallel_device(mine)
      comps = []
      for i, d in enumerate(mine):
        with tf.device(d):
          comps.append(tf.identity(tf.constant([float(2 * k + i)])))
      f = tf.function(lambda x: tf.raw_ops.CollectiveReduceV2(input=x, group_size=4, group_key=5, instance_key=6,
                                                              ordering_token=[], merge_op="Add", final_op="Id"))
      with tf.device(_compat.parallel_device_name(pd)):
        out = f(pd.pack(comps))
      print("SUM", [float(c.numpy()[0]) for c in pd.unpack(out)], flush=True)
  """)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", ".."))
  procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(env, TF_CONFIG=e["TF_CONFIG"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for e in launch.worker_envs(2)]
  outs = [p.communicate(timeout=120)[0] for p in procs]
  for out in outs:
    assert "SUM [6.0, 6.0]" in out, out[-2000:]
