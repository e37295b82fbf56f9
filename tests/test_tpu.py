"""TPUs without a TPU: meshes over simulated topologies, the device assignment, partition ids, the strategy's
arguments, and the annotated programs run through a one-device strategy standing in for TPUStrategy."""

import inspect
import itertools

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.runtime import tpu as rt

V4_8 = (2, 2, 1, 1)      # 4 chips, one core each (TF device), one host
V3_8 = (2, 2, 1, 2)      # 4 chips x 2 cores, one host
V3_32 = (4, 4, 1, 2)     # 16 chips x 2 cores, 4 hosts
POD_3D = (4, 4, 4, 1)    # 64 chips on a 3-D grid, 16 hosts


def chip_distance(a, b):
  """ICI hops between the chips of two cores (0: the same chip), no wrap-around."""
  return int(sum(abs(int(a[d]) - int(b[d])) for d in range(3)))


def axis_steps(order, axis):
  """Every pair of cores at consecutive positions along mesh `axis` of `order` (shape mesh + (4,))."""
  moved = np.moveaxis(order, axis, 0)
  return [(moved[i][idx], moved[i + 1][idx]) for i in range(moved.shape[0] - 1)
          for idx in np.ndindex(*moved.shape[1:-1])]


# ---- topologies ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,tasks", [(V4_8, 1), (V3_8, 1), (V3_32, 4), (POD_3D, 16)])
def test_simulated_topology_has_every_core_once_hosts_on_2x2_blocks(shape, tasks):
  topo = gs.tpu.simulated_topology(shape)
  assert list(topo.mesh_shape) == list(shape)
  assert topo.num_tasks == tasks and topo.num_tasks * topo.num_tpus_per_task == int(np.prod(shape))
  coords = {tuple(c) for c in topo.device_coordinates.reshape(-1, 4)}
  assert coords == set(itertools.product(*[range(s) for s in shape]))
  for task in range(tasks):   # a host drives a 2x2 block of chips
    chips = {tuple(c[:3]) for c in topo.device_coordinates[task]}
    xs, ys = {c[0] for c in chips}, {c[1] for c in chips}
    assert len(chips) == 4 and max(xs) - min(xs) == 1 and max(ys) - min(ys) == 1 and min(xs) % 2 == 0
  again = rt.as_topology(topo.serialized())   # what initialize_tpu_system hands back is the serialized form
  np.testing.assert_array_equal(again.device_coordinates, topo.device_coordinates)


# ---- core order ---------------------------------------------------------------------------------------------------

def test_v4_8_a_1d_mesh_is_a_closed_ring_a_2d_mesh_puts_the_minor_axis_on_x():
  order = gs.tpu.core_order(V4_8, (4,))
  assert order.tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 0, 0]]   # last next to first
  order = gs.tpu.core_order(V4_8, (2, 2))
  for d, m in np.ndindex(2, 2):
    assert order[d, m].tolist() == [m, d, 0, 0]


def test_v3_8_the_minor_axis_rings_through_the_cores_of_a_chip_and_its_neighbour():
  order = gs.tpu.core_order(V3_8, (2, 4))
  for d in range(2):
    assert order[d].tolist() == [[0, d, 0, 0], [0, d, 0, 1], [1, d, 0, 1], [1, d, 0, 0]]


def test_v3_32_mesh_4x8_model_is_a_ring_of_cores_along_x_data_runs_along_y():
  order = gs.tpu.core_order(V3_32, (4, 8))
  ring = [(0, 0), (0, 1), (1, 1), (2, 1), (3, 1), (3, 0), (2, 0), (1, 0)]   # (x, core)
  for d in range(4):
    assert [(int(c[0]), int(c[3])) for c in order[d]] == ring
    assert set(order[d][:, 1].tolist()) == {d}
  for a, b in axis_steps(order, 0) + axis_steps(order, 1):
    assert chip_distance(a, b) <= 1
  first, last = order[0, 0], order[0, -1]
  assert chip_distance(first, last) == 1   # the model ring closes: its last core is next to its first


