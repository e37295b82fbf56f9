"""gs.gpu_form: the GPU form of a program lowered without GPUs, every XLA cluster through tf2xla here, and run on the
CPU mesh (clusters without collectives compiled by XLA) against the unpartitioned program."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd._gpu_form import check, gpu_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

MESH = gs.Mesh((2, 4), ("data", "model"))


def _mlp_train(x, t, w1, w2):
  with tf.GradientTape() as tape:
    tape.watch([w1, w2])
    loss = tf.reduce_mean(tf.square(tf.nn.relu(x @ w1) @ w2 - t))
  g1, g2 = tape.gradient(loss, [w1, w2])
  return w1 - 0.1 * g1, w2 - 0.1 * g2, loss


def _mlp_args(rng):
  return [rng.standard_normal(s).astype(np.float32) * k for s, k in
          (((16, 32), 1.0), ((16, 32), 1.0), ((32, 64), 0.2), ((64, 32), 0.2))]


MLP_SPECS = (P("data", None), P("data", None), P(None, "model"), P("model", None))


def test_megatron_step_is_two_clusters_with_every_op_and_all_reduce_inside():
  """Megatron on (data 2, model 4): the model axis's all-reduces and all the compute in one cluster, the data axis's
  gradient all-reduce and the update in the second -- the least tf2xla's one configuration per cluster allows."""
  fn, args, specs = tm.megatron_train_args(tm.Config(layers=2))
  form = gs.gpu_form(gs.function(fn, mesh=MESH, in_shardings=tuple(specs)), *args)
  assert form.jit == "segments" and len(form.clusters) == 2, form.summary()
  assert form.outside_ops == () and form.outside_collectives == (), form.summary()
  first, second = form.clusters
  assert {g for _, g in first.all_reduces} == {4} and len(first.all_reduces) == 8   # 4 per layer
  assert {g for _, g in second.all_reduces} == {2}
  assert form.largest_share == 1.0 and first.arithmetic > 0
  hints = {n.attr["communication_hint"].s for fdef in form.lowered.graph_def.library.function for n in fdef.node_def
           if n.op.startswith("Collective")}
  assert hints == {b"nccl"}


@pytest.mark.parametrize("name", ["mlp_train", "megatron", "conv_halo"])
def test_gpu_form_runs_on_cpus_and_equals_the_unpartitioned_program(name, rng):
  """Run what can run: clusters without collectives compiled by XLA on CPU, the others in TF's executor."""
  if name == "mlp_train":
    fn, args, mesh, specs = _mlp_train, _mlp_args(rng), MESH, MLP_SPECS
  elif name == "megatron":
    fn, args, specs = tm.megatron_train_args(tm.Config(layers=2))
    mesh = MESH
  else:
    def fn(x, k):
      return tf.nn.conv2d(tf.nn.relu(tf.nn.conv2d(x, k, 1, "SAME")), k, 1, "SAME")
    args = [rng.standard_normal((2, 32, 16, 4)).astype(np.float32), rng.standard_normal((3, 3, 4, 4)).astype(
        np.float32) * 0.3]
    mesh, specs = gs.Mesh((4, 2), ("rows", "cols")), (P(None, "rows", None, None), P())
  form = gs.gpu_form(gs.function(fn, mesh=mesh, in_shardings=tuple(specs)), *args)
  got = tf.nest.flatten(form.run(*args))
  want = tf.nest.flatten(tf.function(fn)(*[tf.constant(a) for a in args]))
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert_close(np.asarray(g), w.numpy(), rtol=2e-4, atol=2e-4)
  if name == "conv_halo":   # the halo's permutes run between clusters, each compiled by XLA on CPU here
    assert form.outside_collectives and all(not c.collectives for c in form.clusters)


def _planned(fn, specs, shapes, jit_compile=False):
  f = gs.function(fn, mesh=gpu_mesh(MESH), in_shardings=specs, jit_compile=jit_compile)
  return f.lower(*[tf.TensorSpec(s) for s in shapes])


def test_two_group_configurations_in_one_cluster_fail():
  low = _planned(lambda x, w: tf.reduce_sum(x @ w), (P("data", "model"), P("model", None)), ((16, 32), (32, 8)))
  low.program = low.program.replace(jit="whole")   # the program compiled whole: model- and data-axis all-reduces
  with pytest.raises(gs.GpuFormError, match=r"XLA cluster whole holds all-reduces of 2 group configurations"):
    check(low)


