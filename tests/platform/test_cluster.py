"""Several processes: gs.initialize, meshes over every process's devices, the launcher, and a training step on
TF's distributed runtime (2 processes x 4 CPUs, 4 x 2) that matches one process x 8 CPUs.

Multi-process runs are subprocesses on 127.0.0.1 with timeouts, so a hang fails the test instead of the suite.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd._platform import cluster as _cluster
from tf_gspmd._layout import mesh as _mesh
from tf_gspmd import launch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROGRAMS = os.path.join(os.path.dirname(__file__), "..", "cluster_programs")
sys.path.insert(0, PROGRAMS)
import megatron_step  # noqa: E402  pylint: disable=g-import-not-at-top
import cluster_runs  # noqa: E402  pylint: disable=g-import-not-at-top

MESH = gs.Mesh((2, 4), ("data", "model"))


_env = cluster_runs.env
_launch = cluster_runs.launch


def test_device_order_is_processes_major():
  names = ["/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/replica:0/task:0/device:CPU:1",
           "/job:chief/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:10/device:CPU:0",
           "/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:2/device:CPU:0"]
  assert sorted(names, key=_mesh.device_order) == [names[2], names[4], names[1], names[0], names[5], names[3]]


def test_one_process_is_a_cluster_of_one():
  assert gs.process_count() == 1 and gs.process_index() == 0
  assert gs.local_devices(MESH) == MESH.resolve_devices()


def test_split_cpu_devices_sizes_the_intra_op_pool_to_the_cores_per_device():
  cores = len(os.sched_getaffinity(0))
  assert tf.config.threading.get_intra_op_parallelism_threads() == max(1, cores // len(gs.local_devices(MESH)))
  # A size the process chose itself is kept; an explicit one is applied.
  code = ("import tensorflow as tf, tf_gspmd as gs; tf.config.threading.set_intra_op_parallelism_threads(3); "
          "gs.split_cpu_devices(4); print('CHOSEN', tf.config.threading.get_intra_op_parallelism_threads())")
  explicit = ("import tensorflow as tf, tf_gspmd as gs; gs.split_cpu_devices(4, intra_op_threads=2); "
              "print('CHOSEN', len(tf.config.list_logical_devices('CPU')), "
              "tf.config.threading.get_intra_op_parallelism_threads())")
  for snippet, want in ((code, "CHOSEN 3"), (explicit, "CHOSEN 4 2")):
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120, env=_env(),
                         cwd=ROOT, check=False)
    assert want in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_jobs_other_than_chief_and_worker_are_refused():
  spec = tf.train.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]})
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=0)
  with pytest.raises(gs.MeshError, match=r"jobs \['ps'\].*no parameter servers"):
    gs.initialize(resolver)


def test_process_local_data_in_one_process_is_the_whole_value(rng):
  x = rng.standard_normal((10, 6)).astype(np.float32)   # 10 rows over 2: uneven shards stay exact
  t = gs.from_process_local_data(x, MESH, gs.P("data", "model"))
  assert t.is_fully_addressable and t.shape == (10, 6) and t.sharding.spec == gs.P("data", "model")
  np.testing.assert_array_equal(t.numpy(), x)
  f = gs.function(lambda a: a * 2.0, mesh=MESH, in_shardings=gs.P("data", "model"))
  np.testing.assert_array_equal(f(t).numpy(), x * 2.0)   # used in place
  with pytest.raises(gs.InputError, match=r"does not fit.*pass exactly that block \(shape \(10, 6\)\)"):
    gs.from_process_local_data(x[:7], MESH, gs.P("data", None), global_shape=(10, 6))


def test_launcher_forwards_output_and_exits_with_the_failing_worker_status():
  code = ("import json, os, sys; k = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
          "print('hello from', k, os.environ['TF_GSPMD_CPU_DEVICES_PER_PROCESS']); sys.exit(3 if k == 1 else 0)")
  out = subprocess.run([sys.executable, "-m", "tf_gspmd.launch", "--workers=2", "--devices_per_worker=4", "--",
                        sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env(),
                       check=False)
  assert out.returncode == 3
  assert "[worker 0] hello from 0 4" in out.stdout and "[worker 1] hello from 1 4" in out.stdout
  assert "[launch] worker 1 exited with status 3" in out.stdout
  envs = launch.worker_envs(3)
  configs = [json.loads(e["TF_CONFIG"]) for e in envs]
  hosts = configs[0]["cluster"]["worker"]
  assert len(set(hosts)) == 3 and all(h.startswith("127.0.0.1:") for h in hosts)
  assert [c["task"]["index"] for c in configs] == [0, 1, 2] and all(c["cluster"]["worker"] == hosts for c in configs)


_JOIN = """
import json, os, sys, time
import tf_gspmd as gs
print("JOINING", flush=True)
start = time.monotonic()
try:
  gs.initialize(join_timeout=float(sys.argv[1]))
  print("JOINED", flush=True)