@pytest.mark.parametrize("topo_shape,mesh_shape,near_axes", [
    (V4_8, (4,), (0,)), (V4_8, (2, 2), (0, 1)), (V4_8, (2,), (0,)),
    (V3_8, (8,), (0,)), (V3_8, (2, 4), (0, 1)), (V3_8, (4, 2), (0, 1)), (V3_8, (2, 2, 2), (0, 1, 2)),
    (V3_32, (32,), (0,)), (V3_32, (4, 8), (0, 1)), (V3_32, (8, 4), (1,)), (V3_32, (2, 16), (1,)),
    (V3_32, (2, 2, 8), (1, 2)), (V3_32, (4,), (0,)), (V3_32, (16,), (0,)),
    (POD_3D, (64,), (0,)), (POD_3D, (4, 16), (0, 1)), (POD_3D, (4, 4, 4), (0, 1, 2)), (POD_3D, (16, 4), (0, 1)),
])
def test_core_order_uses_distinct_cores_and_steps_one_chip_at_most_along_the_axes(topo_shape, mesh_shape, near_axes):
  order = gs.tpu.core_order(topo_shape, mesh_shape)
  assert order.shape == mesh_shape + (4,)
  flat = [tuple(c) for c in order.reshape(-1, 4)]
  assert len(set(flat)) == len(flat)
  assert all(0 <= c[d] < topo_shape[d] for c in flat for d in range(4))
  for axis in near_axes:
    assert all(chip_distance(a, b) <= 1 for a, b in axis_steps(order, axis)), f"axis {axis}"
  assert all(chip_distance(a, b) <= 1 for a, b in axis_steps(order, len(mesh_shape) - 1))


def test_tf_device_order_would_put_model_neighbours_further_apart():
  """The rule matters: TF's own device order (task, then ordinal) as a v3-32 (4, 8) mesh has model neighbours two
  or more chips apart; the core order has none."""
  topo = gs.tpu.simulated_topology(V3_32)
  naive = topo.device_coordinates.reshape(4, 8, 4)
  assert max(chip_distance(a, b) for a, b in axis_steps(naive, 0)) >= 2
  assert max(chip_distance(a, b) for a, b in axis_steps(gs.tpu.core_order(topo, (4, 8)), 0)) <= 1


@pytest.mark.parametrize("mesh_shape", [(6,), (3, 2), (3,)])
def test_a_shape_that_does_not_factor_follows_one_snake_over_the_cores(mesh_shape):
  order = gs.tpu.core_order(V3_8, mesh_shape).reshape(-1, 4)
  flat = [tuple(c) for c in order]
  assert len(set(flat)) == len(flat)
  assert all(chip_distance(a, b) <= 1 and a != b for a, b in zip(flat, flat[1:]))
  assert flat[0] == (0, 0, 0, 0) and flat[1] == (0, 0, 0, 1)   # the cores of a chip first


def test_path_helpers_step_one_unit_at_a_time():
  for sizes in [(2, 3), (3, 2, 2), (4,), (2, 2, 2, 2)]:
    path = rt.snake(sizes)
    assert sorted(path) == sorted(itertools.product(*[range(n) for n in sizes]))
    assert all(sum(abs(a - b) for a, b in zip(p, q)) == 1 for p, q in zip(path, path[1:]))
  for a, b in [(2, 2), (4, 2), (3, 4), (2, 8)]:
    path = rt.ring(a, b)
    assert sorted(path) == sorted(itertools.product(range(a), range(b)))
    cyc = path + path[:1]
    assert all(sum(abs(x - y) for x, y in zip(p, q)) == 1 for p, q in zip(cyc, cyc[1:]))


def test_a_mesh_larger_than_the_slice_is_refused():
  with pytest.raises(gs.MeshError, match="needs 16 TPU cores"):
    gs.tpu.core_order(V3_8, (4, 4))


# ---- meshes and device assignments ---------------------------------------------------------------------------------

