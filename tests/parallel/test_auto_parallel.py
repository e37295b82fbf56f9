"""gs.auto_parallel: a step whose parts differ (embedding, dense blocks, a vocabulary head) planned at both levels
and run as an MPMD pipeline on 8 logical CPUs, against the unpartitioned program (loss, gradients, SGD steps)."""

import dataclasses
import math
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd._layout.sharding import to_sharding
from tf_gspmd.errors import InputError
from conftest import HostReads
from tf_gspmd.runtime.cross_mesh import tile_extent
from tf_gspmd.rewriter.stages import calibrate

import cluster_runs
from conftest import assert_close

# The model, shared with the 2-process run (tests/cluster_programs/auto_parallel_step.py).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cluster_programs"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from auto_parallel_step import BLOCKS, N, S, V, block, data, init, loss_fn  # noqa: E402  pylint: disable=g-import-not-at-top
from auto_parallel_step import token_losses  # noqa: E402  pylint: disable=g-import-not-at-top
import unet_model  # noqa: E402  pylint: disable=g-import-not-at-top

# Call and move costs of an accelerator cluster, under which this small model's stages pipeline (at this
# machine's measured 2 ms a call they do not pay: test_the_intra_only_plan_runs_when_a_pipeline_cannot_pay).
# (and devices computing side by side)
CAL = dataclasses.replace(calibrate.DEFAULT, seconds_per_call=2e-5, seconds_per_transfer_byte=1e-11,
                          seconds_per_move=1e-7, parallel_devices=float("inf"))


def reference(params, tokens, labels):
  p = {k: tf.constant(v) for k, v in params.items()}
  with tf.GradientTape() as tape:
    tape.watch(p)
    loss = loss_fn(p, tf.constant(tokens), tf.constant(labels))
  return loss.numpy(), {k: tf.convert_to_tensor(g).numpy() for k, g in tape.gradient(loss, p).items()}


def _sgd_reference(fn, want, tokens, labels, lr):
  """One SGD step of the unpartitioned program on the variables `want`; returns its loss before the step."""
  with tf.GradientTape() as tape:
    ref = fn(want, tf.constant(tokens), tf.constant(labels))
  for k, g in tape.gradient(ref, want).items():
    want[k].assign_sub(lr * tf.convert_to_tensor(g))
  return ref.numpy()


