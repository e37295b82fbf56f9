"""gs.mpmd_pipeline: different stages on submeshes of different shapes, GPipe and 1F1B, against the
unpartitioned program (loss, gradients, SGD steps), the executed orders, the activations alive, the bytes moved
between stages, and the errors."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P

import cluster_runs
from conftest import assert_close

DEVS = [d.name for d in tf.config.list_logical_devices("CPU")]
# The model, shared with the 2-process run (tests/cluster_programs/mpmd_step.py).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cluster_programs"))
from mpmd_step import D, N, blocks, embed, head  # noqa: E402  pylint: disable=g-import-not-at-top
from mpmd_step import data as _data  # noqa: E402  pylint: disable=g-import-not-at-top
from mpmd_step import reference as _reference  # noqa: E402  pylint: disable=g-import-not-at-top
import mpmd_step  # noqa: E402  pylint: disable=g-import-not-at-top


def _mesh(shape, names, first):
  return gs.Mesh(shape, names, devices=DEVS[first:first + int(np.prod(shape))])


M0, M1, M2 = _mesh((1, 2), ("d", "m"), 0), _mesh((2, 2), ("d", "m"), 2), _mesh((2,), ("m",), 6)


def _stages(m0=M0, m1=M1, m2=M2):
  return mpmd_step.stages(gs, [m0, m1, m2])


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_loss_and_gradients_equal_the_unpartitioned_step(schedule):
  params, ids, labels = _data()
  pipe = gs.mpmd_pipeline(_stages(), microbatches=4, schedule=schedule)
  loss, grads = pipe(params, ids, labels)
  want_loss, want_grads = _reference(params, ids, labels)
  assert_close(loss, want_loss)
  for i, (got, want) in enumerate(zip(grads, want_grads)):
    assert len(got) == len(want)
    for g, w, p in zip(got, want, pipe.stages[i].param_shardings):
      assert g.sharding == gs.Sharding.from_spec(pipe.stages[i].mesh, p, rank=2)   # laid out like the parameter
      assert_close(g.numpy(), w)
  run = pipe.last_run
  assert run.order == gs.schedule_order(schedule, 3, 4)
  # 1F1B: stage i holds at most S - i microbatch inputs (here exactly, B >= S); GPipe holds all B
  assert run.peak_alive == ([3, 2, 1] if schedule == "1f1b" else [4, 4, 4])


def test_schedule_orders():
  assert gs.schedule_order("1f1b", 3, 4) == [
      [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)],
      [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
      [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]]
  assert gs.schedule_order("gpipe", 2, 2) == [[("F", 0), ("F", 1), ("B", 0), ("B", 1)]] * 2
  for s, b in [(4, 2), (4, 8), (1, 3)]:   # fewer microbatches than stages: warm-up stops at B
    for i, order in enumerate(gs.schedule_order("1f1b", s, b)):
      assert sorted(order) == sorted([("F", m) for m in range(b)] + [("B", m) for m in range(b)])
      alive = peak = 0
      for kind, m in order:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
        assert kind == "F" or ("F", m) in order[:order.index((kind, m))]
      assert peak == min(s - i, b)


def test_bytes_between_stages_are_the_receivers_slices():
  params, ids, labels = _data()
  pipe = gs.mpmd_pipeline(_stages(), microbatches=4)
  pipe(params, ids, labels)
  mb, f32 = N // 4, 4
  per_mb = {   # per destination device, per microbatch: activations forward, their gradients backward
      **{d: mb // 2 * D * f32 for d in M1.resolve_devices()},          # stage 0 -> 1: rows split over d
      **{d: mb * D * f32 for d in M2.resolve_devices()},               # stage 1 -> 2: replicated
      **{d: mb * (D // 2) * f32 for d in M0.resolve_devices()},        # stage 1 -> 0: stage 0's P(None, "m")
  }
  received = pipe.last_run.transfers.bytes_received()
  for d, n in per_mb.items():
    want = 4 * n + (4 * mb // 2 * D * f32 if d in M1.resolve_devices() else 0)   # stage 2 -> 1 gradients too
    assert received[d] == want, (d, str(pipe.last_run.transfers))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_sgd_steps_equal_plain_tensorflow(schedule):
  params, ids, labels = _data(1)
  pipe = gs.mpmd_pipeline(_stages(), microbatches=2, schedule=schedule)
  ref = [tuple(tf.Variable(p) for p in stage) for stage in params]
  got_losses, want_losses = [], []
  for _ in range(3):
    loss, grads = pipe(params, ids, labels)
    got_losses.append(loss)
    params = [tuple(p - 0.5 * g.numpy() for p, g in zip(ps, gs_)) for ps, gs_ in zip(params, grads)]
    with tf.GradientTape() as tape:
      want = head(ref[2], blocks(ref[1], embed(ref[0], ids)), labels)
    for v, g in zip(tf.nest.flatten(ref), tf.nest.flatten(tape.gradient(want, ref))):
      v.assign_sub(0.5 * tf.convert_to_tensor(g))
    want_losses.append(want.numpy())
  assert_close(got_losses, want_losses)
  assert got_losses[-1] < got_losses[0]


def test_sharded_parameters_and_loss_fn():
  """Parameters given as ShardedTensors on their stage's mesh (the gradients' layout), and a loss_fn applied to
  the last stage's logits."""
  params, ids, labels = _data(2)
  stages = _stages()
  logits = lambda ps, h: h @ ps[0]   # noqa: E731
  xent = lambda z, y: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))  # noqa: E731
  stages[2] = gs.Stage(logits, M2, (P(None, "m"),), P(), target_sharding=P())
  pipe = gs.mpmd_pipeline(stages, microbatches=2, loss_fn=xent)
  loss, grads = pipe(params, ids, labels)
  loss2, grads2 = pipe([tuple(g) for g in grads], ids, labels)   # ShardedTensors in place of arrays
  want, _ = _reference(params, ids, labels)
  assert_close(loss, want)
  want2, want_grads2 = _reference([tuple(g.numpy() for g in s) for s in grads], ids, labels)
  assert_close(loss2, want2)
  for got, w in zip(tf.nest.flatten(grads2), tf.nest.flatten(want_grads2)):
    assert_close(got.numpy(), w)