def test_tpu_mesh_names_the_cores_of_the_order_on_their_hosts():
  topo = gs.tpu.simulated_topology(V3_32)
  mesh = gs.tpu_mesh((4, 8), ("data", "model"), topology=topo)
  order = gs.tpu.core_order(topo, (4, 8)).reshape(-1, 4)
  assert gs.tpu.is_tpu_mesh(mesh) and not gs.tpu.is_tpu_mesh(gs.Mesh((2, 4), ("data", "model")))
  for p, d in enumerate(mesh.devices):
    spec = tf.DeviceSpec.from_string(d)
    assert spec.job == "worker" and spec.device_type == "TPU"
    assert list(topo.device_coordinates[spec.task, spec.device_index]) == list(order[p])
  one_host = gs.tpu_mesh((2, 4), ("data", "model"), topology=V3_8)
  assert all(d.startswith("/job:localhost/replica:0/task:0/device:TPU:") for d in one_host.devices)


@pytest.mark.parametrize("topo_shape,mesh_shape", [(V4_8, (2, 2)), (V3_8, (2, 4)), (V3_32, (4, 8)), (POD_3D, (4, 16))])
def test_device_assignment_lists_the_mesh_devices_coordinates_row_major(topo_shape, mesh_shape):
  topo = gs.tpu.simulated_topology(topo_shape)
  names = tuple(f"a{k}" for k in range(len(mesh_shape)))
  mesh = gs.tpu_mesh(mesh_shape, names, topology=topo)
  da = gs.tpu.device_assignment(mesh, topo)
  assert isinstance(da, tf.tpu.experimental.DeviceAssignment)
  assert da.core_assignment.shape == (1, mesh.size, 4)
  assert da.num_replicas == 1 and da.num_cores_per_replica == mesh.size
  job = tf.DeviceSpec.from_string(mesh.devices[0]).job
  for p in range(mesh.size):
    # TPUStrategy names logical core p's device from the assignment (canonicalized: replica 0): mesh device p
    named = tf.DeviceSpec.from_string(da.tpu_device(0, p, job=job)).replace(replica=0)
    assert named == tf.DeviceSpec.from_string(mesh.devices[p])
    task = tf.DeviceSpec.from_string(mesh.devices[p]).task
    assert da.lookup_replicas(task, p) == [0]
    assert da.host_device(0, p, job=job) == f"/job:{job}/task:{task}/device:CPU:0"


def test_a_mesh_in_the_users_order_keeps_it():
  topo = gs.tpu.simulated_topology(V3_8)
  devices = [f"/job:localhost/replica:0/task:0/device:TPU:{k}" for k in (7, 0, 5, 2, 1, 6, 3, 4)]
  mesh = gs.Mesh((2, 4), ("data", "model"), devices=devices)
  da = gs.tpu.device_assignment(mesh, topo)
  for p, k in enumerate((7, 0, 5, 2, 1, 6, 3, 4)):
    assert list(da.coordinates(0, p)) == list(topo.device_coordinates[0, k])


def test_device_assignment_refuses_meshes_of_other_devices():
  with pytest.raises(gs.MeshError, match="not a mesh of TPU cores"):
    gs.tpu.device_assignment(gs.Mesh((2, 4), ("data", "model")), V3_8)
  mesh = gs.tpu_mesh((2, 4), ("data", "model"), topology=V3_32)   # names task 1.. of a bigger slice
  with pytest.raises(gs.MeshError, match="not in the topology"):
    gs.tpu.device_assignment(gs.Mesh((8,), ("x",), devices=[d.replace("task:0", "task:3") for d in
                                                             gs.tpu_mesh((8,), ("x",), topology=V3_32).devices]),
                             V3_8)
  assert gs.tpu.device_assignment(mesh, V3_32).num_cores_per_replica == 8


# ---- partition ids ---------------------------------------------------------------------------------------------

