"""`gs.auto_parallel` of a Keras model as it is (`tf_gspmd/_parallel/planned_model.py`): its own variables and
Keras optimizer, every variable and slot stored on its stage's submesh for the whole run, the update run there,
checked against the same model trained without tf_gspmd; checkpoints of a planned run restore onto a plain model."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd.errors import InputError
from tf_gspmd.rewriter.stages import calibrate
from tf_gspmd._layout.sharding import to_sharding
from conftest import HostReads

keras = pytest.importorskip("keras")

V, D, F, S, N, H, BLOCKS = 256, 32, 64, 8, 16, 4, 2
# (cheap calls and moves, under which the planner pipelines this small model)
CAL = dataclasses.replace(calibrate.DEFAULT, seconds_per_call=2e-5, seconds_per_transfer_byte=1e-11,
                          seconds_per_move=1e-7, parallel_devices=float("inf"))
BUDGET = 350_000   # bytes per device: less than the weights and Adam's two moments


def build(seed=0):
  """A transformer of Keras layers: an embedding, blocks of MultiHeadAttention and a GELU MLP, each added back and
  layer-normalised, a vocabulary head."""
  keras.utils.set_random_seed(seed)
  tokens = keras.Input((S,), dtype="int32")
  x = keras.layers.Embedding(V, D)(tokens)
  for _ in range(BLOCKS):
    x = keras.layers.LayerNormalization()(x + keras.layers.MultiHeadAttention(H, D // H)(x, x))
    h = keras.layers.Dense(F, activation="gelu")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(D)(h))
  return keras.Model(tokens, keras.layers.Dense(V)(x))


def data(seed):
  rng = np.random.default_rng(seed)
  return rng.integers(0, V, (N, S)).astype(np.int32), rng.integers(0, V, (N, S)).astype(np.int32)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def plain_step(model, opt, tokens, labels):
  """The step without tf_gspmd. (Its gradients dense: Keras's Adam updates an embedding's IndexedSlices gradient
  with each looked-up row squared apart, which differs from Adam on the summed gradient; the planned step's
  gradients are dense.)"""
  with tf.GradientTape() as tape:
    loss = LOSS(labels, model(tokens, training=True))
  grads = tape.gradient(loss, model.trainable_variables)
  opt.apply([tf.convert_to_tensor(g) for g in grads], model.trainable_variables)
  return float(loss)


@pytest.fixture(scope="module")
def planned():
  model, opt = build(), keras.optimizers.Adam(0.01)
  step = gs.auto_parallel(model, *data(1), optimizer=opt, loss=LOSS, mesh=gs.Mesh((2, 4), ("host", "device")),
                          microbatches=4, layers=6, calibration=CAL, intra_candidate=False, memory_budget=BUDGET,
                          max_stage_rows=1)   # (stages within a row: at least two)
  return model, opt, step


def _stored_on_home(step, name, variable):
  """`variable` is stored on the submesh of parameter `name`'s home stage, each device holding its planned tile."""
  k, spec = step.step.homes[name]
  mesh = step.step.stages[k].mesh
  assert gs.sharding_of(variable) == to_sharding(spec, mesh, rank=len(variable.shape)), (variable.path, spec)
  shards = gs.shards_of(variable)
  assert [s.device for s in shards] == list(mesh.resolve_devices()), variable.path
  tile = gs.sharding_of(variable).shard_shape(tuple(variable.shape))
  assert all(s.shape == tuple(min(t, n) for t, n in zip(tile, variable.shape)) for s in shards), variable.path
  return spec


def test_a_keras_model_trains_with_its_own_adam_its_state_staying_on_the_stage_meshes(planned, monkeypatch):
  """Three steps equal the plain model's with Keras's Adam (loss 1e-5 relative); every variable and Adam moment
  stays stored on its stage's submesh in the planned layout; the only values a step brings to the host are the
  losses."""
  model, opt, step = planned
  assert len(step.step.stages) > 1, step.step.describe()
  nbytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
  assert 3 * nbytes > BUDGET   # (the weights and Adam's moments do not fit one device)
  plain, plain_opt = build(), keras.optimizers.Adam(0.01)
  reads = HostReads(monkeypatch)
  for seed in (1, 2, 3):
    tokens, labels = data(seed)
    loss = step(tokens, labels)
    np.testing.assert_allclose(loss, plain_step(plain, plain_opt, tokens, labels), rtol=1e-5)
  assert reads.shapes and all(s == () for s in reads.shapes), reads.shapes   # the losses, nothing else
  assert int(opt.iterations.numpy()) == 3
  split = 0
  names = step.step.state.param_names
  for n, v in zip(names, model.trainable_variables):
    spec = _stored_on_home(step, n, v)
    slots = [s for s in opt.variables if s.path.startswith(f"{opt.name}/{v.path.replace('/', '_')}_")]
    assert len(slots) == 2, (v.path, [s.path for s in opt.variables])
    for slot in slots:
      _stored_on_home(step, n, slot)
    split += any(a is not None for a in spec)
  assert split >= 4, step.step.describe()
  monkeypatch.undo()
  for a, b in zip(model.trainable_variables, plain.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=2e-5, err_msg=a.path)