except gs.ClusterJoinError as e:
  print("ERROR " + json.dumps({"type": type(e).__name__, "message": str(e), "missing": list(e.missing),
                               "mesh_error": isinstance(e, gs.MeshError), "took": time.monotonic() - start}),
        flush=True)
"""


def _alone(index, join_timeout):
  """Task `index` of a 2-worker TF_CONFIG, started without the other task."""
  env = launch.worker_envs(2, base=_env())[index]
  return subprocess.Popen([sys.executable, "-c", _JOIN, str(join_timeout)], env=env, cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL), json.loads(env["TF_CONFIG"])


def test_initialize_with_a_missing_peer_fails_in_time_naming_it():
  # Task 0 (the coordination leader) waits for task 1; task 1 waits for the leader. Both run at once.
  runs = [_alone(k, 15) for k in (0, 1)]
  for k, (proc, config) in enumerate(runs):
    try:
      out, _ = proc.communicate(timeout=120)
    finally:
      proc.kill()
    lines = [l for l in out.splitlines() if l.startswith("ERROR ")]
    assert lines, out[-2000:]
    e = json.loads(lines[0][6:])
    other = 1 - k
    assert e["type"] == "ClusterJoinError" and e["mesh_error"], e
    assert e["missing"] == [f"/job:worker/replica:0/task:{other}"], e
    address = config["cluster"]["worker"][other]
    assert f"task(s) worker:{other} ({address}) did not connect" in e["message"], e
    assert "join_timeout=15 s" in e["message"] and "Start every process" in e["message"], e
    assert e["took"] < 15 + 10, e


def test_sigterm_while_waiting_for_a_missing_peer_stops_initialize_at_once():
  # Both tasks alone (each its own cluster of two whose other task never starts), join_timeout far away: SIGTERM
  # a few seconds in ends the wait within seconds with ClusterJoinError naming the task waited for.
  runs = [_alone(k, 120) for k in (0, 1)]
  for k, (proc, config) in enumerate(runs):
    try:
      assert proc.stdout.readline().strip() == "JOINING"
      time.sleep(5)
      proc.send_signal(signal.SIGTERM)
      sent = time.monotonic()
      out, _ = proc.communicate(timeout=30)
      took = time.monotonic() - sent
    finally:
      proc.kill()
    assert took < 5, took
    lines = [l for l in out.splitlines() if l.startswith("ERROR ")]
    assert lines, out[-2000:]
    e = json.loads(lines[0][6:])
    assert e["type"] == "ClusterJoinError" and "SIGTERM" in e["message"], e
    assert e["missing"] == [f"/job:worker/replica:0/task:{1 - k}"], e


@pytest.mark.parametrize("text,match", [
    ("{'cluster': 1", r"TF_CONFIG is not valid JSON"),
    ("[1, 2]", r"TF_CONFIG is a JSON list, not an object"),
    ('{"cluster": {"worker": "127.0.0.1:1"}, "task": {"type": "worker", "index": 0}}', r"\"cluster\" must map"),
    ('{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker"}}', r"\"task\" must give"),
])
def test_malformed_tf_config_is_named(monkeypatch, text, match):
  monkeypatch.setenv("TF_CONFIG", text)
  with pytest.raises(gs.MeshError, match=match) as e:
    gs.initialize()
  assert e.value.node == "TF_CONFIG" and '"task": {"type": "worker", "index": 0}' in str(e.value)


@pytest.mark.parametrize("timeout", [0, -1, float("nan")])
def test_initialize_timeouts_must_be_positive(timeout):
  with pytest.raises(gs.MeshError, match="join_timeout=.*positive number of seconds"):
    gs.initialize(join_timeout=timeout)


@pytest.fixture(scope="module")
def one_process():
  """The step in this process on 8 CPUs: what every multi-process run must reproduce."""
  return megatron_step.train(gs, tf, MESH, 3)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  ckpt = tmp_path_factory.mktemp("two_processes")
  return _launch(2, "megatron_step.py", "--steps=3", f"--save={ckpt}"), ckpt


def test_two_processes_match_one(one_process, two_processes):
  results, _ = two_processes
  for k, r in results.items():
    assert r["processes"] == 2
    assert r["local"] == [f"/job:worker/replica:0/task:{k}/device:CPU:{i}" for i in range(4)]
    np.testing.assert_allclose(r["losses"], one_process["losses"], rtol=1e-5)
    assert r["h_local"] is False   # split over both processes: .numpy() gathered it
    assert r["batch_local"] is False   # each process passed its own rows only
    for key in ("h_sum", "w1", "w2"):   # the same global values in every process
      np.testing.assert_allclose(r[key], one_process[key], rtol=1e-5)


def test_two_processes_through_tf_collectives_on_every_device_match_one(one_process):
  """The step with exchange="collectives": each device's program on its own thread, TF's collectives within each
  process and across."""
  for r in _launch(2, "megatron_step.py", "--steps=3", exchange="collectives").values():
    np.testing.assert_allclose(r["losses"], one_process["losses"], rtol=1e-5)
    for key in ("h_sum", "w1", "w2"):
      np.testing.assert_allclose(r[key], one_process[key], rtol=1e-5)


def test_checkpoint_of_two_processes_restores_anywhere(one_process, two_processes):
  results, ckpt = two_processes
  prefix = results[0]["saved"]
  reader = tf.train.load_checkpoint(prefix)   # plain TF reads the global tensors
  w1 = reader.get_tensor("w1/.ATTRIBUTES/VARIABLE_VALUE")
  assert w1.shape == (32, 64)
  np.testing.assert_allclose(np.abs(w1).sum(), one_process["w1"], rtol=1e-5)
  plain = tf.Variable(tf.zeros([64, 30]))   # into a plain single-device variable
  tf.train.Checkpoint(w2=plain).restore(prefix).expect_partial()
  np.testing.assert_allclose(np.abs(plain.numpy()).sum(), one_process["w2"], rtol=1e-5)
  here = megatron_step.train(gs, tf, MESH, 1, restore=prefix)   # onto 1 process x 8, then a step
  four = _launch(4, "megatron_step.py", "--steps=1", f"--restore={prefix}")   # onto 4 processes x 2
  for r in four.values():
    for key in ("restored_w1", "restored_w2", "losses", "w1", "w2"):
      np.testing.assert_allclose(r[key], here[key], rtol=1e-5)
  np.testing.assert_allclose(here["restored_w1"], one_process["w1"], rtol=1e-5)


@pytest.mark.parametrize("exchange", ["auto", "collectives"])
def test_keras_fit_with_model_parallel_over_two_processes_matches_one(exchange):
  """keras.distribution.initialize() joins the launcher's cluster; list_devices spans both processes. Each process
  runs its devices as one graph, or (collectives) each device's program on its own thread."""
  keras = pytest.importorskip("keras")
  import keras_fit  # pylint: disable=g-import-not-at-top
  import tf_gspmd.keras  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  want = keras_fit.fit(keras)
  results = _launch(2, "keras_fit.py", devices_per_worker=4, timeout=420, exchange=exchange)
  for r in results.values():
    assert r["processes"] == 2 and len(r["losses"]) == 8
    np.testing.assert_allclose(r["losses"], want["losses"], rtol=1e-5)
    np.testing.assert_allclose(r["evaluate"], want["evaluate"], rtol=1e-5)
    # One process sums in one order (in-process), two in the ring's: near-zero weights differ at float32 rounding
    # of the largest ones.
    np.testing.assert_allclose(r["weights"], want["weights"], rtol=1e-5, atol=1e-6 * np.abs(want["weights"]).max())