def test_an_all_reduce_whose_group_is_not_its_mesh_group_fails():
  low = _planned(lambda x, w: x @ w, (P(None, "model"), P("model", None)), ((16, 32), (32, 8)))
  gd = tf.compat.v1.GraphDef()
  gd.CopyFrom(low.program.local_graph_def)
  nodes = {n.name: n for n in gd.node}
  (reduce,) = [n for n in gd.node if n.op == "CollectiveReduceV2"]
  nodes[reduce.input[1]].attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.int32(2)))
  low.program = low.program.replace(jit="whole", local_graph_def=gd)
  with pytest.raises(gs.GpuFormError, match=r"has replica groups of 2 in XLA, its mesh group has 4 members"):
    check(low)


def test_a_cluster_tf2xla_cannot_lower_fails():
  low = _planned(lambda x: tf.reduce_max(x, axis=0), (P("data", None),), ((16, 8),))   # a max all-reduce
  assert any(n.op == "CollectiveReduceV2" and n.attr["merge_op"].s == b"Max" for n in low.program.local_graph_def.node)
  low.program = low.program.replace(jit="whole")
  with pytest.raises(gs.GpuFormError, match=r"XLA cluster whole does not lower with tf2xla"):
    check(low)


def test_collectives_in_no_one_order_fail():
  low = _planned(lambda x, y: (tf.reduce_max(x, 0), tf.reduce_max(y, 0)), (P("data", None), P("model", None)),
                 ((16, 8), (16, 8)), jit_compile=True)   # two max all-reduces, independent: outside XLA, chained
  gd = tf.compat.v1.GraphDef()
  gd.CopyFrom(low.program.local_graph_def)
  collectives = {n.name for n in gd.node if n.op.startswith("Collective")}
  assert len(collectives) == 2
  for n in gd.node:   # the ordering pass's chain taken out
    if n.name in collectives:
      keep = [i for i in n.input if not (i.startswith("^") and i[1:] in collectives)]
      del n.input[:]
      n.input.extend(keep)
  low.program = low.program.replace(local_graph_def=gd)
  with pytest.raises(gs.GpuFormError, match=r"devices could launch their collectives in different orders"):
    check(low)


def test_a_cpu_lowering_is_a_typed_error():
  low = gs.function(lambda x: x * 2.0, mesh=MESH, in_shardings=P("data")).lower(tf.TensorSpec([8]))
  with pytest.raises(gs.InputError, match=r"this lowering is for a CPU mesh: lower the function for a mesh of GPUs"):
    gs.gpu_form(low)


def test_every_reference_program_binary_and_keras_hub_step_passes():
  """tools/gpu_form.py: the oracle's programs (the ten workloads among them), the three binaries' steps and a
  keras-hub model's train step."""
  pytest.importorskip("keras_hub")
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_form.py")], capture_output=True, text=True,
                       timeout=1200, check=False)
  lines = out.stdout.strip().splitlines()
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert lines[-1] == f"gpu form: {len(lines) - 1} programs checked, {len(lines) - 1} pass", lines[-1]
  assert len(lines) - 1 >= 22
  names = {line.split()[0] for line in lines[:-1]}
  assert {"mlp_megatron", "transformer_megatron", "conv_halo", "train_transformer", "train_convnet", "train_moe",
          "keras_hub_gemma_train_step"} <= names


def test_the_gpu_check_script_checks_its_own_set_up_without_a_gpu():
  """tools/gpu_check.py --dry_run: every program planned for GPUs and its GPU form checked; two run on CPUs in both
  modes against one device."""
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--dry_run",
                        "--only=mlp_megatron,attention"], capture_output=True, text=True, timeout=900, check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "no GPU: dry run" in out.stdout and out.stdout.strip().endswith("all checks passed")
  planned = [line for line in out.stdout.splitlines() if "GPU plan x4" in line]
  assert len(planned) >= 2 * 12 and all("GPU form checked" in line or "planned, GPU form checked" in line
                                        for line in planned), planned
  ran = [line for line in out.stdout.splitlines() if " CPU x4 " in line]   # progress lines and the table's rows
  assert len(ran) == 8 and all(line.rstrip().endswith("matches") for line in ran), ran