def test_a_checkpoint_of_the_planned_run_restores_onto_a_plain_model(planned, tmp_path):
  """tf.train.Checkpoint of the planned model and optimizer (each variable saved as its tiles) restores onto the
  same architecture built without tf_gspmd: equal variables and Adam moments; and back onto the planned one."""
  model, opt, step = planned
  step(*data(7))
  path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "planned"))
  plain, plain_opt = build(seed=5), keras.optimizers.Adam(0.01)
  plain_opt.build(plain.trainable_variables)
  tf.train.Checkpoint(model=plain, optimizer=plain_opt).read(path).assert_consumed()
  for a, b in zip(model.trainable_variables + opt.variables, plain.trainable_variables + plain_opt.variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
  want = [v.numpy() for v in model.trainable_variables]
  step(*data(8))   # (moves the planned model on)
  tf.train.Checkpoint(model=model, optimizer=opt).read(path).assert_consumed()
  for v, w in zip(model.trainable_variables, want):
    np.testing.assert_array_equal(v.numpy(), w, err_msg=v.path)
  assert gs.sharding_of(model.trainable_variables[0]) is not None   # (still stored on its stage)


def test_a_compiled_model_brings_its_optimizer_and_loss():
  """gs.auto_parallel(model, x, y, ...) of a model compiled with an optimizer and a loss by name trains as plain
  Keras's step with the same optimizer and loss."""
  model, plain = build(), build()
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mean_squared_error")
  def batch(seed):   # (tokens, a float target per token)
    tokens, labels = data(seed)
    return tokens, (labels[..., None] / V).astype(np.float32)

  step = gs.auto_parallel(model, *batch(1), mesh=gs.Mesh((2, 4), ("host", "device")), microbatches=2, layers=4,
                          calibration=CAL, intra_candidate=False, max_stage_rows=1)
  assert step.optimizer is model.optimizer and "stage 1" in str(step)
  opt = keras.optimizers.SGD(0.1)
  for seed in (1, 2):
    tokens, target = batch(seed)
    with tf.GradientTape() as tape:
      want = tf.reduce_mean(tf.square(target - plain(tokens, training=True)))
    opt.apply([tf.convert_to_tensor(g) for g in tape.gradient(want, plain.trainable_variables)],
              plain.trainable_variables)
    np.testing.assert_allclose(step(tokens, target), want.numpy(), rtol=1e-5)


def test_what_a_per_stage_update_cannot_honour_is_refused():
  mesh = gs.Mesh((2, 4), ("host", "device"))
  kw = dict(mesh=mesh, microbatches=4, layers=6, calibration=CAL, intra_candidate=False)
  with pytest.raises(InputError, match="global_clipnorm"):
    gs.auto_parallel(build(), *data(1), optimizer=keras.optimizers.Adam(0.01, global_clipnorm=1.0), loss=LOSS, **kw)
  used = keras.optimizers.Adam(0.01)
  used.build(build().trainable_variables)
  with pytest.raises(InputError, match="built already"):
    gs.auto_parallel(build(), *data(1), optimizer=used, loss=LOSS, **kw)
  with pytest.raises(InputError, match="needs optimizer="):
    gs.auto_parallel(build(), *data(1), loss=LOSS, **kw)
  normed = keras.Sequential([keras.Input((8,)), keras.layers.BatchNormalization(), keras.layers.Dense(4)])
  with pytest.raises(InputError, match="non-trainable variables"):
    gs.auto_parallel(normed, np.zeros((16, 8), np.float32), np.zeros((16, 4), np.float32), loss=LOSS,
                     optimizer=keras.optimizers.Adam(), **kw)
  with pytest.raises(InputError, match="for a Keras model"):
    gs.auto_parallel(lambda p, x: tf.reduce_mean(x * p), np.ones(4, np.float32), np.ones((16, 4), np.float32),
                     optimizer=keras.optimizers.Adam(), **kw)