import sharded_checkpoint  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope="module")
def shared_save(tmp_path_factory):
  directory = tmp_path_factory.mktemp("shared_save")
  return _launch(2, "sharded_checkpoint.py", f"--save={directory}"), directory


def test_each_process_writes_its_own_tiles_into_one_checkpoint(shared_save):
  """Every process makes the same CheckpointManager.save; each writes the distinct tiles whose lowest device is
  its own (process 1 holds half of `a`'s rows; `b` and the unsplit values are the chief's), the chief merges."""
  results, directory = shared_save
  assert results[0]["saved"] == results[1]["saved"] == tf.train.latest_checkpoint(str(directory))
  assert not [f for f in os.listdir(directory) if f.endswith("_temp")]   # the parts were merged and removed
  a_bytes = sharded_checkpoint.ROWS * 2048 * 4
  assert results[1]["owned_bytes"] == a_bytes // 2   # its half of a; b's tiles have their lowest device on process 0
  for r in results.values():
    assert abs(r["bytes_written"] - r["owned_bytes"]) <= 0.05 * r["owned_bytes"], r
    # No gather: growth is a fraction of its own tiles, plus the checkpoint writer's fixed buffers (~9 MiB).
    assert r["growth"] <= 0.25 * r["owned_bytes"] + (12 << 20), r
  assert results[0]["checksums"] == results[1]["checksums"]