def _matches_reference(step, tokens, labels):
  """`step`'s loss and gradients from init() equal the unpartitioned program's."""
  params = init()
  loss, grads = step(params, tokens, labels)
  want_loss, want_grads = reference(params, tokens, labels)
  assert_close(loss, want_loss)
  for k, g in grads.items():
    np.testing.assert_allclose(np.asarray(g), want_grads[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.fixture(scope="module")
def step():
  mesh = gs.Mesh((2, 4), ("host", "device"))
  tokens, labels = data()
  return gs.auto_parallel(loss_fn, init(), tokens, labels, mesh=mesh, microbatches=4, layers=6,
                          calibration=CAL, intra_candidate=False)


def test_plan_covers_the_mesh_and_reports_it(step):
  plan = step.plan
  assert len(plan.stages) == len(step.stages) == len(step.boundaries) + 1 > 1
  devices = [d for s in step.stages for d in s.mesh.resolve_devices()]
  assert len(devices) == len(set(devices)) <= 8
  for s, st in zip(plan.stages, step.stages):
    assert st.mesh.shape == s.mesh.shape and st.mesh.size == len(s.devices)
  trained = sorted(n for names in step._stage_params for n in names)  # pylint: disable=protected-access
  assert sorted(set(trained)) == sorted(f"0/{k}" for k in init())
  text = str(step)
  assert "stage plan:" in text and "T* =" in text and "MPMD stages:" in text
  assert math.isfinite(plan.predicted_seconds) and plan.predicted_seconds > 0


def test_loss_and_gradients_equal_the_unpartitioned_step(step):
  params = init()
  tokens, labels = data()
  loss, grads = step(params, tokens, labels)
  want_loss, want_grads = reference(params, tokens, labels)
  assert_close(loss, want_loss)
  assert set(grads) == set(want_grads)
  for k, g in grads.items():
    got = g.numpy() if isinstance(g, gs.ShardedTensor) else np.asarray(g)
    np.testing.assert_allclose(got, want_grads[k], rtol=1e-5, atol=1e-6, err_msg=k)
  measured = step.last_seconds
  print(f"\nauto_parallel: predicted step {step.plan.predicted_seconds * 1e3:.3f} ms, measured {measured * 1e3:.1f} ms "
        f"({len(step.stages)} stages)")
  assert math.isfinite(measured) and measured > 0


def test_sgd_steps_match_plain_tensorflow(step):
  params, want = init(), {k: tf.Variable(v) for k, v in init().items()}
  tokens, labels = data(seed=2)
  for _ in range(3):
    loss, grads = step(params, tokens, labels)
    params = step.sgd(params, grads, 0.5)
    assert_close(loss, _sgd_reference(loss_fn, want, tokens, labels, 0.5))
  for k in want:
    assert_close(params[k], want[k].numpy())


def test_bad_arguments_raise_typed_errors():
  mesh = gs.Mesh((2, 4), ("host", "device"))
  tokens, labels = data()
  with pytest.raises(InputError, match="multiple of microbatches=3"):
    gs.auto_parallel(loss_fn, init(), tokens, labels, mesh=mesh, microbatches=3, calibration=CAL)
  with pytest.raises(InputError, match="microbatches"):
    gs.auto_parallel(loss_fn, init(), tokens, labels, mesh=mesh, microbatches=0, calibration=CAL)


def skip_loss_fn(params, tokens, scale, labels):
  """The embedding reaches the head past the blocks, and a float batch argument scales the middle block: the
  boundaries between stages carry several tensors, a batch argument among them."""
  e = tf.gather(params["embed"], tokens)
  x = e
  for b in range(BLOCKS):
    x = block(params, b, x)
    if b == 1:
      x = x * scale[:, :, None]
  logits = tf.einsum("nsd,dv->nsv", x + e, params["head"])
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def test_boundary_tensors_travel_each_in_its_own_layout_and_dtype():
  """The skip connection, the block's output and a batch argument a middle stage reads cross each boundary as
  separate tensors in their own dtypes, each resharded from its planned layout in the sending stage into its
  planned layout in the receiving one: the bytes each boundary moves forward are exactly the receivers' slices,
  counted here tensor by tensor from the plan's layouts."""
  mesh = gs.Mesh((2, 4), ("host", "device"))
  tokens, labels = data()
  scale = np.random.default_rng(3).uniform(0.5, 1.5, (N, S)).astype(np.float32)
  free_moves = dataclasses.replace(CAL, seconds_per_call=0.0, seconds_per_transfer_byte=0.0,
                                   seconds_per_move=0.0)  # (cuts anywhere)
  step = gs.auto_parallel(skip_loss_fn, init(), tokens, scale, labels, mesh=mesh, microbatches=2, layers=6,
                          calibration=free_moves, intra_candidate=False)
  print("\n" + str(step))
  assert any(len(b.refs) > 1 for b in step.boundaries)
  params = init()
  loss, grads = step(params, tokens, scale, labels)
  p = {k: tf.constant(v) for k, v in params.items()}
  with tf.GradientTape() as tape:
    tape.watch(p)
    want = skip_loss_fn(p, tf.constant(tokens), tf.constant(scale), tf.constant(labels))
  assert_close(loss, want.numpy())
  for k, g in tape.gradient(want, p).items():
    np.testing.assert_allclose(grads[k].numpy(), tf.convert_to_tensor(g).numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
  _check_boundary_bytes(step)


def _check_boundary_bytes(step):
  """The bytes each boundary moved forward in the last step are exactly the receivers' slices of its tensors,
  counted tensor by tensor from the plan's layouts."""
  transfers = step.pipeline.last_run.transfers.transfers
  for k, b in enumerate(step.boundaries):
    senders = set(step.stages[k].mesh.resolve_devices())
    receivers = step.stages[k + 1].mesh.resolve_devices()
    want_bytes = 0
    for spec, layout in zip(b.specs, b.in_shardings):
      sharding = to_sharding(layout, step.stages[k + 1].mesh, rank=spec.shape.rank)
      for position in range(len(receivers)):
        _, lengths = tile_extent(sharding, tuple(spec.shape.as_list()), position)
        want_bytes += int(np.prod(lengths)) * spec.dtype.size
    moved = sum(t.bytes for t in transfers if t.src_device in senders and t.dst_device in set(receivers))
    assert moved == step.microbatches * want_bytes, (k, b)


def test_a_unet_s_skip_connections_cross_each_in_its_own_layout():
  """examples/unet_model.py (the U-Net of bench/alpa.py): the down path's outputs reach the up path past the
  stages between, each crossing every boundary as its own tensor in its planned layouts (the bytes counted by
  hand); loss and gradients equal the unpartitioned step's."""
  shapes = unet_model.param_shapes(4)
  params, (images, labels) = unet_model.init_params(shapes), unet_model.synthetic_batch(8, 16)
  free_moves = dataclasses.replace(CAL, seconds_per_call=0.0, seconds_per_transfer_byte=0.0,
                                   seconds_per_move=0.0)  # (cuts anywhere)
  step = gs.auto_parallel(unet_model.loss_fn, params, images, labels, mesh=gs.Mesh((2, 4), ("host", "device")),
                          microbatches=2, layers=6, calibration=free_moves, intra_candidate=False, max_stage_rows=1)
  print("\n" + str(step))
  assert len(step.stages) > 1 and any(len(b.refs) > 1 for b in step.boundaries), step
  loss, grads = step(params, images, labels)
  p = {k: tf.constant(v) for k, v in params.items()}
  with tf.GradientTape() as tape:
    tape.watch(p)
    want = unet_model.loss_fn(p, tf.constant(images), tf.constant(labels))
  assert_close(loss, want.numpy())
  for k, g in tape.gradient(want, p).items():
    np.testing.assert_allclose(grads[k].numpy(), g.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)
  _check_boundary_bytes(step)


@pytest.fixture
def moe_flags():
  """examples/train_moe.py's flags, set small for the test and restored after it."""
  import train_moe  # pylint: disable=g-import-not-at-top
  f = train_moe.FLAGS
  if not f.is_parsed():
    f(["test"])
  small = dict(layers=2, d_model=16, heads=2, d_ff=32, experts=4, vocab=32, seq_len=8, batch=8, auto=False,
               auto_parallel=True)   # auto_parallel: no gs.shard annotations inside the model
  saved = {k: getattr(f, k) for k in small}
  for k, v in small.items():
    setattr(f, k, v)
  yield train_moe
  for k, v in saved.items():
    setattr(f, k, v)


def test_the_moe_s_boundaries_carry_its_hidden_state_and_gating_loss_each_in_its_own_layout(moe_flags):
  """The GShard MoE of examples/train_moe.py (bench/alpa.py's): its boundaries carry several tensors -- the hidden
  state, the running load-balancing (gating) loss, a scalar, and where a cut falls inside a block its routing
  weights -- each in its own planned layout and dtype (the bytes counted by hand); loss and gradients equal the
  unpartitioned step's."""
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  moe, f = moe_flags, moe_flags.FLAGS
  specs = moe.param_specs(gs.P)
  params = {name: np.asarray(moe._initializer(kind, 1000 + k)(shape), np.float32)  # pylint: disable=protected-access
            for k, (name, (shape, _, kind)) in enumerate(sorted(specs.items()))}
  tokens, targets = tm.synthetic_batch(tm.Config(vocab=f.vocab, seq=f.seq_len, batch=f.batch), seed=1)

  def loss(prm, tok, tgt):
    logits, aux = moe.forward(prm, tok, None, gs.P)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tgt, logits=logits)) + (
        f.aux_weight * aux)

  free_moves = dataclasses.replace(CAL, seconds_per_call=0.0, seconds_per_transfer_byte=0.0,
                                   seconds_per_move=0.0)  # (cuts anywhere)
  step = gs.auto_parallel(loss, params, tokens, targets, mesh=gs.Mesh((2, 4), ("host", "device")), microbatches=1,
                          layers=f.layers + 2, calibration=free_moves, intra_candidate=False, max_stage_rows=1)
  print("\n" + str(step))
  assert len(step.stages) > 1, step
  scalars = [k for k, b in enumerate(step.boundaries) if len(b.refs) > 1 and any(
      spec.shape.rank == 0 for spec in b.specs)]
  assert scalars, [(b.refs, b.specs) for b in step.boundaries]   # the hidden state and the gating loss, apart
  got, grads = step(params, tokens, targets)
  p = {k: tf.constant(v) for k, v in params.items()}
  with tf.GradientTape() as tape:
    tape.watch(p)
    want = loss(p, tf.constant(tokens), tf.constant(targets))
  assert_close(got, want.numpy())
  for k, g in tape.gradient(want, p).items():
    np.testing.assert_allclose(grads[k].numpy(), g.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)
  _check_boundary_bytes(step)


def test_captured_trainable_variables_and_inexact_boundaries_are_refused():
  mesh = gs.Mesh((2, 4), ("host", "device"))
  tokens, labels = data()
  bias = tf.Variable(np.zeros((V,), np.float32), name="head_bias")

  def with_bias(params, tok, lab):
    x = tf.gather(params["embed"], tok)
    logits = tf.einsum("nsd,dv->nsv", x, params["head"]) + bias
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=lab, logits=logits))

  with pytest.raises(InputError, match="head_bias.*not a leaf of params"):
    gs.auto_parallel(with_bias, {"embed": init()["embed"], "head": init()["head"]}, tokens, labels, mesh=mesh,
                     microbatches=2, layers=3, calibration=CAL)
  from tf_gspmd._parallel import auto_parallel as _auto_parallel  # pylint: disable=g-import-not-at-top
  assert _auto_parallel._pack_dtype([tf.TensorSpec([2], tf.float32)], "b") == tf.float32  # pylint: disable=protected-access
  assert _auto_parallel._pack_dtype([tf.TensorSpec([2], tf.float32), tf.TensorSpec([2], tf.int32)],  # pylint: disable=protected-access
                                    "b") == tf.float64
  with pytest.raises(InputError, match="int64 values"):
    _auto_parallel._pack_dtype([tf.TensorSpec([2], tf.float32), tf.TensorSpec([2], tf.int64)], "b")  # pylint: disable=protected-access