def test_one_thread_allows_shared_devices():
  params, ids, labels = _data()
  stages = _stages(m2=_mesh((2,), ("m",), 0))   # the head on stage 0's devices
  with pytest.raises(gs.MeshError, match=r"stage 0 and stage 2 both use device .*CPU:0.*concurrent=False"):
    gs.mpmd_pipeline(stages, microbatches=4)
  pipe = gs.mpmd_pipeline(stages, microbatches=4, concurrent=False)
  loss, grads = pipe(params, ids, labels)
  want_loss, want_grads = _reference(params, ids, labels)
  assert_close(loss, want_loss)
  for g, w in zip(tf.nest.flatten(grads), tf.nest.flatten(want_grads)):
    assert_close(g.numpy(), w)
  assert pipe.last_run.order == gs.schedule_order("1f1b", 3, 4)


def test_errors_name_the_stage_tensor_and_fix():
  params, ids, labels = _data()
  pipe = gs.mpmd_pipeline(_stages(), microbatches=3)
  with pytest.raises(gs.InputError, match=r"batch of shape \[16, 6\] does not split into microbatches=3"):
    pipe(params, ids, labels)
  pipe = gs.mpmd_pipeline(_stages(), microbatches=4)
  narrow = [(params[0][0][:, :12],), params[1], params[2]]   # stage 0 returns 12 features; stage 1 takes 16
  with pytest.raises(gs.InputError, match=r"\[stage 1\] stage 1 cannot run on the activations stage 0 returns, "
                                          r"float32\[4, 12\].*make stage 0's output match"):
    pipe(narrow, ids, labels)
  with pytest.raises(gs.InputError, match="params has 2 entries for 3 stages"):
    pipe(params[:2], ids, labels)
  with pytest.raises(gs.InputError, match="targets of shape"):
    pipe(params, ids, labels[:8])
  stages = _stages()
  stages[1] = gs.Stage(blocks, M1, stages[1].param_shardings, P("d", None, None))
  with pytest.raises(gs.SpecError, match=r"boundary into stage 1: its in_sharding does not fit the 2-D"):
    gs.mpmd_pipeline(stages, microbatches=4)(params, ids, labels)
  stages = _stages()
  stages[2] = gs.Stage(lambda ps, h, y: h @ ps[0], M2, (P(None, "m"),), P())
  with pytest.raises(gs.InputError, match=r"last stage \(stage 2\) returns shape \[4, 32\].*scalar loss"):
    gs.mpmd_pipeline(stages, microbatches=4)(params, ids, labels)
  with pytest.raises(gs.InputError, match="schedule='zb'"):
    gs.mpmd_pipeline(_stages(), microbatches=4, schedule="zb")


