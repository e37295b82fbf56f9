"""Sharded variable storage: captured variables live as shards on the mesh devices and train in place."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.runtime.state import storage_of

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

MESH = gs.Mesh((2, 4), ("data", "model"))


def _sgd_pair(rng, spec):
  w0 = rng.standard_normal((12, 10)).astype(np.float32)
  w, w_ref = tf.Variable(w0), tf.Variable(w0)

  @gs.function(mesh=MESH, in_shardings=(P("data", None),))
  def step(x):
    wv = gs.shard(w, spec)
    with tf.GradientTape() as tape:
      tape.watch(wv)
      loss = tf.reduce_mean(tf.square(x @ wv))
    w.assign_sub(0.1 * tape.gradient(loss, wv))
    return loss

  def ref_step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(x @ w_ref))
    w_ref.assign_sub(0.1 * tape.gradient(loss, w_ref))
    return loss

  return w, w_ref, step, ref_step


@pytest.mark.parametrize("spec", [P(None, "model"), P("model", "data"), P()])
def test_variable_trains_in_place_on_its_shards(rng, spec):
  w, w_ref, step, ref_step = _sgd_pair(rng, spec)
  x = rng.standard_normal((8, 12)).astype(np.float32)
  for _ in range(3):
    assert_close(step(x).numpy(), ref_step(x).numpy())
  storage = storage_of(w)
  assert gs.sharding_of(w) == gs.Sharding.from_spec(MESH, spec, rank=2)
  # Each device holds only its shard (10 columns over 4 devices: 3 each, padded).
  assert all(tuple(c.shape.as_list()) == storage.shard_shape for c in storage.components)
  if storage.stacked:   # one graph for every device: the shards are the rows of one variable on the first
    assert storage.stack.shape == (8,) + tuple(storage.shard_shape)
    assert storage.stack.device == MESH.resolve_devices()[0]
  else:
    assert [c.device for c in storage.components] == list(MESH.resolve_devices())
  assert_close(w.numpy(), w_ref.numpy())          # an eager read gives the current global value
  assert_close(w.value(), w_ref.value())
  assert_close(tf.convert_to_tensor(w), w_ref.numpy())


def test_plain_tf_function_reads_and_writes_see_the_current_value(rng):
  """A tf.function traced once reads the shards' value on every call, and what it writes reaches the shards."""
  w, w_ref, step, ref_step = _sgd_pair(rng, P(None, "model"))
  x = rng.standard_normal((8, 12)).astype(np.float32)

  @tf.function
  def forward(t):
    return t @ w

  @tf.function
  def nudge():
    w.assign_add(tf.ones_like(w))

  for _ in range(2):          # the same trace, called after each step
    step(x)
    ref_step(x)
    assert_close(forward(x).numpy(), x @ w_ref.numpy())
  nudge()
  w_ref.assign_add(tf.ones_like(w_ref))
  assert_close(step(x).numpy(), ref_step(x).numpy())   # the step starts from the written value
  assert_close(forward(x).numpy(), x @ w_ref.numpy())
  assert_close(w.numpy(), w_ref.numpy())


def test_eager_writes_reach_the_shards_and_the_step_does_not_gather(rng):
  w, w_ref, step, ref_step = _sgd_pair(rng, P(None, "model"))
  x = rng.standard_normal((8, 12)).astype(np.float32)
  step(x)
  ref_step(x)
  for v in (w, w_ref):
    v.assign(v * 0.5)
    v.assign_add(tf.ones_like(v))
  assert_close(step(x).numpy(), ref_step(x).numpy())
  assert_close(w.numpy(), w_ref.numpy())
  low = step.lower(tf.TensorSpec([8, 12]))
  assert "all-gather" not in low.report.counts()


def test_variable_moves_to_another_mesh_with_its_value(rng):
  w0 = rng.standard_normal((8, 6)).astype(np.float32)
  w = tf.Variable(w0)
  on_24 = gs.function(lambda: gs.shard(w, P("model", None)) * 2.0, mesh=MESH)
  mesh8 = gs.Mesh((8,), ("x",))
  on_8 = gs.function(lambda: w.assign_add(gs.shard(w, P(None, "x")) + 1.0, read_value=True), mesh=mesh8)
  assert_close(on_24().numpy(), 2 * w0)
  assert gs.sharding_of(w).mesh == MESH
  assert_close(on_8().numpy(), 2 * w0 + 1)
  assert gs.sharding_of(w) == gs.Sharding.from_spec(mesh8, P(None, "x"))
  assert_close(on_24().numpy(), 2 * (2 * w0 + 1))
  assert_close(w.numpy(), 2 * w0 + 1)