def test_a_shared_checkpoint_restores_onto_one_process_four_processes_and_plain_tf(shared_save):
  results, _ = shared_save
  prefix, want = results[0]["saved"], results[0]["checksums"]
  reader = tf.train.load_checkpoint(prefix)   # plain TF: whole values
  plain = [reader.get_tensor(f"{k}/.ATTRIBUTES/VARIABLE_VALUE") for k in "abcn"]
  assert plain[0].shape == (sharded_checkpoint.ROWS, 2048) and plain[1].shape == (40, 30)
  got = sharded_checkpoint.checksums([type("V", (), {"numpy": lambda self, x=x: x})() for x in plain])
  assert got == want
  here = sharded_checkpoint.build(gs, tf, gs.Mesh((1, 8), ("data", "model")), init=False)   # 1 process x 8
  tf.train.Checkpoint(a=here[0], b=here[1], c=here[2], n=here[3]).read(prefix).assert_existing_objects_matched()
  assert sharded_checkpoint.checksums(here) == want
  four = _launch(4, "sharded_checkpoint.py", f"--restore={prefix}", "--mesh=4,2")   # 4 processes x 2
  for r in four.values():
    assert r["checksums"] == want and r["a_spec"] == "P('data', 'model')"


def test_processes_saving_to_different_paths_all_raise_input_error(tmp_path):
  results = _launch(2, "sharded_checkpoint.py", f"--save={tmp_path}", "--own_directory")
  for r in results.values():
    assert "different paths" in r["error"] and "process_0" in r["error"] and "process_1" in r["error"], r
  assert not list(tmp_path.glob("process_*/ckpt*"))


@pytest.mark.parametrize("workers", [2, 4])
def test_collectives_across_processes_in_two_levels_match_the_unpartitioned_program(workers):
  """All-reduces (several dtypes, padded flat sizes), all-gathers and reduce-scatters whose groups have several
  members in every process run in two levels and give the unpartitioned program's results in every process."""
  results = _launch(workers, "hierarchical.py", timeout=420)
  for r in results.values():
    assert r["processes"] == workers
    for name, case in r["cases"].items():
      loose = "16" in name   # half-precision sums, rounded in another order
      np.testing.assert_allclose(np.asarray(case["got"]), np.asarray(case["want"]), rtol=1e-2 if loose else 1e-5,
                                 atol=1e-2 if loose else 1e-5, err_msg=name)
      if not name.startswith("b_axis"):   # the groups over d, and over both axes of (2, 4), span the processes
        assert ["across", True] in case["levels"] and ["within", False] in case["levels"], name
    two_levels = ["across", True] in r["cases"]["b_axis_sum"]["levels"]
    assert two_levels == (workers == 4)   # axis b joins 2 processes of 2 members only when there are 4


@pytest.mark.parametrize("workers", [2, 4])
def test_one_graph_per_process_runs_each_collective_across_processes_as_one_op(workers):
  """exchange "auto" over several processes: each process runs its devices as one graph, in which a collective
  across processes (one member in each process; the across level of one in two levels; an all-to-all with several
  members in each) is one TF collective of the stacked operand, and a collective-permute's transfer across
  processes TF's op on its device, issued in one order in every process. Every result is the unpartitioned
  program's, call after call (50 calls of a program with five independent collectives across processes)."""
  results = _launch(workers, "one_graph.py", timeout=420)
  sequences = {}
  for r in results.values():
    assert r["processes"] == workers
    for name, case in r["cases"].items():
      loose = "16" in name
      np.testing.assert_allclose(np.asarray(case["got"]), np.asarray(case["want"]), rtol=1e-2 if loose else 1e-5,
                                 atol=1e-2 if loose else 1e-5, err_msg=name)
      assert case["again"] == case["got"], name
      assert case["one_graph"], name
      # one TF collective per collective across processes (a permute: its transfers), ordered by the graph's edges
      want = {"a_axis_several": 5, "reduce_scatter": 2}.get(name, 1) if case["kinds"] else 0
      assert len(case["sequence"]) == want, (name, case)
      sequences.setdefault(name, set()).add(tuple(case["sequence"]))
  assert all(len(s) == 1 for s in sequences.values()), sequences   # the same order in every process
  assert "a_axis_several" in sequences and "both_axes_sum" in sequences