def test_a_failing_stage_fails_the_step_without_hanging():
  """A stage whose program raises at run time (an assertion on the values): the step raises that error, the
  other stages' threads stop instead of waiting for values that never come."""
  params, ids, labels = _data()
  stages = _stages()

  def checked(ps, h):
    with tf.control_dependencies([tf.debugging.assert_less(tf.reduce_max(tf.abs(h)), 1e-3, message="too large")]):
      return blocks(ps, h)

  stages[1] = gs.Stage(checked, M1, stages[1].param_shardings, P("d", None), P("d", None))
  with pytest.raises(tf.errors.InvalidArgumentError, match="too large"):
    gs.mpmd_pipeline(stages, microbatches=4)(params, ids, labels)
  with pytest.raises(gs.InputError, match="exchange='nccl'"):
    gs.mpmd_pipeline(_stages(), microbatches=4, exchange="nccl")


def test_stages_in_two_processes(exchange):
  """2 processes x 4 CPUs (tests/cluster_programs/mpmd_step.py): stage 0 on process 0, stages 1 and 2 on process 1.
  Each process runs its own stages' orders; loss and gradients equal plain TF's; between the processes move only
  the receivers' slices: per microbatch, stage 0's activations [4, 16] to stage 1's two devices (replicated
  there, 2 x 256 B) and their gradients to stage 0's four devices (P(None, "m"), 4 x [4, 8], 512 B)."""
  results = cluster_runs.launch(2, "mpmd_step.py", exchange=exchange)
  for schedule in ("1f1b", "gpipe"):
    p0, p1 = results[0][schedule], results[1][schedule]
    assert p0["stages"] == [0] and p1["stages"] == [1, 2]
    assert p0["grads_equal"] and p1["grads_equal"]
    assert p0["loss"] is None and abs(p1["loss"] - p1["want_loss"]) <= 1e-5 * abs(p1["want_loss"])
    want = [[list(s) for s in o] for o in gs.schedule_order(schedule, 3, 4)]
    assert p0["order"] == [want[0], [], []] and p1["order"] == [[], want[1], want[2]]
    assert p0["crossing"] == p1["crossing"] == 4 * (2 * 256 + 4 * 128)
  assert results[1]["1f1b"]["peak_alive"] == [0, 2, 1] and results[0]["1f1b"]["peak_alive"] == [3, 0, 0]


def test_stages_pass_structures_of_tensors_each_in_its_own_layout():
  """A skip connection (a pair) and a dict travel between stages tensor by tensor, each resharded into the layout
  the next stage takes it in; loss and gradients equal the unpartitioned step's."""
  rng = np.random.default_rng(5)
  w0, w1, w2 = (rng.standard_normal(s).astype(np.float32) * 0.3 for s in [(8, 16), (16, 16), (16, 4)])
  x, y = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)

  def f0(p, h):
    a = tf.nn.relu(h @ p[0])
    return a, a * 0.5          # (h, skip)

  def f1(p, h):
    a, skip = h
    return {"h": tf.nn.tanh(a @ p[0]) + skip, "gate": tf.reduce_mean(a, axis=1, keepdims=True)}

  def f2(p, h, t):
    out = (h["h"] * tf.sigmoid(h["gate"])) @ p[0]
    return tf.reduce_mean(tf.square(out - t))

  stages = [gs.Stage(f0, M0, P(None, "m"), P("d", None), out_sharding=(P(None, "m"), P())),
            gs.Stage(f1, M1, P(None, "m"), in_sharding=(P("d", None), P(None, "m")),
                     out_sharding={"h": P("d", None), "gate": None}),
            gs.Stage(f2, M2, P(), in_sharding={"h": P(None, "m"), "gate": P()}, target_sharding=P())]
  pipe = gs.mpmd_pipeline(stages, microbatches=2)
  loss, grads = pipe([(w0,), (w1,), (w2,)], x, y)

  ws = [tf.Variable(w) for w in (w0, w1, w2)]
  want_loss, want_grads = 0.0, [0.0, 0.0, 0.0]
  for xm, ym in zip(np.split(x, 2), np.split(y, 2)):   # the mean of the microbatch losses
    with tf.GradientTape() as tape:
      l = f2((ws[2],), f1((ws[1],), f0((ws[0],), xm)), ym) / 2
    want_loss += float(l.numpy())
    want_grads = [a + g.numpy() for a, g in zip(want_grads, tape.gradient(l, ws))]
  assert_close(loss, want_loss)
  for got, want in zip(grads, want_grads):
    assert_close(got[0].numpy(), want)
  # Each tensor of a structure moves on its own, into its own layout: per microbatch of 8 rows, a device of the
  # last stage receives its half of the dict's "h" [8, 16] (P(None, "m")) and all of "gate" [8, 1]; one of the
  # first stage receives the gradients of its pair in the pair's layouts (P(None, "m"), P()).
  received, f32 = pipe.last_run.transfers.bytes_received(), 4
  for d in M2.resolve_devices():
    assert received[d] == 2 * (8 * 8 + 8 * 1) * f32, (d, str(pipe.last_run.transfers))
  for d in M0.resolve_devices():
    assert received[d] == 2 * (8 * 8 + 8 * 16) * f32, (d, str(pipe.last_run.transfers))


