"""The compile pass: XLA segments between collectives on CPU, whole-program checks for GPU and TPU meshes."""

import logging

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import kernels

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.backend import jit
from tf_gspmd.rewriter.collectives import vocabulary

MESH = gs.Mesh((2, 4), ("data", "model"))
COLLECTIVES = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2")


def _mlp_with_state(v):
  def f(x, w2):
    h = tf.nn.relu(x @ gs.shard(v, P(None, "model")) + 1.0)
    y = tf.tanh(h @ w2) * 2.0
    v.assign_add(tf.ones_like(v) * 0.01)
    return tf.reduce_sum(y, axis=1), y
  return f


def test_cpu_segments_compile_between_collectives_and_match(rng):
  x = rng.standard_normal((16, 32)).astype(np.float32)
  w1 = rng.standard_normal((32, 64)).astype(np.float32)
  w2 = rng.standard_normal((64, 32)).astype(np.float32)
  results = {}
  for mode in (True, False):
    v = tf.Variable(w1)
    g = gs.function(_mlp_with_state(v), mesh=MESH, in_shardings=(P("data", None), P("model", None)),
                    jit_compile=mode)
    low = g.lower(tf.TensorSpec(x.shape), tf.TensorSpec(w2.shape))
    calls = [n for n in low.graph_def.node if n.op == "StatefulPartitionedCall"]
    if mode:
      assert low.program.jit == "segments" and len(calls) >= 2
      lib = {f.signature.name: f for f in low.graph_def.library.function}
      for call in calls:
        body = lib[call.attr["f"].func.name]
        assert body.attr["_XlaMustCompile"].b
        assert not any(n.op in COLLECTIVES for n in body.node_def)   # XLA on CPU refuses collectives
      outer = [n.op for n in low.graph_def.node]
      assert "CollectiveReduceV2" in outer
    else:
      assert low.program.jit is None and not calls
    results[mode] = [t.numpy() for t in g(x, w2)] + [v.numpy()]
  v = tf.Variable(w1)
  want = [t.numpy() for t in _mlp_with_state(v)(x, w2)] + [v.numpy()]
  for got in results.values():
    for a, b in zip(got, want):
      assert_close(a, b, rtol=1e-4, atol=1e-4)


def _blocks(scales):
  def f(x, *ws):
    for scale, (w1, w2) in zip(scales, zip(ws[::2], ws[1::2])):
      x = tf.tanh(tf.nn.relu(x @ w1) @ w2) * scale + x
    return x
  return f


def test_segments_that_compute_the_same_share_one_function(rng):
  """Repeated layers call one XLA function; a layer that differs (a constant) gets its own; results unchanged."""
  scales = (0.5, 0.5, 0.5, 0.25)
  x = rng.standard_normal((16, 32)).astype(np.float32)
  ws = [rng.standard_normal(s).astype(np.float32) * 0.2 for _ in scales for s in ((32, 64), (64, 32))]
  g = gs.function(_blocks(scales), mesh=MESH, in_shardings=(P("data", None),) + (P(None, "model"), P("model", None)) * 4,
                  jit_compile=True)
  low = g.lower(*[tf.TensorSpec(a.shape) for a in [x] + ws])
  called = [n.attr["f"].func.name for n in low.program.local_graph_def.node if n.op == "StatefulPartitionedCall"]
  lib = {f.signature.name: f for f in low.program.local_graph_def.library.function}
  assert len(called) >= 4 and len(set(called)) < len(called)
  assert set(called) <= set(lib) and all(lib[f].attr["_XlaMustCompile"].b for f in called)
  # The last block scales by another constant: the segment reading it differs from the others' one.
  consts = {f: sorted(float(tf.make_ndarray(n.attr["value"].tensor)) for n in lib[f].node_def
                      if n.op == "Const" and n.attr["value"].tensor.tensor_shape.dim == [] and
                      n.attr["dtype"].type == tf.float32.as_datatype_enum) for f in set(called)}
  assert any(0.25 in c for c in consts.values()) and any(0.5 in c and 0.25 not in c for c in consts.values())
  assert_close(g(x, *ws).numpy(), _blocks(scales)(x, *ws).numpy(), rtol=1e-4, atol=1e-4)


def test_auto_compiles_on_gpu_and_tpu_meshes_only():
  assert not jit.wants_jit("auto", "CPU") and jit.wants_jit("auto", "GPU") and jit.wants_jit("auto", "TPU")
  assert jit.wants_jit(True, "CPU") and not jit.wants_jit(False, "GPU")
  gpus = [f"/job:worker/replica:0/task:0/device:GPU:{i}" for i in range(8)]
  mesh = gs.Mesh((2, 4), ("data", "model"), devices=gpus)
  f = gs.function(lambda x, w: tf.nn.relu(x @ w), mesh=mesh, in_shardings=(P("data", None), P(None, "model")))
  low = f.lower(tf.TensorSpec([8, 16]), tf.TensorSpec([16, 32]))   # planned: no GPU on this machine
  assert low.program.jit == "whole"
  assert gs.function(lambda x: x * 2.0, mesh=mesh, jit_compile=False).lower(tf.TensorSpec([8])).program.jit is None


