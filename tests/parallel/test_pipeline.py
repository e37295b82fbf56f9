"""gs.pipeline: GSPMD pipelining as sharding of a stage dim, with circular repeats.

Every result is compared with the unpartitioned program: the same pipeline run by a plain tf.function, and the
plain sequential model (the layers one after the other, no microbatches).
"""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

D, B, M = 8, 16, 8


def _mlp_stage(w, h):
  """One stage slot: its residual tanh layers (w [layers per slot, D, D])."""
  for k in range(w.shape[0]):
    h = h + tf.tanh(h @ w[k])
  return h


def _sequential(x, layers):
  h = x
  for k in range(layers.shape[0]):
    h = h + tf.tanh(h @ layers[k])
  return h


def _stage_collectives(low):
  return [c for c in low.report.collectives if "stage" in c.axes]


@pytest.mark.parametrize("repeats,vectorize", [(1, True), (2, True), (1, False)], ids=str)
def test_forward_and_gradient_match_the_sequential_model(rng, repeats, vectorize):
  stages = 4
  layers = (rng.standard_normal((stages * repeats * 2, D, D)) * 0.3).astype(np.float32)
  x = rng.standard_normal((B, D)).astype(np.float32)
  w = gs.stack_stages(layers, stages, repeats)
  stage_fn = _mlp_stage if vectorize else (lambda w, h: tf.vectorized_map(lambda a: _mlp_stage(*a), (w, h)))

  def step(x, w):
    with tf.GradientTape() as tape:
      tape.watch([x, w])
      y = gs.pipeline(stage_fn, w, x, microbatches=M, circular_repeats=repeats, vectorize=vectorize)
      loss = tf.reduce_mean(y ** 2)
    gx, gw = tape.gradient(loss, [x, w])
    return y, gx, gw

  def reference(x, w):
    layers = gs.unstack_stages(w, repeats)
    with tf.GradientTape() as tape:
      tape.watch([x, layers])
      y = _sequential(x, layers)
      loss = tf.reduce_mean(y ** 2)
    gx, gl = tape.gradient(loss, [x, layers])
    return y, gx, gs.stack_stages(gl, stages, repeats)

  mesh = gs.Mesh((4, 2), ("stage", "data"))
  f = gs.function(step, mesh=mesh, in_shardings=(P("data", None), P("stage")))
  got = f(x, w)
  for g, p, r in zip(got, tf.function(step)(x, w), tf.function(reference)(x, w)):
    assert_close(g.numpy(), p.numpy(), rtol=1e-6, atol=1e-6)   # the same pipeline, unpartitioned
    assert_close(g.numpy(), r.numpy(), rtol=1e-5, atol=1e-5)   # the sequential model
  assert got[2].sharding.spec[0] == "stage"
  low = f.lower(tf.TensorSpec(x.shape), tf.TensorSpec(w.shape))
  assert "all-gather" not in low.report.counts()
  (sched,) = low.report.pipelines
  assert (sched.stages, sched.microbatches, sched.repeats) == (4, M, repeats)
  assert sched.iterations == repeats * M + 3 and sched.bubble_fraction == pytest.approx(3 / (repeats * M + 3))
  assert sched.shift_permutes == 1 and sched.shift_bytes == (B // M // 2) * D * 4   # one microbatch's shard
  assert len(sched.loop_stage_collectives) == 2   # the forward loop's shift and the gradient loop's


def _train(lm, mesh, steps, cfg):
  f = gs.function(lm.train_step, mesh=mesh, in_shardings=(P("data", None), P("data", None)))
  return [float(f(*tm.synthetic_batch(cfg, seed=k)).numpy()) for k in range(steps)], f


def _unpartitioned_losses(cfg, steps):
  """The plain (unpipelined, sequential-layer) model: same initial values, same Adam."""
  params = tm.init_params(cfg)
  names = sorted(params)
  step = tf.function(tm.make_train_step(cfg, names))
  state = [params[k] for k in names] + [np.zeros_like(params[k]) for k in names] * 2
  out = []
  for k in range(steps):
    res = step(np.int32(k), *tm.synthetic_batch(cfg, seed=k), *state)
    out.append(float(res[0]))
    state = [r.numpy() for r in res[1:]]
  return out


CFG = tm.Config(layers=8, d_model=16, heads=2, d_ff=32, vocab=32, seq=8, batch=16, lr=1e-2)


@pytest.mark.parametrize("mesh_shape,stages,repeats", [((4, 2), 4, 1), ((4, 2), 4, 2), ((2, 2, 2), 2, 1)], ids=str)
def test_pipelined_transformer_trains_like_the_unpartitioned_model(mesh_shape, stages, repeats):
  """8 layers as 4 stages x 2 layers, as 8 stage slots on 4 devices (R = 2), and stage x data x model (Megatron
  inside the stages): 10 Adam steps give the sequential model's losses; each loop iteration's only cross-stage
  collective is the shift (one microbatch's activation shard); each device stores 1/S of the stage weights and
  of their optimizer state."""
  steps = 10
  megatron = len(mesh_shape) == 3
  mesh = gs.Mesh(mesh_shape, ("stage", "data", "model")[:len(mesh_shape)])
  lm = tm.PipelinedLM(CFG, stages, M, repeats, megatron=megatron)
  losses, f = _train(lm, mesh, steps, CFG)
  np.testing.assert_allclose(losses, _unpartitioned_losses(CFG, steps), rtol=1e-4)
  assert losses[-1] < losses[0]

  low = f.lower(tf.TensorSpec([CFG.batch, CFG.seq], tf.int32), tf.TensorSpec([CFG.batch, CFG.seq], tf.int32))
  rep = low.report
  assert "all-gather" not in rep.counts() and not rep.fallbacks
  (sched,) = rep.pipelines
  assert sched.bubble_fraction == pytest.approx((stages - 1) / (repeats * M + stages - 1))
  microbatch_shard = (CFG.batch // M // 2) * CFG.seq * CFG.d_model * 4   # batch rows over data = 2
  assert sched.shift_permutes == 1 and sched.shift_bytes == microbatch_shard
  assert [c.split()[0] for c in sched.loop_stage_collectives] == ["collective-permute"] * 2
  loops = [c for c in rep.collectives if c.loops]
  assert all(set(c.axes) <= {"stage", "model"} for c in loops)
  # the weight gradients stay partial over data through the gradient loop and are all-reduced once after it
  after = [c for c in rep.collectives if "data" in c.axes and c.source.endswith("_loop_grad")]
  assert len(after) == 12 and all(c.kind == "all-reduce" and c.times == 1 for c in after)   # one per stage weight
  if megatron:   # Megatron's all-reduces inside the stages run over model only
    assert any(c.axes == ("model",) for c in loops if c.kind == "all-reduce")
    assert all("stage" not in c.axes for c in loops if c.kind == "all-reduce")
  layer_bytes = sum(np.prod(s) for k, s in tm.param_shapes(CFG).items() if k not in tm.GLOBAL_LEAVES) * 4
  global_bytes = sum(np.prod(tm.param_shapes(CFG)[k]) for k in tm.GLOBAL_LEAVES) * 4
  n = mesh.axis_size("stage")
  local, total = rep.state_bytes("weight")
  assert total == layer_bytes + global_bytes
  if not megatron:
    assert local == layer_bytes // n + global_bytes
  else:
    assert local < layer_bytes // n + global_bytes
  slots_local, slots_total = rep.state_bytes("update state")
  assert slots_local <= 2 * local + 8 and slots_total == 2 * total + 8   # m and v (+ the step counter)
  weights = [r for r in rep.state if r.name.startswith("layers")]
  assert weights and all(r.sharding.startswith("P('stage'") for r in weights)


def test_typed_errors():
  mesh = gs.Mesh((4, 2), ("stage", "data"))
  w = np.zeros((4, 1, D, D), np.float32)
  x = np.zeros((B, D), np.float32)

  def lower(fn, mesh=mesh, xs=x, ws=w):
    gs.function(fn, mesh=mesh).lower(tf.TensorSpec(xs.shape), tf.TensorSpec(ws.shape))

  with pytest.raises(gs.SpecError, match=r"10 layers cannot be divided into 4 stages x 2 circular"):
    gs.stack_stages(np.zeros((10, D, D), np.float32), 4, 2)
  with pytest.raises(gs.InputError, match=r"dim 0 of the pipeline's inputs \[16, 8\].*into 3 microbatches"):
    lower(lambda x, w: gs.pipeline(_mlp_stage, w, x, microbatches=3))
  with pytest.raises(gs.SpecError, match=r"no stage axis 'stage'.*\('data', 'model'\)"):
    lower(lambda x, w: gs.pipeline(_mlp_stage, w, x, microbatches=M), mesh=gs.Mesh((4, 2), ("data", "model")))
  with pytest.raises(gs.SpecError, match=r"3 stages\) is not a multiple of the size 4 of mesh axis 'stage'"):
    lower(lambda x, w: gs.pipeline(_mlp_stage, w, x, microbatches=M), ws=np.zeros((3, 1, D, D), np.float32))
  with pytest.raises(gs.InputError, match=r"at least as many microbatches as stages \(M=2 < S=4\)"):
    lower(lambda x, w: gs.pipeline(_mlp_stage, w, x, microbatches=2, circular_repeats=2),
          ws=np.zeros((4, 2, 1, D, D), np.float32))
  with pytest.raises(gs.InputError, match=r"circular_repeats=2 but dim 1 of the stage weights is 1"):
    lower(lambda x, w: gs.pipeline(_mlp_stage, w, x, microbatches=M, circular_repeats=2))