def _on_home(step, name, value):
  """`value` is a ShardedTensor on the submesh of `name`'s home stage, each device holding its planned tile only."""
  k, spec = step.homes[name]
  mesh = step.stages[k].mesh
  assert isinstance(value, gs.ShardedTensor), (name, type(value))
  assert value.sharding == to_sharding(spec, mesh, rank=len(value.shape)), (name, value.sharding, spec)
  shards = gs.shards_of(value)
  assert [s.device for s in shards] == list(mesh.resolve_devices()), name
  tile = value.sharding.with_rank(len(value.shape)).shard_shape(tuple(value.shape.as_list()))
  assert all(s.shape == tuple(min(t, n) for t, n in zip(tile, value.shape.as_list())) for s in shards), name
  return spec


def test_adam_state_stays_on_the_stage_meshes_and_steps_match_keras_adam(step, monkeypatch):
  """Parameters, gradients and Adam's moments live on their home stage's submesh in the planned layouts for the
  whole run; each stage's update runs there; the only value a step brings to the host is the loss; three steps
  equal Keras's Adam on plain variables (1e-5 relative)."""
  import keras  # pylint: disable=g-import-not-at-top
  want = {k: tf.Variable(v) for k, v in init().items()}
  keys = sorted(want)
  params = step.place(init())
  opt, ref_opt = step.adam(0.01), keras.optimizers.Adam(0.01)
  tokens, labels = data(seed=4)
  reads = HostReads(monkeypatch)
  for _ in range(3):
    loss, grads = step(params, tokens, labels)
    params = opt(params, grads)
    with tf.GradientTape() as tape:
      ref = loss_fn(want, tf.constant(tokens), tf.constant(labels))
    g = tape.gradient(ref, [want[k] for k in keys])
    ref_opt.apply_gradients(zip([tf.convert_to_tensor(x) for x in g], [want[k] for k in keys]))
    np.testing.assert_allclose(loss, ref.numpy(), rtol=1e-5)
  assert reads.shapes and all(s == () for s in reads.shapes), reads.shapes   # the losses, nothing else
  split = 0
  for k in keys:
    name = f"0/{k}"
    spec = _on_home(step, name, params[k])
    for moment in opt.moments[name]:
      _on_home(step, name, moment)
    split += any(a is not None for a in spec)
  assert split >= 4   # (the plan splits the embedding, the head and the blocks' weights)
  monkeypatch.undo()
  for k in keys:
    np.testing.assert_allclose(params[k].numpy(), want[k].numpy(), rtol=1e-5, atol=2e-5, err_msg=k)