@pytest.mark.parametrize("fn,specs,jit_mode", [
    (lambda x, w: x @ w, (P(None, "d"), P("d", None)), "whole"),                        # a summing all-reduce
    (lambda x, w: tf.reduce_max(x, axis=0) + w[0], (P("d", None), P()), "segments"),     # a max all-reduce
    (lambda x, w: tf.nn.conv2d(x[None, :, :, None], w[:3, :3, None, None], 1, "SAME"), (P("d", None), P()),
     "segments"),                                                                          # halo permutes
], ids=["sum", "max", "halo"])
def test_gpu_programs_with_collectives_xla_does_not_lower_compile_in_segments(fn, specs, jit_mode):
  """tf2xla lowers summing CollectiveReduceV2 only: other collectives leave the program to XLA segments."""
  gpus = [f"/job:worker/replica:0/task:0/device:GPU:{i}" for i in range(8)]
  f = gs.function(fn, mesh=gs.Mesh((8,), ("d",), devices=gpus), in_shardings=specs)
  low = f.lower(tf.TensorSpec([16, 16]), tf.TensorSpec([16, 16]))
  assert low.program.jit == jit_mode, str(low.report)


def test_whole_program_check_names_the_op_xla_refuses():
  g = tf.Graph()
  with g.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [4], name="x")
    tf.strings.format("{}", [x], name="fmt")
  with pytest.raises(gs.UnsupportedOpError, match=r"StringFormat.*XLA on GPU.*jit_compile=False"):
    jit.check_whole_program(g.as_graph_def(), "GPU")


def test_bad_jit_option_is_a_typed_error():
  with pytest.raises(gs.InputError, match="jit_compile must be"):
    gs.function(lambda x: x, mesh=MESH, jit_compile="yes")


def test_retrace_is_logged_with_its_reason(caplog):
  f = gs.function(lambda x: x * 2.0, mesh=MESH, in_shardings=P("data"))
  f(np.ones([8], np.float32))
  with caplog.at_level(logging.INFO, logger="absl"):
    f(np.ones([16], np.float32))
  assert any("retracing" in r.getMessage() and "argument 0 is float32[16] (was float32[8])" in r.getMessage()
             for r in caplog.records)


@pytest.mark.parametrize("mode", [True, False])
def test_runtime_fields_recorded_by_partition_survive_compile(mode):
  """The runtime reads only the Program's plain fields: every name they give is in the final program."""
  v = tf.Variable(tf.zeros([32, 64]))
  g = gs.function(_mlp_with_state(v), mesh=MESH, in_shardings=(P("data", None), P("model", None)),
                  jit_compile=mode)
  low = g.lower(tf.TensorSpec([16, 32]), tf.TensorSpec([64, 32]))
  program = low.program
  nodes = {n.name: n for n in low.graph_def.node}
  assert nodes[program.partition_id].op == "Placeholder"
  for name in program.local_inputs + program.local_variables + program.local_outputs:
    assert name in nodes
  assert len(program.variable_names) == 1
  assert program.variables_written == (True,)   # assign_add
  assert program.variable_shardings == (gs.Sharding.from_spec(MESH, P(None, "model")),)
  (s0, shape0, dtype0), (s1, shape1, dtype1) = program.output_specs
  assert (shape0, dtype0, shape1, dtype1) == ((16,), tf.float32, (16, 32), tf.float32)
  assert (s0, s1) == program.output_shardings


def test_read_only_variables_are_not_written():
  v = tf.Variable(tf.ones([8, 4]))

  def f(x):
    return tf.gather(v, x) + tf.reduce_sum(v)

  program = gs.function(f, mesh=MESH).lower(tf.TensorSpec([8], tf.int32)).program
  assert program.variables_written == (False,)


def test_xla_lowers_only_the_collectives_it_has_kernels_for():
  """XLA_LOWERED names exactly the emitted op types that TF's tf2xla registry compiles (for a GPU program)."""
  tf.function(lambda v: v + 1.0, jit_compile=True, autograph=False)(tf.constant(1.0))   # XLA's kernels registered
  with_kernel = {op for op in vocabulary.EMITTED_OPS
                 if "XLA_GPU_JIT" in {k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}}
  assert with_kernel == set(vocabulary.XLA_LOWERED) == {"CollectiveReduceV2"}
  assert vocabulary.EMITTED_OPS <= vocabulary.TF_COLLECTIVE_OPS
