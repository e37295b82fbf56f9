"""Misuse of every public entry point: wrong types, shapes, axes, sizes, zero and negative values.

Each case must end in a typed tf_gspmd error (`tf_gspmd.errors`) whose message names what is wrong -- never a hang
(every in-process case runs under a 60 s alarm, every command line under a subprocess timeout), a raw exception from
inside the library (AttributeError, IndexError, KeyError, TypeError, ZeroDivisionError ...) or a silent result.
The launcher's and the training binaries' command lines must end in a usage error naming the flag, before anything
starts (no worker, no TensorFlow). `test_every_public_function_is_tried` keeps the sweep complete as the API grows.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd import launch
from tf_gspmd import errors

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MESH = gs.Mesh((2, 4), ("data", "model"))
OTHER = gs.Mesh((4, 2), ("data", "model"))
X = np.ones((8, 4), np.float32)
IDS = np.arange(8).reshape(2, 4)
V3_8 = (2, 2, 1, 2)


@contextlib.contextmanager
def _deadline(seconds):
  """Fails the case (instead of hanging the session) when it runs longer than `seconds`."""
  def expired(signum, frame):  # pylint: disable=unused-argument
    raise TimeoutError(f"the call did not return within {seconds} s")
  previous = signal.signal(signal.SIGALRM, expired)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _double(a):
  return a * 2


def _f(mesh=MESH, **kw):
  return gs.function(_double, mesh=mesh, **kw)


def _traced(fn):
  return lambda: tf.function(fn)(tf.ones((8, 4)))


def _topology():
  return gs.tpu.simulated_topology(V3_8)


def _tpu_mesh():
  return gs.tpu_mesh((2, 4), ("data", "model"), topology=_topology())


def _other_mesh_value():
  return _f(OTHER, in_shardings=P("data"))(X)


def _layout_map_entry(value):
  import tf_gspmd.keras as gk  # pylint: disable=g-import-not-at-top
  layouts = gk.LayoutMap(MESH)
  layouts["x"] = value
  return layouts["x"]


def _keras_scope(value):
  import tf_gspmd.keras as gk  # pylint: disable=g-import-not-at-top
  with gk.scope(value):
    pass


def _keras_model():
  import keras  # pylint: disable=g-import-not-at-top
  return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])


def _keras(name, *args, **kw):
  import tf_gspmd.keras as gk  # pylint: disable=g-import-not-at-top
  return getattr(gk, name)(*args, **kw)


# (public name, case id, call, the error, a regex its message matches)
CASES = [
    # ---- meshes, partition specs, shardings ----
    ("Mesh", "shape-string", lambda: gs.Mesh("24", ("a", "b")), errors.MeshError, "positive ints.*'24'"),
    ("Mesh", "shape-fraction", lambda: gs.Mesh((2.5, 4), ("a", "b")), errors.MeshError, r"\(2.5, 4\)"),
    ("Mesh", "shape-bool", lambda: gs.Mesh((True, 4), ("a", "b")), errors.MeshError, "True"),
    ("Mesh", "shape-zero", lambda: gs.Mesh((0, 4), ("a", "b")), errors.MeshError, "positive"),
    ("Mesh", "shape-negative", lambda: gs.Mesh((-2, 4), ("a", "b")), errors.MeshError, "positive"),
    ("Mesh", "shape-int", lambda: gs.Mesh(8, ("a",)), errors.MeshError, "got 8"),
    ("Mesh", "names-count", lambda: gs.Mesh((2, 4), ("a",)), errors.MeshError, "one name per axis"),
    ("Mesh", "names-int", lambda: gs.Mesh((2, 4), ("a", 1)), errors.MeshError, "non-empty strings"),
    ("Mesh", "names-none", lambda: gs.Mesh((2, 4), None), errors.MeshError, "axis names"),
    ("Mesh", "names-duplicate", lambda: gs.Mesh((2, 4), ("a", "a")), errors.MeshError, "unique"),
    ("Mesh", "devices-count", lambda: gs.Mesh((2, 4), ("a", "b"), devices=["/device:CPU:0"]), errors.MeshError,
     "needs 8 devices"),
    ("Mesh", "devices-garbage", lambda: gs.Mesh((1,), ("a",), devices=["garbage"]), errors.MeshError,
     "'garbage' is not a device name"),
    ("Mesh", "devices-int", lambda: gs.Mesh((1,), ("a",), devices=[5]), errors.MeshError, "device names"),
    ("Mesh", "too-large-to-run", lambda: gs.Mesh((4, 4), ("a", "b")).resolve_devices(), errors.MeshError,
     "needs 16 devices"),
    ("Mesh", "axis-unknown", lambda: MESH.axis_size("nope"), errors.SpecError, "unknown mesh axis 'nope'"),
    ("Mesh", "position-out", lambda: MESH.coords(8), errors.MeshError, "position 8.*0..7"),
    ("Mesh", "position-negative", lambda: MESH.coords(-1), errors.MeshError, "position -1"),
    ("P", "entry-int", lambda: P(1), errors.SpecError, "got 1"),
    ("P", "entry-tuple-int", lambda: P(("a", 1)), errors.SpecError, r"\('a', 1\)"),
    ("Sharding", "mesh-string", lambda: gs.Sharding("mesh"), errors.SpecError, "gs.Mesh.*'mesh'"),
    ("Sharding", "dims-string", lambda: gs.Sharding(MESH, "data"), errors.SpecError, "dims='data'"),
    ("Sharding", "dims-entry-string", lambda: gs.Sharding(MESH, ("data", None)), errors.SpecError, r"dims\[0\]"),
    ("Sharding", "dims-int", lambda: gs.Sharding(MESH, 5), errors.SpecError, "dims=5"),
    ("Sharding", "maximal-string", lambda: gs.Sharding(MESH, maximal="x"), errors.SpecError, "maximal='x'"),
    ("Sharding", "maximal-out", lambda: gs.Sharding(MESH, maximal=8), errors.SpecError, "outside the mesh"),
    ("Sharding", "maximal-negative", lambda: gs.Sharding(MESH, maximal=-1), errors.SpecError, "outside the mesh"),
    ("Sharding", "axis-twice", lambda: gs.Sharding(MESH, (("data",), ("data",))), errors.SpecError, "used for"),
    ("Sharding", "from_spec-string", lambda: gs.Sharding.from_spec(MESH, "data"), errors.SpecError,
     r"gs.P\('data'\)"),
    ("Sharding", "from_spec-int", lambda: gs.Sharding.from_spec(MESH, 5), errors.SpecError, "from 5"),
    ("Sharding", "from_spec-rank", lambda: gs.Sharding.from_spec(MESH, P("data", None), rank=1), errors.SpecError,
     "rank 1"),
    ("Sharding", "from_dims_mapping-string", lambda: gs.Sharding.from_dims_mapping(MESH, ["x"]), errors.SpecError,
     r"dims_mapping\[0\] = 'x'"),
    ("Sharding", "from_dims_mapping-out", lambda: gs.Sharding.from_dims_mapping(MESH, [5]), errors.SpecError,
     r"dims_mapping\[0\] = 5"),
    ("Sharding", "from_dims_mapping-int", lambda: gs.Sharding.from_dims_mapping(MESH, 5), errors.SpecError,
     "dims_mapping=5"),
    ("Sharding", "from_proto-garbage", lambda: gs.Sharding.from_proto(b"\xff\xff\xff", MESH), errors.SpecError,
     "not a serialized OpSharding"),
    ("Sharding", "from_proto-int", lambda: gs.Sharding.from_proto(5, MESH), errors.SpecError, "OpSharding from 5"),
    ("Sharding", "with_rank-lower", lambda: gs.Sharding.from_spec(MESH, P("data", "model")).with_rank(1),
     errors.SpecError, "rank 1"),
    # ---- annotations ----
    ("shard", "axis-unknown", lambda: gs.shard(X, P("nope"), mesh=MESH), errors.SpecError, "'nope'"),
    ("shard", "spec-string", lambda: gs.shard(X, "data", mesh=MESH), errors.SpecError, r"gs.P\('data'\)"),
    ("shard", "spec-int", lambda: gs.shard(X, 5), errors.SpecError, "from 5"),
    ("shard", "mesh-string", lambda: gs.shard(X, P("data"), mesh="mesh"), errors.MeshError, "mesh='mesh'"),
    ("shard", "not-a-tensor", lambda: gs.shard(object(), P()), errors.InputError, "not one"),
    ("shard", "spec-too-long", lambda: gs.shard(X, P("data", None, None), mesh=MESH), errors.SpecError, "rank 2"),
    ("shard", "traced-axis-unknown", _traced(lambda t: gs.shard(t, P("nope"), mesh=MESH)), errors.SpecError,
     "'nope'"),
    ("replicate", "mesh-string", lambda: gs.replicate(X, mesh="m"), errors.MeshError, "mesh='m'"),
    ("mesh_split", "dims-string", lambda: gs.mesh_split(X, IDS, ["a", -1]), errors.SpecError, "dims_mapping="),
    ("mesh_split", "dims-int", lambda: gs.mesh_split(X, IDS, 5), errors.SpecError, "dims_mapping=5"),
    ("mesh_split", "dims-rank", lambda: gs.mesh_split(X, IDS, [0]), errors.SpecError, "rank 2"),
    ("mesh_split", "dims-out", lambda: gs.mesh_split(X, IDS, [5, -1]), errors.SpecError, "not a mesh dimension"),
    ("mesh_split", "device-mesh-string", lambda: gs.mesh_split(X, "abc", [0, -1]), errors.SpecError,
     "integer array"),
    ("mesh_split", "device-mesh-repeated", lambda: gs.mesh_split(X, np.zeros((2, 4), int), [0, -1]),
     errors.SpecError, "once"),
    ("mesh_split", "unspecified-string", lambda: gs.mesh_split(X, IDS, [0, -1], unspecified_dims="x"),
     errors.SpecError, "unspecified_dims='x'"),
    ("mesh_split", "unspecified-out", lambda: gs.mesh_split(X, IDS, [0, -1], unspecified_dims=[5]),
     errors.SpecError, "rank 2"),
    # ---- gs.function: declaration, call, lower ----
    ("function", "mesh-string", lambda: gs.function(_double, mesh="m"), errors.MeshError, "gs.Mesh"),
    ("function", "fn-int", lambda: gs.function(5, mesh=MESH), errors.InputError, "partitions a function"),
    ("function", "in_shardings-int", lambda: _f(in_shardings=5), errors.InputError, "in_shardings=5"),
    ("function", "out_shardings-int", lambda: _f(out_shardings=5), errors.InputError, "out_shardings=5"),
    ("function", "in_shardings-string", lambda: _f(in_shardings="data"), errors.InputError, "'data'"),
    ("function", "timeout-negative", lambda: _f(collective_timeout=-1), errors.InputError, "collective_timeout=-1"),
    ("function", "timeout-string", lambda: _f(collective_timeout="1"), errors.InputError, "collective_timeout='1'"),
    ("function", "jit-string", lambda: _f(jit_compile="yes"), errors.InputError, "jit_compile"),
    ("function", "exchange", lambda: _f(exchange="x"), errors.InputError, "exchange"),
    ("function", "partitioner", lambda: _f(partitioner="x"), errors.InputError, "partitioner"),
    ("function", "weight-update-axis", lambda: _f(weight_update_sharding="nope"), errors.MeshError, "'nope'"),
    ("function", "budget-string", lambda: _f(in_shardings="auto", memory_budget="lots"), errors.InputError,
     "memory_budget='lots'"),
    ("function", "budget-negative", lambda: _f(in_shardings="auto", memory_budget=-1), errors.InputError,
     "memory_budget=-1"),
    ("function", "budget-without-auto", lambda: _f(memory_budget=100), errors.InputError, "auto"),
    ("function", "axis-cost-list", lambda: _f(in_shardings="auto", axis_cost=[1]), errors.InputError,
     r"axis_cost=\[1\]"),
    ("function", "axis-cost-string", lambda: _f(in_shardings="auto", axis_cost={"data": "x"}), errors.InputError,
     "axis_cost"),
    ("function", "axis-cost-axis", lambda: _f(in_shardings="auto", axis_cost={"x": 1}), errors.MeshError, "'x'"),
    ("function", "flops-string", lambda: _f(in_shardings="auto", flops_per_byte="x"), errors.InputError,
     "flops_per_byte='x'"),
    ("function", "flops-zero", lambda: _f(in_shardings="auto", flops_per_byte=0), errors.InputError,
     "flops_per_byte=0"),
    ("function", "solver-time-string", lambda: _f(in_shardings="auto", solver_time_limit="x"), errors.InputError,
     "solver_time_limit='x'"),
    ("function", "auto-pins", lambda: _f(in_shardings="auto", auto_pins="x"), errors.InputError, "auto_pins"),
    ("function", "call-arity", lambda: _f(in_shardings=(P("data"), P()))(X), errors.InputError, "2 entries"),
    ("function", "call-rank", lambda: _f(in_shardings=P("data", None, None))(X), errors.SpecError, "rank 2"),
    ("function", "call-axis-unknown", lambda: _f(in_shardings=P("nope"))(X), errors.SpecError, "'nope'"),
    ("function", "call-ragged", lambda: _f()(tf.ragged.constant([[1.0], [2.0, 3.0]])), errors.InputError,
     "RaggedTensor"),
    ("function", "call-sparse", lambda: _f()(tf.sparse.from_dense(X)), errors.InputError, "SparseTensor"),
    ("function", "call-dict", lambda: _f()({"a": X}), errors.InputError, "dict of tensors"),
    ("function", "call-object", lambda: _f()(object()), errors.InputError, "not a tensor"),
    ("function", "call-other-mesh", lambda: _f(in_shardings=P("data"))(_other_mesh_value()), errors.InputError,
     r"Mesh\(data=4, model=2\).*gs.reshard\(x, mesh, P\('data', None\)\)"),
    ("function", "lower-string", lambda: _f().lower("x"), errors.InputError, "TensorSpec"),
    ("function", "lower-dynamic", lambda: _f().lower(tf.TensorSpec([None, 4])), errors.ShapeError, "dynamic"),
    ("function", "lower-processes-zero", lambda: _f().lower(tf.TensorSpec([8, 4]), processes=0), errors.MeshError,
     "processes=0"),
    ("function", "lower-processes-uneven", lambda: _f().lower(tf.TensorSpec([8, 4]), processes=3),
     errors.MeshError, "processes=3"),
    ("function", "lower-processes-string", lambda: _f().lower(tf.TensorSpec([8, 4]), processes="2"),
     errors.MeshError, "processes='2'"),
    ("function", "lower-processes-fraction", lambda: _f().lower(tf.TensorSpec([8, 4]), processes=2.5),
     errors.MeshError, "processes=2.5"),
    ("function", "lower-other-mesh", lambda: _f().lower(_other_mesh_value()), errors.InputError, "gs.reshard"),
    ("function", "lowered-exported", lambda: _f().lower(tf.TensorSpec([8, 4])).exported, errors.InputError, "xla"),
    ("function", "lowered-visualize-unknown", lambda: _f().lower(tf.TensorSpec([8, 4])).visualize("nope"),
     errors.InputError, "no tensor 'nope'"),
    # ---- processes and devices ----
    ("split_cpu_devices", "zero", lambda: gs.split_cpu_devices(0), errors.MeshError, "n=0.*1 or more"),
    ("split_cpu_devices", "negative", lambda: gs.split_cpu_devices(-1), errors.MeshError, "n=-1"),
    ("split_cpu_devices", "string", lambda: gs.split_cpu_devices("8"), errors.MeshError, "n='8'"),
    ("split_cpu_devices", "fraction", lambda: gs.split_cpu_devices(2.5), errors.MeshError, "n=2.5"),
    ("split_cpu_devices", "threads-zero", lambda: gs.split_cpu_devices(8, intra_op_threads=0), errors.MeshError,
     "intra_op_threads=0"),
    ("split_cpu_devices", "after-tf-started", lambda: gs.split_cpu_devices(16), errors.MeshError, "already started"),
    ("initialize", "cpu-zero", lambda: gs.initialize(cpu_devices=0), errors.MeshError, "cpu_devices=0"),
    ("initialize", "cpu-negative", lambda: gs.initialize(cpu_devices=-8), errors.MeshError, "cpu_devices=-8"),
    ("initialize", "cpu-string", lambda: gs.initialize(cpu_devices="8"), errors.MeshError, "cpu_devices='8'"),
    ("initialize", "resolver-string", lambda: gs.initialize("resolver"), errors.MeshError, "ClusterResolver"),
    ("initialize", "join-negative", lambda: gs.initialize(join_timeout=-1), errors.MeshError, "join_timeout=-1"),
    ("initialize", "heartbeat-string", lambda: gs.initialize(heartbeat_timeout="x"), errors.MeshError,
     "heartbeat_timeout='x'"),
    ("is_local", "int", lambda: gs.is_local(5), errors.MeshError, "5 is not a device"),
    ("is_local", "garbage", lambda: gs.is_local("garbage"), errors.MeshError, "'garbage' is not a device name"),
    ("local_devices", "string", lambda: gs.local_devices("mesh"), errors.MeshError, "gs.Mesh"),
    ("from_process_local_data", "mesh-string", lambda: gs.from_process_local_data(X, "mesh", P("data")),
     errors.MeshError, "mesh='mesh'"),
    ("from_process_local_data", "axis-unknown", lambda: gs.from_process_local_data(X, MESH, P("nope")),
     errors.SpecError, "'nope'"),
    ("from_process_local_data", "global-shape-string",
     lambda: gs.from_process_local_data(X, MESH, P("data"), global_shape="x"), errors.InputError, "global_shape='x'"),
    ("from_process_local_data", "global-shape-rank",
     lambda: gs.from_process_local_data(X, MESH, P("data"), global_shape=(8,)), errors.InputError, "rank 2"),
    ("from_process_local_data", "objects", lambda: gs.from_process_local_data([object()], MESH, P()),
     errors.InputError, "not an array of numbers"),
    # ---- TPUs, on a machine without one ----
    ("tpu_mesh", "no-tpu", lambda: gs.tpu_mesh((2, 4), ("data", "model")), errors.MeshError,
     "no TPU is attached.*simulated_topology.*partitioner=\"xla\""),
    ("tpu_mesh", "shape-zero", lambda: gs.tpu_mesh((0, 4), ("data", "model")), errors.MeshError, "positive"),
    ("tpu_mesh", "topology-string", lambda: gs.tpu_mesh((2, 4), ("a", "b"), topology="x"), errors.MeshError,
     "Topology"),
    ("tpu_mesh", "too-large", lambda: gs.tpu_mesh((4, 4), ("a", "b"), topology=_topology()), errors.MeshError,
     "16 TPU cores"),
    ("tpu.initialize", "no-tpu", lambda: gs.tpu.initialize(), errors.MeshError, "no TPU is attached"),
    ("tpu.initialize", "resolver-string", lambda: gs.tpu.initialize("x"), errors.MeshError, "cluster resolver"),
    ("tpu.strategy", "cpu-mesh", lambda: gs.tpu.strategy(MESH), errors.MeshError, "not a mesh of TPU cores"),
    ("tpu.strategy", "no-tpu", lambda: gs.tpu.strategy(_tpu_mesh()), errors.MeshError, "no TPU is attached"),
    ("tpu.strategy", "mesh-string", lambda: gs.tpu.strategy("m"), errors.MeshError, "not a mesh of TPU cores"),
    ("tpu.simulated_topology", "string", lambda: gs.tpu.simulated_topology("x"), errors.MeshError, "shape='x'"),
    ("tpu.simulated_topology", "three-dims", lambda: gs.tpu.simulated_topology((2, 2, 1)), errors.MeshError,
     "four positive ints"),
    ("tpu.simulated_topology", "zero", lambda: gs.tpu.simulated_topology((0, 2, 1, 1)), errors.MeshError, "shape="),
    ("tpu.simulated_topology", "fraction", lambda: gs.tpu.simulated_topology((2.5, 2, 1, 1)), errors.MeshError,
     "2.5"),
    ("tpu.simulated_topology", "chips-per-host", lambda: gs.tpu.simulated_topology((4, 4, 1, 1), (3, 3, 1)),
     errors.MeshError, "does not tile"),
    ("tpu.core_order", "shape-string", lambda: gs.tpu.core_order(_topology(), "x"), errors.MeshError,
     "mesh_shape='x'"),
    ("tpu.core_order", "too-large", lambda: gs.tpu.core_order(_topology(), (4, 4)), errors.MeshError, "16 TPU"),
    ("tpu.device_assignment", "cpu-mesh", lambda: gs.tpu.device_assignment(MESH, _topology()), errors.MeshError,
     "not a mesh of TPU cores"),
    ("tpu.partitions", "cpu-mesh", lambda: gs.tpu.partitions(MESH, _topology()), errors.MeshError, "TPU cores"),
    ("tpu.strategy_arguments", "cpu-mesh", lambda: gs.tpu.strategy_arguments(MESH, None, _topology()),
     errors.MeshError, "TPU cores"),
    ("tpu.xla_device_id", "outside", lambda: gs.tpu.xla_device_id(_topology(), (9, 9, 9, 9)), errors.MeshError,
     "not a core"),
    ("tpu.xla_device_id", "string", lambda: gs.tpu.xla_device_id(_topology(), "x"), errors.MeshError, "coords='x'"),
    ("tpu.program", "not-a-gs-function", lambda: gs.tpu.program(_double, X), errors.InputError, "gs.function"),
    ("tpu.run", "not-a-gs-function", lambda: gs.tpu.run(_double, X), errors.InputError, "gs.function"),
    ("tpu.run", "cpu-mesh", lambda: gs.tpu.run(_f(partitioner="xla"), X), errors.MeshError, "TPU cores"),
    ("tpu.run", "no-tpu", lambda: gs.tpu.run(_f(_tpu_mesh()), X), errors.MeshError, "no TPU is attached"),
    ("tpu.run", "strategy-string", lambda: gs.tpu.run(_f(_tpu_mesh()), X, strategy="s"), errors.InputError,
     "strategy='s'"),
    ("function", "call-on-tpu-mesh-no-tpu", lambda: _f(_tpu_mesh())(X), errors.MeshError, "no TPU is attached"),
    ("tpu.annotated_program", "in-shardings-spec", lambda: gs.tpu.annotated_program(_double, _tpu_mesh(), P("data")),
     errors.InputError, "one spec"),
    ("tpu.use_strategy", "mesh-string", lambda: gs.tpu.use_strategy("m", None), errors.MeshError, "gs.Mesh"),
    ("tpu.mesh", "no-tpu", lambda: gs.tpu.mesh((2, 4), ("data", "model")), errors.MeshError, "no TPU"),
    ("tpu.is_tpu_mesh", "string", lambda: gs.tpu.is_tpu_mesh("m"), errors.MeshError, "not a gs.Mesh"),
    # ---- modules other people own ----
    ("shards_of", "int", lambda: gs.shards_of(5), errors.InputError, "ShardedTensor"),
    ("reshard", "mesh-string", lambda: gs.reshard(_other_mesh_value(), "m", P()), errors.ShardingError, "'m'"),
    ("reshard", "axis-unknown", lambda: gs.reshard(_other_mesh_value(), MESH, P("nope")), errors.SpecError, "'nope'"),
    ("reshard", "host-value", lambda: gs.reshard(X, MESH, P("data")), errors.InputError, "ShardedTensor"),
    ("variable", "mesh-string", lambda: gs.variable(gs.initializers.Constant(0.0), (8, 4), mesh="m", spec=P()),
     errors.InputError, "mesh='m'"),
    ("variable", "shape-negative", lambda: gs.variable(gs.initializers.Constant(0.0), (-1, 4), mesh=MESH, spec=P()),
     errors.InputError, r"\(-1, 4\)"),
    ("stack_stages", "uneven", lambda: gs.stack_stages(np.zeros((4, 2)), 3), errors.SpecError, "multiple of 3"),
    ("schedule_order", "unknown", lambda: gs.schedule_order("x", 2, 2), errors.InputError, "schedule='x'"),
    ("value_elsewhere", "mesh-string", lambda: gs.value_elsewhere((8, 4), tf.float32, "m", P()),
     errors.ShardingError, "'m'"),
    ("mpmd_pipeline", "no-stages", lambda: gs.mpmd_pipeline([], 2), errors.InputError, "non-empty"),
    ("pipeline", "no-microbatches", lambda: gs.pipeline(lambda w, h: h, np.zeros((2, 3)), X, microbatches=0),
     errors.InputError, "microbatches"),
    ("plan_stages", "no-layers", lambda: gs.plan_stages(_double, tf.TensorSpec([8, 4]), mesh=MESH, layers=0),
     errors.InputError, "layers=0"),
    ("auto_parallel", "no-microbatches", lambda: gs.auto_parallel(lambda p, a: a, {}, X, mesh=MESH, microbatches=0),
     errors.InputError, "microbatches=0"),
    ("keras.LayoutMap", "mesh-string", lambda: _keras("LayoutMap", "m"), errors.InputError, "gs.Mesh"),
    ("keras.LayoutMap", "batch-axis-unknown", lambda: _keras("LayoutMap", MESH, batch_axis="nope"),
     errors.SpecError, "'nope'"),
    ("keras.scope", "string", lambda: _keras_scope("x"), errors.InputError, "LayoutMap"),
    ("keras.auto_layout_map", "not-a-model", lambda: _keras("auto_layout_map", "m", MESH, data=X), errors.InputError,
     "DeviceMesh"),
    ("keras.step_options", "unknown-option", lambda: _keras("step_options", exchnage="collectives"), errors.InputError,
     "exchnage"),
    ("keras.lower_train_step", "not-compiled", lambda: _keras("lower_train_step", _keras_model(), X),
     errors.InputError, "not compiled"),
    ("visualize_sharding", "int", lambda: gs.visualize_sharding(5, show=False), errors.ShardingError, "int"),
    ("gpu_form", "not-a-function", lambda: gs.gpu_form(5), errors.InputError, "takes a gs.function"),
    ("gpu_form", "cpu-lowering", lambda: gs.gpu_form(_f().lower(tf.TensorSpec([8, 4]))), errors.InputError,
     "lowering is for a CPU mesh"),
    ("explore", "not-a-function", lambda: gs.explore(5), errors.InputError, "gs.function"),
    ("explore", "lowering-with-specs", lambda: gs.explore(_f().lower(tf.TensorSpec([8, 4])), tf.TensorSpec([8, 4])),
     errors.InputError, "takes no specs"),
    ("stack_stages", "zero-stages", lambda: gs.stack_stages(np.zeros((4, 2)), 0), errors.ShardingError, "stages"),
    ("unstack_stages", "zero-repeats", lambda: gs.unstack_stages(np.zeros((4, 2)), repeats=0), errors.ShardingError,
     "repeats"),
    ("plan_transfer", "meshes-strings", lambda: gs.plan_transfer((8, 4), tf.float32, "a", "b", [], []),
     errors.ShardingError, "'a'"),
    ("schedule_order", "zero-stages", lambda: gs.schedule_order("1f1b", 0, 2), errors.ShardingError, "0"),
    ("Stage", "mesh-string", lambda: gs.Stage(_double, "m"), errors.ShardingError, "'m'"),
    ("keras.LayoutMap", "entry-int", lambda: _layout_map_entry(5), errors.SpecError, "5"),
    ("keras.LayoutMap", "entry-string", lambda: _layout_map_entry("data"), errors.SpecError, "data"),
    ("keras.LayoutMap", "entry-axis-unknown", lambda: _layout_map_entry(P("nope")), errors.SpecError, "nope"),
]



@pytest.mark.parametrize("api,case,call,error,match",
                         [pytest.param(*c, id=f"{c[0]}:{c[1]}") for c in CASES])
def test_misuse_raises_a_typed_error_naming_the_problem(api, case, call, error, match):  # pylint: disable=unused-argument
  with _deadline(60):
    with pytest.raises(error, match=match) as e:
      call()
  assert isinstance(e.value, errors.ShardingError)


# Public names that take no arguments, are values or error types, or are classes the library builds for the user.
NOT_CALLED_WITH_ARGUMENTS = {
    "AutoShardingError", "ClusterJoinError", "GpuFormError", "GpuForm", "InputError", "MeshError", "PartitionError", "ProcessLostError",
    "ShapeError", "ShardingError", "SpecError", "UnsupportedOpError", "errors", "initializers", "ops", "rewriter",
    "runtime", "tpu", "keras", "process_count", "process_index", "plan_scope", "wait_for_sends", "TransferLog",
    "Lowered", "ShardedFunction", "ShardedTensor", "Shard", "Transfer", "RunRecord", "AutoParallel", "MpmdPipeline",
    "tpu.AnnotatedProgram", "tpu.Partition", "tpu.Runner", "tpu.InputError",
    "sharding_of",   # a query: None for a value tf_gspmd does not manage, as documented
}


def test_every_public_function_is_tried():
  public = set(gs.__all__) | {"keras"}
  public |= {f"tpu.{n}" for n in dir(gs.tpu) if not n.startswith("_") and callable(getattr(gs.tpu, n)) and
             not isinstance(getattr(gs.tpu, n), type(tf))}
  tried = {c[0] for c in CASES}
  untried = sorted(public - tried - NOT_CALLED_WITH_ARGUMENTS - {"tf"})
  assert not untried, f"add misuse cases for: {untried}"


def test_repr_of_a_layout_is_the_spec_the_docs_show():
  y = _f(in_shardings=P("data", None))(X)
  assert repr(y.sharding) == "P('data', None)" and repr(gs.sharding_of(y)) == "P('data', None)"
  assert repr(gs.Sharding(MESH)) == "P()" and repr(gs.Sharding(MESH, maximal=3)).endswith("maximal=3)")


# ---- the launcher's command line: usage errors before any worker starts ----------------------------------------

@pytest.mark.parametrize("argv,named", [
    (["--workers=0"], "--workers=0"),
    (["--workers=-2"], "--workers=-2"),
    (["--workers=2", "--devices_per_worker=-3"], "--devices_per_worker=-3"),
    (["--workers=2", "--devices_per_worker=0"], "--devices_per_worker=0"),
    (["--workers=1", "--grace=-1"], "--grace=-1"),
    (["--workers=1", "--grace=nan"], "--grace=nan"),
    (["--workers=1", "--timeout=-1"], "--timeout=-1"),
    (["--workers=1", "--timeout=0"], "--timeout=0"),
    (["--workers=1", "--timeout=inf"], "--timeout=inf"),
])
def test_launcher_numbers_are_usage_errors(argv, named, capsys, monkeypatch):
  monkeypatch.setattr(launch.subprocess, "Popen", _no_worker)
  with _deadline(30), pytest.raises(SystemExit) as e:
    launch.main(argv + ["--", "-c", "pass"])
  assert e.value.code == 2
  assert named in capsys.readouterr().err


@pytest.mark.parametrize("program,named", [
    ([], "give the program after --"),
    (["-c"], "-c needs the code"),
    (["-m"], "-m needs the module"),
    (["-x", "pass"], "'-x' is an option, not a program"),
    (["/nonexistent/train.py"], "the script '/nonexistent/train.py' does not exist"),
    (["no_such_program_anywhere"], "'no_such_program_anywhere' is not an executable"),
])
def test_launcher_programs_it_cannot_start_are_usage_errors(program, named, capsys, monkeypatch):
  monkeypatch.setattr(launch.subprocess, "Popen", _no_worker)
  with _deadline(30), pytest.raises(SystemExit) as e:
    launch.main(["--workers=1", "--"] + program)
  assert e.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("kw,error,named", [
    (dict(workers=0), errors.MeshError, "workers=0"),
    (dict(workers="2"), errors.MeshError, "workers='2'"),
    (dict(workers=1, devices_per_worker=-3), errors.MeshError, "devices_per_worker=-3"),
    (dict(workers=1, grace=-1.0), errors.InputError, "grace=-1"),
    (dict(workers=1, timeout=-1.0), errors.InputError, "timeout=-1"),
    (dict(workers=1, command="python -c pass"), errors.InputError, "list of strings"),
    (dict(workers=1, command=["no_such_program_anywhere"]), errors.InputError, "not an executable"),
])
def test_launch_function_arguments_are_typed_errors(kw, error, named, monkeypatch):
  monkeypatch.setattr(launch.subprocess, "Popen", _no_worker)
  command = kw.pop("command", [sys.executable, "-c", "pass"])
  with _deadline(30), pytest.raises(error, match=named):
    launch.launch(command, **kw)


def _no_worker(*args, **kw):
  raise AssertionError(f"a worker was started for a command line the launcher should refuse: {args} {kw}")


# ---- the training binaries' flags: absl's usage error, before TensorFlow starts -------------------------------

_PARSE = """
import json, sys
sys.path.insert(0, {examples!r})
sys.argv = [{binary!r}]
import {module}  # defines the flags (main runs only as __main__)
from absl import flags
out = []
for argv in {cases!r}:
  flags.FLAGS.unparse_flags()
  try:
    flags.FLAGS([{binary!r}] + argv)
    out.append(None)
  except flags.Error as e:
    out.append(str(e))