def test_parameters_initialized_on_their_homes_tile_by_tile_equal_placed_whole_values(step, monkeypatch):
  """step.initialize: each device of a parameter's home builds its own tile from the initializer (no whole value
  on the host or on a device that holds a part), equal to placing the initializer's whole value; the step trains
  from them."""
  inits = {k: gs.initializers.Normal(0.0, 0.2, seed=i) for i, k in enumerate(sorted(init()))}
  reads = HostReads(monkeypatch)
  built = step.initialize(inits)
  assert not reads.shapes, reads.shapes
  monkeypatch.undo()
  whole = {k: v(tuple(init()[k].shape)).numpy() for k, v in inits.items()}
  for k in sorted(whole):
    _on_home(step, f"0/{k}", built[k])
    for shard in gs.shards_of(built[k]):
      np.testing.assert_array_equal(shard.numpy(), whole[k][shard.index], err_msg=k)
  loss, _ = step(built, *data())
  np.testing.assert_allclose(loss, loss_fn({k: tf.constant(v) for k, v in whole.items()}, *data()).numpy(),
                             rtol=1e-5)


def tied_loss_fn(params, tokens, labels):
  """The embedding table is also the output projection: the first and the last stage both read it."""
  x = tf.gather(params["embed"], tokens)
  for b in range(BLOCKS):
    x = block(params, b, x)
  logits = tf.einsum("nsd,vd->nsv", x, params["embed"])
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def test_a_parameter_several_stages_read_lives_with_the_first_and_its_gradients_add_on_its_devices(monkeypatch):
  mesh = gs.Mesh((2, 4), ("host", "device"))
  tokens, labels = data()
  params = {k: v for k, v in init().items() if k != "head"}
  # (a budget under which the table's two readers cannot share a stage)
  step = gs.auto_parallel(tied_loss_fn, params, tokens, labels, mesh=mesh, microbatches=4, layers=6,
                          calibration=CAL, intra_candidate=False, memory_budget=250_000)
  readers = [k for k, names in enumerate(step._stage_params) if "0/embed" in names]  # pylint: disable=protected-access
  assert len(readers) == 2, step.plan   # (the lookup and the projection fall in different stages)
  assert step.homes["0/embed"][0] == readers[0]
  want = {k: tf.Variable(v) for k, v in params.items()}
  placed = step.place(params)
  reads = HostReads(monkeypatch)
  for _ in range(2):
    loss, grads = step(placed, tokens, labels)
    placed = step.sgd(placed, grads, 0.5)
    np.testing.assert_allclose(loss, _sgd_reference(tied_loss_fn, want, tokens, labels, 0.5), rtol=1e-5)
  assert all(s == () for s in reads.shapes), reads.shapes
  monkeypatch.undo()
  _on_home(step, "0/embed", placed["embed"])
  for k in want:
    np.testing.assert_allclose(placed[k].numpy(), want[k].numpy(), rtol=1e-5, atol=2e-5, err_msg=k)