def test_second_function_reads_the_stored_layout(rng):
  w = tf.Variable(rng.standard_normal((8, 16)).astype(np.float32))
  write = gs.function(lambda: w.assign(gs.shard(w, P(None, "model")) * 3.0), mesh=MESH)
  read_rows = gs.function(lambda: tf.identity(gs.shard(w, P("model", None)), name="r"), mesh=MESH)
  want = w.numpy() * 3.0
  write()
  low = read_rows.lower()
  assert low.shardings[low.program.variable_names[0]] == gs.Sharding.from_spec(MESH, P(None, "model"))
  assert_close(read_rows().numpy(), want)


def test_unsupported_writer_on_a_split_variable_is_a_typed_error(rng):
  w = tf.Variable(rng.standard_normal((8, 4)).astype(np.float32))

  def f():
    gs.shard(w, P("model", None))
    tf.raw_ops.ResourceStridedSliceAssign(ref=w.handle, begin=[0, 0], end=[1, 4], strides=[1, 1],
                                          value=tf.ones([1, 4]))
    return tf.constant(0.0)

  with pytest.warns(UserWarning), pytest.raises(gs.UnsupportedOpError, match="ResourceStridedSliceAssign.*stored split"):
    gs.function(f, mesh=MESH).lower()


@pytest.mark.parametrize("op", ["add", "sub", "max", "update"])
def test_scatter_into_row_split_variable(rng, op):
  w0 = rng.standard_normal((10, 3)).astype(np.float32)
  ids = np.array([0, 9, 4, 4, 7], np.int32)
  upd = rng.standard_normal((5, 3)).astype(np.float32)
  if op == "update":
    ids = np.array([0, 9, 4, 7, 2], np.int32)
  w, w_ref = tf.Variable(w0), tf.Variable(w0)

  def f(var, split):
    def run():
      if split:
        gs.shard(var, P("model", None))
      getattr(var, "scatter_" + op)(tf.IndexedSlices(tf.constant(upd), tf.constant(ids)))
      return tf.constant(0.0)
    return run

  gs.function(f(w, True), mesh=MESH)()
  f(w_ref, False)()
  assert_close(w.numpy(), w_ref.numpy())


def test_keras_transformer_trains_20_adam_steps_sharded_like_unpartitioned():
  keras = pytest.importorskip("keras")
  cfg = tm.Config(layers=12, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=8)
  keras.utils.set_random_seed(0)
  model, ref = tm.keras_model(cfg), tm.keras_model(cfg)
  ref.set_weights(model.get_weights())
  opt, ref_opt = keras.optimizers.Adam(1e-2), keras.optimizers.Adam(1e-2)
  opt.build(model.trainable_variables)
  ref_opt.build(ref.trainable_variables)
  step = gs.function(tm.make_keras_train_step(model, opt), mesh=MESH, in_shardings=(P("data", None),) * 2)
  ref_step = tf.function(tm.make_keras_train_step(ref, ref_opt))
  low = step.lower(*[tf.TensorSpec([cfg.batch, cfg.seq], tf.int32)] * 2)
  assert low.report.fallbacks == ()
  assert "all-gather" not in low.report.counts()     # the Megatron-split weights are never gathered
  losses, ref_losses = [], []
  for i in range(20):
    tokens, targets = tm.synthetic_batch(cfg, seed=i)
    losses.append(float(step(tokens, targets).numpy()))
    ref_losses.append(float(ref_step(tokens, targets).numpy()))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
  assert np.mean(losses[-5:]) < np.mean(losses[:5])
  up = model.get_layer("l3_up").kernel
  assert gs.sharding_of(up).spec == P(None, "model")
  assert tuple(storage_of(up).components[0].shape.as_list()) == (cfg.d_model, cfg.d_ff // 4)
  slot = opt._momentums[[v.path for v in model.trainable_variables].index(up.path)]  # pylint: disable=protected-access
  assert gs.sharding_of(slot).spec == P(None, "model")
  for v, got, want in zip(model.weights, model.get_weights(), ref.get_weights()):
    if v.path.endswith("attn/key/bias"):
      # Softmax over keys ignores a bias added to every key's logit: this gradient is exactly zero in exact
      # arithmetic, so both runs update it from rounding noise that Adam scales up to a fraction of the lr.
      assert np.abs(want).max() < 1e-2 and np.abs(got).max() < 1e-2
      continue
    # Adam divides each gradient by its running RMS, so rounding differences (TF's ring all-reduce sums in another
    # order than one device does) grow over 20 steps at lr 1e-2 to ~1e-4 in a few elements; a wrong gradient
    # moves a weight by up to the learning rate per step.
    assert_close(got, want, rtol=1e-3, atol=3e-4)
  assert int(opt.iterations.numpy()) == 20


def _keras_dp_step(model, opt):
  def step(tokens, targets):
    with tf.GradientTape() as tape:
      logits = model(tokens, training=True)
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits))
    opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return loss
  return step