def test_partition_p_is_mesh_device_p_with_the_bridges_xla_device_ids():
  topo = gs.tpu.simulated_topology(V3_32)
  mesh = gs.tpu_mesh((4, 8), ("data", "model"), topology=topo)
  parts = gs.tpu.partitions(mesh, topo)
  assert [q.partition_id for q in parts] == list(range(32))
  ids = set()
  for p, q in enumerate(parts):
    assert q.device == mesh.devices[p] and q.mesh_coords == tuple(int(c) for c in np.unravel_index(p, (4, 8)))
    x, y, z, core = q.coords
    assert q.xla_device_id == (x + 4 * (y + 4 * z)) * 2 + core   # tpu_rewrite_device_util.cc's location_to_id
    assert q.task == tf.DeviceSpec.from_string(q.device).task
    ids.add(q.xla_device_id)
  assert ids == set(range(32))
  assert gs.tpu.xla_device_id(V3_8, (1, 1, 0, 1)) == 7 and gs.tpu.xla_device_id(V3_8, (1, 0, 0, 0)) == 2


@pytest.mark.parametrize("spec", [P("data", "model"), P("model", None), P(None, ("data", "model")), P("data"),
                                  P(("model", "data"), None), P()])
def test_the_bridge_gives_partition_p_the_tile_of_mesh_device_p(spec):
  """TF's bridge splits an input on the host and sends tile i (row-major over the tile dims) to logical core
  tile_assignment_devices[i]; with logical core p = mesh device p, that is the tile tf_gspmd's Sharding gives
  mesh position p."""
  mesh = gs.tpu_mesh((2, 4), ("data", "model"), topology=V3_8)
  s = Sharding.from_spec(mesh, spec, rank=2)
  proto = s.to_proto()
  assert proto.type == proto.OTHER   # a rank-2 sharding, replicated ones too (as TF's mesh_split writes them)
  dims = list(proto.tile_assignment_dimensions)
  devices = list(proto.tile_assignment_devices)
  assert sorted(devices) == list(range(mesh.size))
  for i, core in enumerate(devices):
    tile = np.unravel_index(i, dims)
    for d in range(2):
      assert tile[d] == s.tile_index(core, d)


# ---- the strategy ------------------------------------------------------------------------------------------------

class _Resolver:
  """Stands in for a TPUClusterResolver (only what the strategy's construction reads)."""

  def __init__(self, names):
    self.names = names

  def get_tpu_system_metadata(self):
    return type("Metadata", (), {"devices": [type("Device", (), {"name": n})() for n in self.names]})()

  def master(self):
    return ""


def test_strategy_arguments_are_tpu_strategys_with_the_mesh_assignment_and_spmd(monkeypatch):
  monkeypatch.setattr(rt, "_RUNNERS", {})   # the strategy built here is remembered for the mesh: not past this test
  topo = gs.tpu.simulated_topology(V3_8)
  mesh = gs.tpu_mesh((2, 4), ("data", "model"), topology=topo)
  resolver = _Resolver([])
  args = gs.tpu.strategy_arguments(mesh, resolver, topo)
  params = inspect.signature(tf.distribute.TPUStrategy.__init__).parameters
  assert set(args) <= set(params)   # the names TF 2.21's TPUStrategy takes
  assert args["tpu_cluster_resolver"] is resolver and args["experimental_spmd_xla_partitioning"] is True
  np.testing.assert_array_equal(args["experimental_device_assignment"].core_assignment,
                                gs.tpu.core_order(topo, (2, 4)).reshape(1, 8, 4))
  built = []
  strategy = gs.tpu.strategy(mesh, resolver, topo, factory=lambda **kw: built.append(kw) or "strategy")
  assert strategy == "strategy" and set(built[0]) == set(args)
  np.testing.assert_array_equal(built[0]["experimental_device_assignment"].core_assignment,
                                args["experimental_device_assignment"].core_assignment)
  assert rt.runner_for(mesh).strategy == "strategy"   # remembered for the mesh