print(json.dumps({{"errors": out, "tensorflow": "tensorflow" in sys.modules}}))
"""

SHARED = [   # (flags, what the message names) for every binary built on examples/training.py
    (["--steps=-1"], "--steps=-1"), (["--steps=0"], "--steps=0"), (["--steps=x"], "--steps=x"),
    (["--mesh=a,b"], "--mesh"), (["--mesh=0,4"], "--mesh"), (["--mesh=-2,4"], "--mesh"),
    (["--plan", "--plan_mesh=a,b"], "--plan_mesh"), (["--plan", "--plan_mesh=2,0"], "--plan_mesh"),
    (["--plan", "--plan_hosts=-1"], "--plan_hosts=-1"), (["--plan", "--plan_hosts=0"], "--plan_hosts=0"),
    (["--plan", "--plan_hosts=3"], "--plan_hosts=3 does not divide"), (["--seed=-1"], "--seed=-1"),
    (["--lr=0"], "--lr=0"), (["--lr=nan"], "--lr=nan"), (["--lr=-1"], "--lr=-1"),
    (["--ckpt_every=-1"], "--ckpt_every=-1"), (["--check_steps=-1"], "--check_steps=-1"),
    (["--memory_budget_mib=-5"], "--memory_budget_mib=-5"), (["--memory_budget_mib=0"], "--memory_budget_mib=0"),
    (["--stage_layers=0"], "--stage_layers=0"), (["--profile=5,3"], "--profile"), (["--profile=a"], "--profile"),
    (["--profile=1,2,3"], "--profile"), (["--profile=40", "--steps=30"], "--profile"),
    (["--exchange=x"], "--exchange"),
]

BINARIES = {
    "train_transformer": SHARED + [
        (["--seq_len=0"], "--seq_len=0"), (["--batch=0"], "--batch=0"), (["--layers=-1"], "--layers=-1"),
        (["--heads=0"], "--heads=0"), (["--d_model=0"], "--d_model=0"), (["--d_ff=-1"], "--d_ff=-1"),
        (["--vocab=0"], "--vocab=0"), (["--d_model=65"], "not a multiple of --heads"),
        (["--pipeline_stages=-1"], "--pipeline_stages=-1"), (["--microbatches=0"], "--microbatches=0"),
        (["--circular_repeats=0"], "--circular_repeats=0"), (["--layout=3d"], "--layout"),
        (["--mesh=2,2,2"], "--mesh=2,2,2 gives 3 sizes"), (["--plan", "--plan_mesh=8"], "--plan_mesh=8 gives 1"),
        (["--pipeline_stages=3"], "--pipeline_stages=3"), (["--pipeline_stages=4", "--batch=6"], "--batch=6"),
        (["--pipeline_stages=4", "--mesh=3,2"], "--pipeline_stages=4 is not a multiple of 3"),
        (["--pipeline_stages=2", "--circular_repeats=2", "--microbatches=1", "--batch=8"], "--microbatches=1"),
        (["--pipeline_stages=2", "--mesh=2"], "--mesh=2 gives 1"),
        (["--auto_parallel", "--batch=10", "--microbatches=4"], "--batch=10"),
    ],
    "train_convnet": SHARED + [
        (["--image_size=30"], "--image_size=30"), (["--image_size=8"], "--image_size=8"),
        (["--image_size=-4"], "--image_size=-4"), (["--width=0"], "--width=0"), (["--batch=0"], "--batch=0"),
        (["--mesh=8"], "--mesh=8 gives 1"), (["--auto_parallel"], "--auto_parallel"),
    ],
    "train_moe": SHARED + [
        (["--experts=0"], "--experts=0"), (["--capacity_factor=0"], "--capacity_factor=0"),
        (["--capacity_factor=-1"], "--capacity_factor=-1"), (["--aux_weight=-1"], "--aux_weight=-1"),
        (["--seq_len=0"], "--seq_len=0"), (["--batch=-2"], "--batch=-2"), (["--mesh=2,4"], "--mesh=2,4 gives 2"),
        (["--d_model=30"], "--d_model must be a multiple of --heads"), (["--microbatches=0"], "--microbatches=0"),
        (["--auto_parallel", "--batch=10"], "--batch must be a multiple of --microbatches"),
    ],
    "mlp": [
        (["--mesh=a"], "--mesh"), (["--mesh=0"], "--mesh"), (["--mesh=2,2,2"], "--mesh"), (["--steps=0"], "--steps=0"),
        (["--batch=-1"], "--batch=-1"), (["--hidden=0"], "--hidden=0"), (["--d_model=0"], "--d_model=0"),
        (["--mesh=8", "--mode=megatron"], "--mode=megatron needs a 2-D mesh"), (["--mode=x"], "--mode"),
    ],
}
GOOD = {   # flags that must still parse (the documented command lines)
    "train_transformer": [[], ["--plan"], ["--pipeline_stages=4", "--microbatches=8", "--mesh=4,2", "--layers=8"],
                          ["--layers=8", "--pipeline_stages=4", "--circular_repeats=2", "--mesh=2,2,2"],
                          ["--auto_parallel", "--plan", "--layers=64", "--plan_mesh=32,8"], ["--profile=3,5"],
                          ["--plan", "--plan_hosts=4", "--plan_mesh=2,4"], ["--layers=64", "--pipeline_stages=16",
                                                                            "--plan"]],
    "train_convnet": [[], ["--mesh=1,8"], ["--plan"], ["--image_size=32", "--width=8", "--batch=4"]],
    "train_moe": [[], ["--plan"], ["--auto_parallel", "--mesh=2,4"], ["--plan", "--plan_hosts=8"]],
    "mlp": [[], ["--mesh=8", "--mode=dp"], ["--mesh=2,4", "--mode=megatron"]],
}


@pytest.mark.parametrize("module", sorted(BINARIES))
def test_binary_flags_are_usage_errors_before_tensorflow_starts(module):
  """Every bad value fails absl's flag parsing, naming the flag; the documented command lines still parse; nothing
  imported TensorFlow (one subprocess per binary, all its cases in it)."""
  cases = [argv for argv, _ in BINARIES[module]] + GOOD[module]
  code = _PARSE.format(examples=os.path.join(ROOT, "examples"), binary=f"{module}.py", module=module, cases=cases)
  out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert not result["tensorflow"], "parsing the flags imported TensorFlow"
  got = result["errors"]
  for (argv, named), message in zip(BINARIES[module], got):
    assert message is not None, f"{module} {argv} parsed without an error"
    assert named in message, f"{module} {argv}: {message!r} does not name {named!r}"
  for argv, message in zip(GOOD[module], got[len(BINARIES[module]):]):
    assert message is None, f"{module} {argv}: {message}"


def test_a_bad_flag_ends_the_binary_with_a_usage_error_at_once():
  out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_transformer.py"), "--plan",
                        "--plan_mesh=3,x"], capture_output=True, text=True, timeout=120, check=False,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
  assert "FATAL Flags parsing error: flag --plan_mesh=" in out.stderr and "positive whole size" in out.stderr