def test_weight_update_sharding_divides_optimizer_state_and_matches():
  keras = pytest.importorskip("keras")
  cfg = tm.Config(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=8)
  mesh = gs.Mesh((8,), ("data",))
  keras.utils.set_random_seed(1)
  model, ref = tm.keras_model(cfg), tm.keras_model(cfg)
  ref.set_weights(model.get_weights())
  opt, ref_opt = keras.optimizers.Adam(1e-2), keras.optimizers.Adam(1e-2)
  opt.build(model.trainable_variables)
  ref_opt.build(ref.trainable_variables)
  specs = [tf.TensorSpec([cfg.batch, cfg.seq], tf.int32)] * 2
  wus = gs.function(_keras_dp_step(model, opt), mesh=mesh, in_shardings=(P("data", None),) * 2,
                    weight_update_sharding=True)
  plain = gs.function(_keras_dp_step(model, opt), mesh=mesh, in_shardings=(P("data", None),) * 2)
  low, low_plain = wus.lower(*specs), plain.lower(*specs)
  local, total = low.report.state_bytes("update state")
  plain_local, plain_total = low_plain.report.state_bytes("update state")
  assert total == plain_total == plain_local
  counter = 8   # Adam's int64 step counter stays whole
  assert local == (total - counter) // 8 + counter
  assert low.report.state_bytes("weight") == low_plain.report.state_bytes("weight")   # weights stay replicated
  counts = low.report.counts()
  assert counts["reduce-scatter"] >= 20 and counts["all-gather"] == len(model.trainable_variables)
  assert low_plain.report.counts() == {"all-reduce": low_plain.report.counts()["all-reduce"]}
  # Same traffic on the wire as the all-reduces it replaces (the loss's scalar all-reduce aside).
  assert low.report.wire_bytes_per_device() <= low_plain.report.wire_bytes_per_device()
  assert low.report.wire_bytes_per_device() >= 0.95 * low_plain.report.wire_bytes_per_device()
  ref_step = tf.function(_keras_dp_step(ref, ref_opt))
  for i in range(4):
    tokens, targets = tm.synthetic_batch(cfg, seed=i)
    assert_close(wus(tokens, targets).numpy(), ref_step(tokens, targets).numpy(), rtol=1e-5)
  m = opt._momentums[0]  # pylint: disable=protected-access
  assert storage_of(m).components[0].shape.num_elements() * 8 >= m.shape.num_elements()
  assert storage_of(m).components[0].shape.num_elements() < m.shape.num_elements()
  for got, want in zip(model.get_weights(), ref.get_weights()):
    assert_close(got, want, rtol=1e-3, atol=1e-4)   # Adam turns float round-off of ~0 gradients into 1e-5 steps
  assert "update state variables" in str(low.report)


def test_weight_update_sharding_with_megatron_layout_adds_the_data_axis():
  keras = pytest.importorskip("keras")
  cfg = tm.Config(layers=1, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=8)
  model = tm.keras_model(cfg)
  opt = keras.optimizers.AdamW(1e-2)
  opt.build(model.trainable_variables)
  f = gs.function(tm.make_keras_train_step(model, opt), mesh=MESH, in_shardings=(P("data", None),) * 2,
                  weight_update_sharding="data")
  low = f.lower(*[tf.TensorSpec([cfg.batch, cfg.seq], tf.int32)] * 2)
  slot = opt._momentums[[v.path for v in model.trainable_variables].index(  # pylint: disable=protected-access
      model.get_layer("l0_up").kernel.path)]
  handle = low.program.variable_names[[id(v) for v in low.program.variables].index(id(slot.value))]
  assert set(low.shardings[handle].used_axes) == {"data", "model"}
  with pytest.raises(gs.MeshError, match="not an axis"):
    gs.function(lambda: None, mesh=MESH, weight_update_sharding="batch")


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_keras_optimizers_train_with_a_vocabulary_split_embedding(name):
  keras = pytest.importorskip("keras")
  cfg = tm.Config(layers=1, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=8)
  keras.utils.set_random_seed(2)
  model, ref = tm.keras_model(cfg), tm.keras_model(cfg)
  ref.set_weights(model.get_weights())
  make = {"SGD": lambda: keras.optimizers.SGD(0.5), "AdamW": lambda: keras.optimizers.AdamW(1e-2)}[name]
  opt, ref_opt = make(), make()
  opt.build(model.trainable_variables)
  ref_opt.build(ref.trainable_variables)
  inner = tm.make_keras_train_step(model, opt)

  def step(tokens, targets):
    gs.shard(model.get_layer("embed").embeddings, P("model", None))   # SGD's embedding update is a scatter
    return inner(tokens, targets)

  f = gs.function(step, mesh=MESH, in_shardings=(P("data", None),) * 2)
  ref_step = tf.function(tm.make_keras_train_step(ref, ref_opt))
  for i in range(3):
    tokens, targets = tm.synthetic_batch(cfg, seed=i)
    assert_close(f(tokens, targets).numpy(), ref_step(tokens, targets).numpy(), rtol=1e-5)
  assert gs.sharding_of(model.get_layer("embed").embeddings).spec == P("model", None)
  for got, want in zip(model.get_weights(), ref.get_weights()):
    assert_close(got, want, rtol=1e-3, atol=1e-4)