def test_the_job_comes_from_the_resolvers_tpu_devices():
  resolver = _Resolver(["/job:tpu_worker/replica:0/task:0/device:CPU:0",
                        "/job:tpu_worker/replica:0/task:0/device:TPU:0"])
  assert rt.job_of(resolver) == "tpu_worker"
  mesh = gs.tpu_mesh((2, 2), ("a", "b"), topology=V4_8, resolver=resolver)
  assert all(d.startswith("/job:tpu_worker/replica:0/task:0/device:TPU:") for d in mesh.devices)
  with pytest.raises(gs.MeshError, match="no TPU device"):
    rt.job_of(_Resolver(["/job:w/replica:0/task:0/device:CPU:0"]))


# ---- annotated programs --------------------------------------------------------------------------------------------

def _xla_shardings(concrete):
  """{XlaSharding op name: (the tensor it annotates, its OpSharding bytes)} of a traced function."""
  return {op.name: (op.inputs[0].name, op.get_attr("sharding")) for op in concrete.graph.get_operations()
          if op.type == "XlaSharding"}


def _mlp(x, w):
  h = gs.shard(tf.nn.relu(x @ w), P("data", "model"), name="h")
  return {"y": h * 2.0, "total": tf.reduce_sum(h)}


def _inputs():
  rng = np.random.default_rng(0)
  return rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 12)).astype(np.float32)


def test_annotated_program_annotates_arguments_results_and_its_own_annotations_as_xla_sharding_ops():
  mesh = gs.tpu_mesh((2, 4), ("data", "model"), topology=V3_8)
  prog = gs.tpu.annotated_program(_mlp, mesh, (P("data", None), P(None, "model")), P())
  x, w = _inputs()
  concrete = prog.fn.get_concrete_function(x, w)
  found = _xla_shardings(concrete)
  want = lambda spec: Sharding.from_spec(mesh, spec, rank=2).to_proto().SerializeToString()   # noqa: E731
  assert found["arg0_sharding"] == (concrete.inputs[0].name, want(P("data", None)))   # on the argument itself
  assert found["arg1_sharding"] == (concrete.inputs[1].name, want(P(None, "model")))
  assert found["h"][1] == want(P("data", "model"))      # gs.shard inside: an op XLA keeps, over the mesh
  results = {k: v for k, v in found.items() if k.startswith("result")}
  assert len(results) == 2 and all(v[1] == Sharding(mesh).to_proto().SerializeToString() for v in results.values())
  hlo = prog.fn.experimental_get_compiler_ir(x, w)(stage="hlo")
  calls = [line for line in hlo.splitlines() if 'custom_call_target="Sharding"' in line]
  assert len(calls) == 5
  assert any("sharding={devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}" in c for c in calls)
  assert any("sharding={devices=[1,4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}" in c for c in calls)
  assert any("sharding={devices=[2,4]0,1,2,3,4,5,6,7}" in c for c in calls)


def test_an_identity_annotation_would_not_reach_xla_the_sharding_op_does():
  """Why annotated programs trace gs.shard as XlaSharding ops: tf2xla builds no instruction for an Identity, so
  its `_XlaSharding` attribute never reaches the HLO."""
  mesh = gs.Mesh((2, 4), ("data", "model"))

  def f(x):
    return gs.shard(tf.nn.relu(x), P("data", "model"), mesh=mesh) * 2.0

  x = np.ones((8, 8), np.float32)
  plain = tf.function(f, jit_compile=True).experimental_get_compiler_ir(x)(stage="hlo")
  assert "sharding={devices=[2,4]" not in plain

  def g(x):
    with gs._layout.annotations.sharding_ops():  # pylint: disable=protected-access
      return f(x)

  assert "sharding={devices=[2,4]0,1,2,3,4,5,6,7}" in tf.function(g, jit_compile=True).experimental_get_compiler_ir(
      x)(stage="hlo")