def test_a_one_stage_plan_runs_on_the_whole_mesh():
  mesh = gs.Mesh((2, 4), ("host", "device"))
  tokens, labels = data()
  one = gs.auto_parallel(loss_fn, init(), tokens, labels, mesh=mesh, microbatches=2, layers=4, calibration=CAL,
                         max_stages=1, memory_budget=1 << 40)
  assert len(one.stages) == 1 and one.stages[0].mesh.size == 8 and not one.boundaries
  _matches_reference(one, tokens, labels)


def test_the_intra_only_plan_runs_when_a_pipeline_cannot_pay():
  """At 2 ms a stage-program call (this machine's calibration) the small model's pipeline costs more in calls and
  moves than it saves: the step runs as the whole mesh's intra-operator plan, the whole batch in one call."""
  mesh = gs.Mesh((2, 4), ("host", "device"))
  tokens, labels = data()
  slow_calls = dataclasses.replace(calibrate.DEFAULT, seconds_per_call=2e-3, seconds_per_transfer_byte=1e-9)
  step = gs.auto_parallel(loss_fn, init(), tokens, labels, mesh=mesh, microbatches=4, layers=6,
                          calibration=slow_calls)
  assert step.intra_plan is not None and step.plan is step.intra_plan and step.microbatches == 1
  assert step.intra_plan.predicted_seconds < step.pipelined_plan.predicted_seconds
  assert len(step.stages) == 1 and step.stages[0].mesh.size == 8 and not step.boundaries
  # one stage and one call each way: 2 calls, nothing moved, no microbatches
  assert step.plan.predicted_seconds >= 2 * slow_calls.seconds_per_call
  _matches_reference(step, tokens, labels)
  # Under cheap calls and moves the pipeline pays, and is chosen over the intra-only plan.
  fast = gs.auto_parallel(loss_fn, init(), tokens, labels, mesh=mesh, microbatches=4, layers=6, calibration=CAL)
  assert fast.plan is fast.pipelined_plan and len(fast.stages) > 1 and fast.microbatches == 4
  assert fast.pipelined_plan.predicted_seconds <= fast.intra_plan.predicted_seconds