def _rebuilt(shards, shape, dtype):
  out = np.full(shape, np.nan if np.issubdtype(dtype, np.floating) else -1, dtype)
  for s in shards:
    piece = s.numpy()
    assert piece.shape == s.shape == tuple(i.stop - i.start for i in s.index)
    assert all(0 <= i.start <= i.stop <= n for i, n in zip(s.index, shape))   # padding excluded
    out[s.index] = piece
  return out


@pytest.mark.parametrize("shape", [(4, 8), (3, 10), (1, 6)], ids=["even", "uneven", "padding_only_tiles"])
@pytest.mark.parametrize("spec", [P("data", "model"), P("model", None), P(None, ("data", "model")), P()])
def test_shards_of_a_sharded_tensor_rebuilds_its_value(shape, spec):
  value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  x = gs.function(lambda t: t + 0, mesh=MESH, in_shardings=(spec,), out_shardings=spec)(value)
  assert gs.sharding_of(x) is not None
  shards = gs.shards_of(x)
  assert [s.device for s in shards] == list(MESH.resolve_devices())   # one per mesh device, in mesh order
  assert [s.position for s in shards] == list(range(MESH.size))
  np.testing.assert_array_equal(_rebuilt(shards, shape, np.float32), value)
  full = [s for s in shards if s.shape == shape]
  assert (len(full) == MESH.size) == (spec == P())


@pytest.mark.parametrize("shape", [(8, 12), (6, 10)], ids=["even", "uneven"])
def test_shards_of_a_sharded_variable_rebuilds_its_value(shape):
  v = gs.variable(gs.initializers.Normal(seed=1), shape, mesh=MESH, spec=P("data", "model"))
  shards = gs.shards_of(v)
  assert [s.device for s in shards] == list(MESH.resolve_devices())
  np.testing.assert_array_equal(_rebuilt(shards, shape, np.float32), v.numpy())
  assert {s.shape for s in shards} == ({(4, 3)} if shape == (8, 12) else {(3, 3), (3, 1)})
  v.assign(tf.ones(shape))   # an eager write reaches the pieces
  np.testing.assert_array_equal(_rebuilt(gs.shards_of(v), shape, np.float32), np.ones(shape, np.float32))
  with pytest.raises(gs.InputError, match="shards_of"):
    gs.shards_of(tf.Variable(tf.ones(shape)))


