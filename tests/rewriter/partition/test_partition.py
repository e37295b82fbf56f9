"""The partition pass and the pass manager: the per-device program's nodes, shapes and invariants."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.errors import PartitionError
from tf_gspmd.rewriter.backend import cleanup
from tf_gspmd.rewriter import pipeline
from tf_gspmd.rewriter.graph.tables import PARTITION_ID

MESH = gs.Mesh((2, 4), ("data", "model"))


def _megatron():
  def mlp(x, w1, w2):
    return tf.nn.gelu(x @ w1) @ w2

  f = gs.function(mlp, mesh=MESH, in_shardings=(P("data", None), P(None, "model"), P("model", None)),
                  out_shardings=P("data", None))
  return f.lower(tf.TensorSpec([64, 1024]), tf.TensorSpec([1024, 4096]), tf.TensorSpec([4096, 1024]))


def _local_shapes(graph_def):
  g = tf.Graph()
  with g.as_default():
    tf.graph_util.import_graph_def(graph_def, name="")
  return {op.name: [tuple(t.shape.as_list()) for t in op.outputs] for op in g.get_operations()}, g


def test_local_program_nodes_and_shapes():
  low = _megatron()
  shapes, g = _local_shapes(low.graph_def)
  assert shapes["x"] == [(32, 1024)] and shapes["w1"] == [(1024, 1024)] and shapes["w2"] == [(1024, 1024)]
  assert shapes["matmul"] == [(32, 1024)] and shapes["matmul_1"] == [(32, 1024)]
  ops = [op.type for op in g.get_operations()]
  assert ops.count("CollectiveReduceV2") == 1 and ops.count("MatMul") == 2
  assert PARTITION_ID in shapes
  coll = next(op for op in g.get_operations() if op.type == "CollectiveReduceV2")
  assert coll.name.startswith("matmul_1/gspmd/")


def test_pipeline_is_one_list_and_times_every_pass():
  names = [name for name, _ in pipeline.PASSES]
  assert names == ["trace", "grappler", "import_annotations", "auto_shard", "complete", "weight_update_sharding",
                   "xla_export", "partition", "combine", "cleanup", "verify", "memory", "compile",
                   "optimize", "constants", "in_process", "fuse", "checks", "order", "schedules", "device_program"]
  for path, passes in pipeline.PATHS.items():   # each path a selection of the list, in its order
    assert list(passes) == [n for n in names if n in passes], path
  low = _megatron()
  assert pipeline.path_of(low.program) == pipeline.ONE_GRAPH
  assert list(low.report.pass_times) == list(pipeline.PATHS[pipeline.ONE_GRAPH])
  # On CPU devices TF's graph optimizer ran once on the per-device program; the runtime does not run it again.
  assert low.program.locally_optimized


def test_dump_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("TF_GSPMD_DUMP_DIR", str(tmp_path))
  _megatron()
  files = sorted(os.listdir(tmp_path))
  assert files[0] == "00_trace.pbtxt" and "07_partition.pbtxt" in files and "12_compile.pbtxt" in files


def test_verify_rejects_foreign_collective():
  low = _megatron()
  gd = tf.compat.v1.GraphDef()
  gd.CopyFrom(low.graph_def)
  for n in gd.node:
    if n.op == "CollectiveReduceV2":
      n.name = "user_all_reduce"
  with pytest.raises(PartitionError, match="not built by the partitioner"):
    cleanup.verify(low.program.replace(local_graph_def=gd))


def test_cleanup_drops_dead_nodes():
  f = gs.function(lambda x: (tf.exp(x), x * 3.0)[0], mesh=MESH, in_shardings=P("data"))
  low = f.lower(tf.TensorSpec([8, 8]))
  assert "Mul" not in {n.op for n in low.graph_def.node}


def test_plan_a_large_mesh_without_devices():
  mesh = gs.Mesh((32, 64), ("data", "model"))
  f = gs.function(lambda x, w: x @ w, mesh=mesh, in_shardings=(P("data", "model"), P("model", None)))
  low = f.lower(tf.TensorSpec([256, 1024]), tf.TensorSpec([1024, 512]))
  assert low.report.counts() == {"all-reduce": 1}
  (c,) = low.report.collectives
  assert c.group_size == 64 and c.shape == (8, 512)


def test_collective_deadline_raises_instead_of_hanging():
  """A program whose peers never arrive fails with DeadlineExceededError (in a subprocess: aborts poison)."""
  script = textwrap.dedent("""
      import tensorflow as tf
      import tf_gspmd as gs
      gs.split_cpu_devices(8)
      from tensorflow.python.distribute.parallel_device import parallel_device
      from tf_gspmd import P
      mesh = gs.Mesh((8,), ("x",))
      f = gs.function(lambda t: tf.reduce_sum(t), mesh=mesh, in_shardings=P("x"), collective_timeout=2.0)
      exe = f.lower(tf.TensorSpec([8])).executable()
      # Run the 8-device program on only half of the devices: the all-reduce can never complete.
      pd = parallel_device.ParallelDevice(list(exe.devices[:4]))
      comps = []
      for p, d in enumerate(exe.devices[:4]):
        with tf.device(d):
          comps.append((tf.constant(p), tf.constant([1.0])))
      try:
        exe.run_packed(pd, pd.pack([c[0] for c in comps]), [pd.pack([c[1] for c in comps])])
      except tf.errors.DeadlineExceededError as e:
        print("DEADLINE", type(e).__name__)
      """)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
  assert "DEADLINE" in out.stdout, out.stdout + out.stderr[-3000:]