def test_profiling_times_the_chosen_stages_and_the_step_without_a_pipeline():
  """With values and this machine's own calibration the plan's stages are timed and the step planned again with
  their measurements (Alpa profiles its stages), and the step without a pipeline is timed in three layouts; the
  faster of the two plans runs and gives the unpartitioned loss and gradients."""
  mesh = gs.Mesh((2, 4), ("host", "device"))
  tokens, labels = data()
  step = gs.auto_parallel(loss_fn, init(), tokens, labels, mesh=mesh, microbatches=4, layers=6)
  assert step.profiled_rounds >= 1
  assert all(s.measured and s.seconds > 0 for s in step.pipelined_plan.stages)
  timed = step.whole_timings
  assert set(timed) == {"planned", "whole-step automatic", "data parallel"} and all(v > 0 for v in timed.values())
  assert step.whole_layouts == min(timed, key=timed.get)
  assert step.intra_plan.stages[0].measured and step.intra_plan.predicted_seconds == timed[step.whole_layouts]
  faster = min((step.intra_plan, step.pipelined_plan), key=lambda p: p.predicted_seconds)
  assert step.plan is faster
  assert "steps timed without a pipeline, whole batch: planned" in str(step)
  _matches_reference(step, tokens, labels)
  other = step.pipelined_plan if faster is step.intra_plan else step.intra_plan
  runtime = (step.pipeline, step._whole)  # pylint: disable=protected-access
  step.select(other)   # the turned-down plan runs too, and equals the unpartitioned step
  assert step.plan is other and (step.pipeline, step._whole) != runtime  # pylint: disable=protected-access
  _matches_reference(step, tokens, labels)
  step.select(faster)   # switching back reuses the runtime built first
  assert step.plan is faster and (step.pipeline, step._whole) == runtime  # pylint: disable=protected-access
  with pytest.raises(InputError, match="profile=True times the plan's stages on real values"):
    gs.auto_parallel(loss_fn, {k: tf.TensorSpec(v.shape) for k, v in init().items()}, tokens, labels, mesh=mesh,
                     microbatches=4, profile=True)