def test_runner_runs_the_program_through_strategy_run_with_global_values():
  """A one-device strategy stands in for TPUStrategy: the same `strategy.run` plumbing (arguments whole, results
  whole, the program's structure), the program compiled with its annotations by XLA on one CPU."""
  mesh = gs.tpu_mesh((2, 4), ("data", "model"), topology=V3_8)
  prog = gs.tpu.annotated_program(_mlp, mesh, (P("data", None), P(None, "model")), P())
  runner = gs.tpu.Runner(tf.distribute.OneDeviceStrategy("/cpu:0"), jit_compile=True)
  x, w = _inputs()
  out = runner(prog, x, w)
  h = np.maximum(x @ w, 0)
  np.testing.assert_allclose(out["y"].numpy(), 2 * h, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(out["total"]), h.sum(), rtol=1e-4)
  step = runner.step(prog)
  runner(prog, x + 1, w)
  assert runner.step(prog) is step and len(step._list_all_concrete_functions()) == 1  # pylint: disable=protected-access
  with pytest.raises(gs.InputError, match="takes 2 arguments"):
    runner(prog, x)


@pytest.mark.parametrize("partitioner", ["xla", "tf_gspmd"])
def test_a_gs_function_on_a_tpu_mesh_runs_through_the_strategy(partitioner, monkeypatch):
  """partitioner="xla": the export (every completed layout as XlaSharding) is the program; else the function with
  its completed argument and result layouts. Either way the strategy gets the lowering's shardings."""
  topo = gs.tpu.simulated_topology(V3_8)
  mesh = gs.tpu_mesh((2, 4), ("data", "model"), topology=topo)
  options = {}
  if "partitioner" in inspect.signature(gs.function).parameters:
    options["partitioner"] = partitioner
  elif partitioner == "xla":
    pytest.skip("this gs.function has no partitioner=\"xla\"")
  f = gs.function(_mlp, mesh=mesh, in_shardings=(P("data", None), P(None, "model")), **options)
  x, w = _inputs()
  prog, low = gs.tpu.program(f, x, w)
  assert prog.in_shardings == tuple(low.in_shardings)
  assert tuple(prog.out_shardings) == tuple(low.out_shardings)
  assert low.out_shardings[0].is_replicated and low.out_shardings[1].spec == P("data", "model")   # total, y
  monkeypatch.setattr(rt, "_RUNNERS", {})
  gs.tpu.use_strategy(mesh, tf.distribute.OneDeviceStrategy("/cpu:0"), jit_compile=True)
  out = gs.tpu.run(f, x, w)
  h = np.maximum(x @ w, 0)
  assert set(out) == {"y", "total"}
  np.testing.assert_allclose(out["y"].numpy(), 2 * h, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(out["total"]), h.sum(), rtol=1e-4)
  if partitioner == "xla":   # the default on a TPU mesh: calling the gs.function runs it through the strategy
    got = gs.function(_mlp, mesh=mesh, in_shardings=(P("data", None), P(None, "model")))(x, w)
    np.testing.assert_allclose(got["y"].numpy(), 2 * h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(got["total"]), h.sum(), rtol=1e-4)


def test_initialize_connects_to_a_remote_tpu_only_and_initialises_each_system_once(monkeypatch):
  calls = []
  monkeypatch.setattr(rt, "_INITIALIZED", {})
  monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", lambda r: calls.append(("connect", r.master())))
  monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system",
                      lambda r: calls.append(("init", r.master())) or gs.tpu.simulated_topology(V3_32))
  local, remote = _Resolver(["/job:worker/replica:0/task:0/device:TPU:0"]), _Resolver([])
  remote.master = lambda: "grpc://127.0.0.1:8470"
  assert rt.initialize(local) is rt.initialize(local)
  rt.initialize(remote)
  assert calls == [("init", ""), ("connect", "grpc://127.0.0.1:8470"), ("init", "grpc://127.0.0.1:8470")]
  mesh = gs.tpu_mesh((4, 8), ("data", "model"), resolver=local)   # the topology the TPU system reports
  assert mesh.devices[1] == "/job:worker/replica:0/task:0/device:TPU:1" and len(calls) == 3


# ---- without a TPU: typed errors that say so, and how to simulate one -----------------------------------------