import keras_weights_file  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope="module")
def shared_weights_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("shared_weights") / "model.weights.h5"
  return _launch(2, "keras_weights_file.py", f"--save={path}", devices_per_worker=4), path


def test_a_keras_weights_file_saved_by_two_processes_loads_in_one_process_and_in_plain_keras(shared_weights_file):
  """`save_weights` in both processes of 2 x 4 (kernels and their Adam moments split over both): one file, which
  process 0 wrote from both processes' tiles (no part left); it loads with another layout in one process, and in
  plain Keras, to the saved values."""
  keras = pytest.importorskip("keras")
  import tf_gspmd.keras  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  results, path = shared_weights_file
  want = results[0]["values"]
  assert results[1]["values"] == want and results[0]["up_spec"] == "P('batch', 'model')"
  assert sorted(os.listdir(path.parent)) == ["model.weights.h5"]
  for distributed in (True, False):
    model, _ = keras_weights_file.build(keras, other_layout=True, distributed=distributed)
    model.load_weights(str(path))
    assert keras_weights_file.values(model) == want, distributed


def test_a_keras_weights_file_saved_by_one_process_loads_in_two(tmp_path):
  """The other way: a file saved in one process (mesh (2,4) of its 8 devices) loads in both processes of 2 x 4
  with another layout, each reading the slices it keeps."""
  keras = pytest.importorskip("keras")
  import tf_gspmd.keras  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  model, dist = keras_weights_file.build(keras)
  rng = np.random.default_rng(0)
  with dist.scope():
    model.fit(rng.standard_normal((8, keras_weights_file.D_IN)).astype(np.float32),
              rng.standard_normal((8, keras_weights_file.D_OUT)).astype(np.float32), batch_size=8, epochs=1,
              verbose=0)
  path = tmp_path / "one.weights.h5"
  model.save_weights(str(path))
  want = keras_weights_file.values(model)
  results = _launch(2, "keras_weights_file.py", f"--load={path}", "--other_layout", devices_per_worker=4)
  for r in results.values():
    assert r["values"] == want and r["up_spec"] == "P('model', 'batch')"


def test_processes_saving_a_weights_file_to_different_paths_or_an_archive_all_raise_input_error(tmp_path):
  results = _launch(2, "keras_weights_file.py", f"--save={tmp_path / 'm.weights.h5'}", "--own_path", "--archive",
                    devices_per_worker=4)
  for r in results.values():
    assert "different paths" in r.get("error", ""), r
    assert "whose tiles are in several processes" in r.get("archive_error", ""), r
  assert not list(tmp_path.glob("*gspmd-part*"))


@pytest.mark.parametrize("n", [0, -1, 2.5, "8", True])
def test_split_cpu_devices_takes_a_positive_whole_number(n):
  # 0 would configure no CPU at all (TF: "No CPU devices are available"); "8" and 2.5 would multiply a list.
  with pytest.raises(gs.MeshError, match=rf"n={n!r} is not a positive whole number.*give 1 or more"):
    gs.split_cpu_devices(n)
  with pytest.raises(gs.MeshError, match="intra_op_threads=0"):
    gs.split_cpu_devices(8, intra_op_threads=0)


@pytest.mark.parametrize("cpu_devices", [0, -8, 2.5, "8"])
def test_initialize_refuses_a_cpu_device_count_it_cannot_split(cpu_devices):
  with pytest.raises(gs.MeshError, match=rf"cpu_devices={cpu_devices!r} is not a positive whole number"):
    gs.initialize(cpu_devices=cpu_devices)   # (0 used to be ignored)
  assert gs.process_count() == 1   # nothing was joined


@pytest.mark.parametrize("value", ["-3", "0", "four"])
def test_initialize_names_a_bad_launcher_device_count(monkeypatch, value):
  monkeypatch.setenv(_cluster.DEVICES_ENV, value)
  with pytest.raises(gs.MeshError, match=rf"{_cluster.DEVICES_ENV}='{value}'.*--devices_per_worker"):
    gs.initialize()


def test_initialize_and_device_queries_name_what_is_not_a_resolver_mesh_or_device():
  with pytest.raises(gs.MeshError, match="cluster_resolver='x'.*ClusterResolver"):
    gs.initialize("x")
  with pytest.raises(gs.MeshError, match="5 is not a device"):
    gs.is_local(5)
  with pytest.raises(gs.MeshError, match="'garbage' is not a device name"):
    gs.is_local("garbage")
  with pytest.raises(gs.MeshError, match="give a gs.Mesh"):
    gs.local_devices("mesh")