def test_in_the_whole_step_s_own_layouts_the_gradients_leave_in_their_parameters_layouts(monkeypatch):
  """Where the step runs without a pipeline in the whole step's own automatic layouts, its program returns each
  gradient in the layout chosen for its parameter, so the update on the parameter's home (step.adam, step.sgd)
  reads it in place: no move per gradient per step."""
  from tf_gspmd._parallel import auto_parallel as ap  # pylint: disable=g-import-not-at-top
  from tf_gspmd._layout.sharding import to_sharding as sharding_of  # pylint: disable=g-import-not-at-top
  real, calls, time_whole = ap.call_times, [0], ap.AutoParallel._time_whole

  def whole_step_automatic_first(fn, repeats):   # planned, whole-step automatic, data parallel: the 2nd fastest
    real(fn, 1)
    calls[0] += 1
    return [(3.0, 1e-6, 2.0)[(calls[0] - 1) % 3]]

  def rigged(self, *args, **kwargs):
    monkeypatch.setattr(ap, "call_times", whole_step_automatic_first)
    try:
      return time_whole(self, *args, **kwargs)
    finally:
      monkeypatch.setattr(ap, "call_times", real)

  monkeypatch.setattr(ap.AutoParallel, "_time_whole", rigged)
  tokens, labels = data()
  step = gs.auto_parallel(loss_fn, init(), tokens, labels, mesh=gs.Mesh((2, 4), ("host", "device")),
                          microbatches=4, layers=6)
  assert step.plan is step.intra_plan and step.whole_layouts == "whole-step automatic", step
  moves = []
  reshard = ap.StageState.at_home.__globals__["reshard"]
  monkeypatch.setitem(ap.StageState.at_home.__globals__, "reshard", lambda *a: moves.append(a) or reshard(*a))
  _, grads = step(init(), tokens, labels)
  assert not moves, len(moves)
  for name, g in zip(step.param_names, tf.nest.flatten(grads)):
    k, spec = step.homes[name]
    assert g.sharding == sharding_of(spec, step.stages[k].mesh, rank=len(g.shape)), name
  _matches_reference(step, tokens, labels)


# ---- a loss that sums over the batch, against one that averages


def sum_loss_fn(params, tokens, labels):
  """loss_fn's per-token cross-entropy summed over the batch, not averaged."""
  return tf.reduce_sum(token_losses(params, tokens, labels))


@pytest.mark.parametrize("fn, reduction", [(loss_fn, "mean"), (sum_loss_fn, "sum")])
def test_sum_and_mean_losses_equal_plain_tensorflow_in_both_plans(fn, reduction):
  """Whichever plan runs -- the pipeline of 4 microbatches or the whole mesh without one -- the loss and the
  SGD-updated parameters are plain TF's: a sum over the batch is the sum of the microbatches' sums."""
  mesh = gs.Mesh((2, 4), ("host", "device"))
  tokens, labels = data()
  step = gs.auto_parallel(fn, init(), tokens, labels, mesh=mesh, microbatches=4, layers=6, calibration=CAL)
  assert len(step.pipelined_plan.stages) > 1 and step.intra_plan is not None
  lr = 0.5 if reduction == "mean" else 0.5 / (N * S)
  for plan in (step.pipelined_plan, step.intra_plan):
    step.select(plan)
    assert step.microbatches == (4 if plan is step.pipelined_plan else 1)
    params, want = init(), {k: tf.Variable(v) for k, v in init().items()}
    for _ in range(2):
      loss, grads = step(params, tokens, labels)
      params = step.sgd(params, grads, lr)
      with tf.GradientTape() as tape:
        ref = fn(want, tf.constant(tokens), tf.constant(labels))
      for k, g in tape.gradient(ref, want).items():
        want[k].assign_sub(lr * tf.convert_to_tensor(g))
      assert_close(loss, ref.numpy())
    for k in want:
      assert_close(params[k], want[k].numpy(), rtol=1e-4, atol=1e-5)
  assert step.loss_reduction == reduction