@pytest.mark.parametrize("error", [
    tf.errors.NotFoundError(None, None, "TPUs not found in the cluster. Failed in initialization: No OpKernel was "
                            "registered to support Op 'ConfigureDistributedTPU'"),
    tf.errors.InvalidArgumentError(None, None, "No OpKernel was registered to support Op 'ConfigureDistributedTPU'"),
])
def test_no_tpu_is_a_mesh_error_that_says_how_to_simulate_one(error, monkeypatch):
  monkeypatch.setattr(rt, "_INITIALIZED", {})

  def initialize_tpu_system(resolver):
    raise error

  monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system", initialize_tpu_system)
  for call in (gs.tpu.initialize, lambda: gs.tpu_mesh((2, 4), ("data", "model")),
               lambda: gs.tpu.strategy(gs.tpu_mesh((2, 4), ("data", "model"), topology=V3_8))):
    with pytest.raises(gs.MeshError, match="no TPU is attached") as e:
      call()
    text = str(e.value)
    assert "ConfigureDistributedTPU" in text and "gs.tpu.simulated_topology(" in text
    assert 'partitioner="xla"' in text and "tools/xla_oracle.py" in text
  assert rt._INITIALIZED == {}   # a failed initialisation is not remembered  # pylint: disable=protected-access


def test_an_initialisation_that_fails_otherwise_is_named_as_such(monkeypatch):
  monkeypatch.setattr(rt, "_INITIALIZED", {})
  monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", lambda r: None)

  def initialize_tpu_system(resolver):
    raise tf.errors.UnavailableError(None, None, "connection refused")

  monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system", initialize_tpu_system)
  remote = _Resolver([])
  remote.master = lambda: "grpc://10.0.0.1:8470"
  with pytest.raises(gs.MeshError, match="could not initialise the TPU system at 'grpc://10.0.0.1:8470'.*refused"):
    gs.tpu.initialize(remote)


@pytest.mark.skipif(bool(tf.config.list_logical_devices("TPU")), reason="a TPU is attached")
def test_this_machine_without_a_tpu_raises_the_mesh_error():
  with pytest.raises(gs.MeshError, match="no TPU is attached"):
    gs.tpu.initialize()


def test_a_strategy_needs_a_tpu_mesh_before_anything_is_initialised(monkeypatch):
  monkeypatch.setattr(rt, "initialize", lambda *a: pytest.fail("initialised a TPU for a mesh of CPUs"))
  with pytest.raises(gs.MeshError, match="not a mesh of TPU cores.*simulated_topology"):
    gs.tpu.strategy(gs.Mesh((2, 4), ("data", "model")))
  with pytest.raises(gs.MeshError, match="not a mesh of TPU cores"):
    gs.tpu.run(gs.function(lambda a: a * 2, mesh=gs.Mesh((2, 4), ("data", "model")), partitioner="xla"),
               np.ones((8, 4), np.float32))


@pytest.mark.parametrize("call,msg", [
    (lambda: gs.tpu.simulated_topology((2, 2, 1)), "four positive ints"),
    (lambda: gs.tpu.simulated_topology((2.5, 2, 1, 1)), r"shape=\(2.5, 2, 1, 1\)"),
    (lambda: gs.tpu.simulated_topology(V3_8, chips_per_host=(0, 2, 1)), "chips_per_host"),
    (lambda: gs.tpu.core_order(V3_8, "x"), "mesh_shape='x'"),
    (lambda: gs.tpu.xla_device_id(V3_8, (2, 0, 0, 0)), r"\(2, 0, 0, 0\) is not a core of the topology"),
    (lambda: gs.tpu.xla_device_id(V3_8, (0, 0, 0)), "four ints"),
    (lambda: gs.tpu.is_tpu_mesh("m"), "not a gs.Mesh"),
    (lambda: gs.tpu.use_strategy("m", None), "not a gs.Mesh"),
])
def test_topology_helpers_check_their_arguments(call, msg):
  with pytest.raises(gs.MeshError, match=msg):
    call()