def test_eager_writes_between_steps_are_seen_by_the_next_step_exactly():
  """Eager writes between steps (assign, assign_add, a Keras metric's reset, on split and replicated variables)
  are what the next step reads, step after step: the first write of a set loads op by op, later ones in one call."""
  import keras  # pylint: disable=g-import-not-at-top
  w0 = np.arange(48, dtype=np.float32).reshape(8, 6) % 5
  pairs = {k: (tf.Variable(v), tf.Variable(v)) for k, v in (("w", w0), ("c", np.float32(0)))}
  metrics = (keras.metrics.Mean(), keras.metrics.Mean())
  x = (np.arange(32, dtype=np.float32).reshape(4, 8) % 3)

  def body(i, x, mean, shard=lambda t: t):
    w, c = (pairs[k][i] for k in ("w", "c"))
    y = x @ shard(w)
    c.assign_add(tf.reduce_sum(y))
    mean.update_state(y)
    w.assign_add(tf.ones_like(w))
    return y, c.read_value(), mean.result()

  step = gs.function(lambda x: body(0, gs.shard(x, P("data", None)), metrics[0], lambda w: gs.shard(w, P(None, "model"))),
                     mesh=MESH)
  ref = tf.function(lambda x: body(1, x, metrics[1]))
  writes = [lambda v: v.assign(v * 0 + 2), lambda v: v.assign_add(tf.ones_like(v) * 3), None]
  for k in range(7):
    for a, b in zip(step(x), ref(x)):
      np.testing.assert_array_equal(a.numpy(), b.numpy())
    write = writes[k % 3]
    for i in (0, 1):
      if write is None:
        metrics[i].reset_state()
      else:
        write(pairs["w"][i])
        write(pairs["c"][i])
  storage = storage_of(pairs["w"][0])
  assert storage is not None and not storage.sharding.is_replicated   # the split variable was written in place
  np.testing.assert_array_equal(pairs["w"][0].numpy(), pairs["w"][1].numpy())
  np.testing.assert_array_equal(pairs["c"][0].numpy(), pairs["c"][1].numpy())


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mesh=None), gs.InputError, r"mesh=None is not a gs\.Mesh.*mesh=gs\.Mesh"),
    (dict(mesh=(2, 4)), gs.InputError, r"mesh=\(2, 4\) is not a gs\.Mesh"),
    (dict(spec=None), gs.SpecError, r"spec=None.*spec=gs\.P\('data', 'model'\).*gs\.P\(\) to replicate"),
    (dict(shape=(None, 6)), gs.InputError, r"shape \(None, 6\) is not a shape.*whole number"),
    (dict(shape=(-1, 6)), gs.InputError, r"shape \(-1, 6\) is not a shape"),
    (dict(shape="8"), gs.InputError, r"shape '8' is not a shape"),
    (dict(shape=(2.5, 6)), gs.InputError, r"shape \(2\.5, 6\) is not a shape"),
    (dict(dtype=tf.int32), gs.InputError, r"'w'.*Uniform draws real numbers.*int32.*floating dtype"),
    (dict(dtype=tf.int64, initializer=gs.initializers.Normal()), gs.InputError, r"Normal draws real numbers"),
    (dict(dtype=tf.int32, initializer="glorot_uniform"), gs.InputError, r"VarianceScaling draws real numbers"),
    (dict(dtype=tf.bool), gs.InputError, r"Uniform draws real numbers.*bool"),
    (dict(dtype=tf.int32, initializer=2.5), gs.InputError, r"constant initializer 2\.5 is not a int32 value"),
    (dict(dtype=tf.uint8, initializer=300), gs.InputError, r"constant initializer 300\.0 is not a uint8 value"),
    (dict(dtype=tf.string, initializer=0), gs.InputError, r"dtype string is not a number type"),
    (dict(dtype="no_such_type"), gs.InputError, r"dtype 'no_such_type' is not a TF dtype"),
])
def test_gs_variable_arguments_that_do_not_fit_are_typed_errors(kwargs, error, match):
  """gs.variable checks its arguments before creating anything: each error names the argument and the fix (an
  integer dtype with a random initializer gave zeros without a word; mesh=None or spec=None crashed inside)."""
  args = dict(initializer="uniform", shape=(8, 6), dtype=tf.float32, mesh=MESH, spec=P("data", "model"), name="w")
  args.update(kwargs)
  with pytest.raises(error, match=match):
    gs.variable(args.pop("initializer"), args.pop("shape"), args.pop("dtype"), **args)


def test_gs_variable_takes_an_int_shape_and_integer_constants_as_tf_does():
  """shape=5 is (5,) as for tf.zeros(5); a constant an integer dtype holds fills it as tf.Variable would."""
  v = gs.variable(0.0, 5, mesh=MESH, spec=P("model"))
  assert v.shape == tf.zeros(5).shape == (5,)
  np.testing.assert_array_equal(v.numpy(), tf.zeros(5).numpy())
  for dtype, value in ((tf.int32, 3), (tf.int64, -7), (tf.uint8, 255), (tf.bool, True), (tf.int32, "zeros")):
    u = gs.variable(value, (4, 6), dtype, mesh=MESH, spec=P("data", "model"))
    want = tf.Variable(tf.zeros((4, 6), dtype) if value == "zeros" else tf.fill((4, 6), tf.constant(value, dtype)))
    assert u.dtype == want.dtype
    np.testing.assert_array_equal(u.numpy(), want.numpy())