def test_a_loss_the_microbatches_cannot_combine_into_is_refused():
  """A loss that is neither a sum nor a mean of per-row terms is a typed error naming where the proof stops, and
  microbatches=1 (nothing to combine) runs it."""
  mesh = gs.Mesh((2, 4), ("host", "device"))
  tokens, labels = data()
  regularized = lambda p, t, l: sum_loss_fn(p, t, l) + tf.reduce_sum(tf.square(p["head"]))  # noqa: E731
  with pytest.raises(InputError, match="sum over the batch rows plus a term that does not depend on the batch"):
    gs.auto_parallel(regularized, init(), tokens, labels, mesh=mesh, microbatches=4, calibration=CAL)
  by_size = lambda p, t, l: loss_fn(p, t, l) * math.sqrt(t.shape[0])  # noqa: E731  (neither: sqrt(rows) x a mean)
  with pytest.raises(InputError, match=r"scales its sum over the batch rows by 0.5 .*microbatches=1"):
    gs.auto_parallel(by_size, init(), tokens, labels, mesh=mesh, microbatches=4, calibration=CAL)
  one = gs.auto_parallel(by_size, init(), tokens, labels, mesh=mesh, microbatches=1, layers=4, calibration=CAL,
                         max_stages=1)
  params = init()
  loss, _ = one(params, tokens, labels)
  assert_close(loss, reference(params, tokens, labels)[0] * math.sqrt(N))


# ---- typed errors for bad arguments


def test_a_mesh_that_is_not_a_gs_mesh_is_a_typed_error():
  tokens, labels = data()
  with pytest.raises(gs.MeshError, match=r"mesh=\(2, 4\): gs.auto_parallel cuts its stages from a gs.Mesh.*"
                                         r"gs.Mesh\(\(2, 4\), "):
    gs.auto_parallel(loss_fn, init(), tokens, labels, mesh=(2, 4), microbatches=4, calibration=CAL)
  specs = ({k: tf.TensorSpec(v.shape) for k, v in init().items()}, tf.TensorSpec((4, S), tf.int32),
           tf.TensorSpec((4, S), tf.int32))
  with pytest.raises(gs.MeshError, match=r"mesh='mesh': gs.plan_stages"):
    gs.plan_stages(loss_fn, *specs, mesh="mesh", layers=2)


def test_a_stage_out_of_range_and_another_batch_size_are_typed_errors(step):
  n = len(step.plan.stages)
  with pytest.raises(InputError, match=rf"stage_function\(k=99\): the plan has {n} stage\(s\); give k in 0..{n - 1}"):
    step.plan.stage_function(99)
  tokens, labels = data()
  with pytest.raises(InputError, match=r"batch argument 1 has shape \[8, 8\]; the step was planned for \[16, 8\] "
                                       r"\(a batch of 16 rows, microbatches=4 of 4\)"):
    step(init(), tokens[:8], labels[:8])


def test_a_planned_step_over_two_processes_equals_the_unpartitioned_one(exchange):
  """2 processes x 4 CPUs (tests/cluster_programs/auto_parallel_step.py), mesh (2, 4) with a row per process: the
  plan's stages each run in one process and both processes run some; every parameter and its Adam moments live on
  the devices of the process that runs its stage; three Adam steps give every process the unpartitioned program's
  losses (Keras's Adam on plain variables), and the parameters each process holds equal it."""
  results = cluster_runs.launch(2, "auto_parallel_step.py", devices_per_worker=4, exchange=exchange)
  ran = [s for r in results.values() for s in r["stages"]]
  assert all(r["stages"] for r in results.values()) and sorted(ran) == list(range(len(ran)))
  assert sorted(n for r in results.values() for n in r["held"]) == sorted(init())
  for r in results.values():
    np.testing.assert_allclose(r["losses"], r["want_losses"], rtol=1e-5)
    assert r["on_devices"] and all(r["params_equal"].values()), r
    assert "runs in one process" in r["keras_refused"] and "functional form" in r["keras_refused"], r