def test_integer_activations_travel_forward_in_their_dtype_and_no_gradient_comes_back_for_them():
  """A router's expert indices (int32) go from stage 0 to stage 1 beside the hidden states, in their own layout and
  dtype; gradients come back for the hidden states alone. Loss and gradients equal the unpartitioned step's."""
  rng = np.random.default_rng(7)
  w0, table = rng.standard_normal((8, 16)).astype(np.float32) * 0.3, rng.standard_normal((4, 16)).astype(np.float32)
  x, y = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((16, 16)).astype(np.float32)

  def f0(p, h):
    a = tf.nn.relu(h @ p[0])
    return a, tf.argmax(a[:, :4], axis=1, output_type=tf.int32)   # (hidden, expert index per row)

  def f1(p, h, t):
    a, expert = h
    return tf.reduce_mean(tf.square(a * tf.gather(p[0], expert) - t))

  stages = [gs.Stage(f0, M0, P(None, "m"), P(), out_sharding=(P(None, "m"), P())),
            gs.Stage(f1, M2, P(), in_sharding=(P(None, "m"), P("m")), target_sharding=P())]
  pipe = gs.mpmd_pipeline(stages, microbatches=2)
  loss, grads = pipe([(w0,), (table,)], x, y)
  ws = [tf.Variable(w0), tf.Variable(table)]
  want_loss, want_grads = 0.0, [0.0, 0.0]
  for xm, ym in zip(np.split(x, 2), np.split(y, 2)):
    with tf.GradientTape() as tape:
      l = f1((ws[1],), f0((ws[0],), xm), ym) / 2
    want_loss += float(l.numpy())
    want_grads = [a + tf.convert_to_tensor(g).numpy() for a, g in zip(want_grads, tape.gradient(l, ws))]
  assert_close(loss, want_loss)
  for got, want in zip(grads, want_grads):
    assert_close(got[0].numpy(), want)
  # Per microbatch of 8 rows, a device of stage 1 receives its half of the hidden [8, 16] and of the indices [8]
  # (int32, P("m")); one of stage 0 receives its half of the hidden's gradient only.
  received = pipe.last_run.transfers.bytes_received()
  for d in M2.resolve_devices():
    assert received[d] == 2 * (8 * 8 + 4) * 4, (d, str(pipe.last_run.transfers))
  for d in M0.resolve_devices():
    assert received[d] == 2 * (8 * 8) * 4, (d, str(pipe.last_run.transfers))
  with pytest.raises(gs.InputError, match="no floating-point activations"):
    gs.mpmd_pipeline([gs.Stage(lambda p, h: tf.cast(h @ p[0], tf.int32), M0), stages[1]],
                     microbatches=2)([(w0,), (table,)], x, y)


def test_a_structure_layout_must_match_the_activations():
  def f0(p, h):
    return h @ p[0], h @ p[0]

  stages = [gs.Stage(f0, M0, P()), gs.Stage(lambda p, h, t: tf.reduce_mean(h[0] * p[0]) - tf.reduce_mean(t), M2,
                                           P(), in_sharding=(P(), P(), P()), target_sharding=P())]
  pipe = gs.mpmd_pipeline(stages, microbatches=1)
  with pytest.raises(gs.InputError, match="in_sharding .* does not match the structure"):
    pipe([(np.ones((4, 4), np.float32),), (np.ones((), np.float32),)], np.ones((2, 4), np.float32),
         np.ones((2, 1), np.float32))


def test_a_sum_reduction_adds_the_microbatch_losses_and_their_gradients():
  """reduction="sum": the loss is the microbatches' losses added (here each a mean over its rows, so the batch's
  mean x 4) and the gradients are that sum's; a reduction that is neither is a typed error naming it."""
  params, ids, labels = _data()
  mean_pipe = gs.mpmd_pipeline(_stages(), microbatches=4)
  sum_pipe = gs.mpmd_pipeline(_stages(), microbatches=4, reduction="sum")
  want_loss, want_grads = _reference(params, ids, labels)
  loss, grads = sum_pipe(params, ids, labels)
  assert_close(loss, 4 * want_loss)
  for got, want in zip(grads, want_grads):
    for g, w in zip(got, want):
      assert_close(g.numpy(), 4 * w)
  assert_close(mean_pipe(params, ids, labels)[0], want_loss)
  with pytest.raises(gs.InputError, match="reduction='max': give 'mean'"):
    gs.mpmd_pipeline(_stages(), microbatches=4, reduction="max")
