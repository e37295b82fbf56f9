"""Keras 3 on the TF backend: fit / evaluate / predict partitioned through a LayoutMap, like plain Keras."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

keras = pytest.importorskip("keras")
import tf_gspmd.keras as gsk  # noqa: E402  pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

CFG = tm.Config(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=8)


def _data(n_batches, seed=0):
  xs, ys = zip(*[tm.synthetic_batch(CFG, seed=seed + i) for i in range(n_batches)])
  return np.concatenate(xs), np.concatenate(ys)


def _models():
  keras.utils.set_random_seed(0)
  model, ref = tm.keras_model(CFG), tm.keras_model(CFG)
  ref.set_weights(model.get_weights())
  for m in (model, ref):
    m.compile(optimizer=keras.optimizers.Adam(1e-2),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
  return model, ref


class _Record(keras.callbacks.Callback):
  def __init__(self):
    super().__init__()
    self.losses = []

  def on_train_batch_end(self, batch, logs=None):
    self.losses.append(float(logs["loss"]))


def _keras_layout_map(mesh):
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*(query|key|value)/kernel"] = (None, "model", None)
  layout_map[".*attention_output/kernel"] = ("model", None, None)
  layout_map[".*_up/kernel"] = (None, "model")
  layout_map[".*_up/bias"] = ("model",)
  layout_map[".*_down/kernel"] = ("model", None)
  layout_map["head/kernel"] = (None, "model")
  layout_map["l0_up/output"] = ("batch", None, "model")    # an activation annotation
  return layout_map


def test_fit_evaluate_predict_with_keras_model_parallel_match_plain_keras():
  x, y = _data(5)
  model, ref = _models()
  devices = keras.distribution.list_devices("cpu")[:8]
  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices)
  dist = keras.distribution.ModelParallel(layout_map=_keras_layout_map(mesh), batch_dim_name="batch")
  seen, ref_seen = _Record(), _Record()
  with dist.scope():
    model.fit(x, y, batch_size=CFG.batch, epochs=1, shuffle=False, verbose=0, callbacks=[seen])
    assert isinstance(model.train_function, gsk._Partitioned)  # pylint: disable=protected-access
    got_eval = model.evaluate(x, y, batch_size=CFG.batch, verbose=0)
    got_pred = model.predict(x[:16], batch_size=CFG.batch, verbose=0)
  ref.fit(x, y, batch_size=CFG.batch, epochs=1, shuffle=False, verbose=0, callbacks=[ref_seen])
  assert len(seen.losses) == 5                         # the user's callback saw every step
  np.testing.assert_allclose(seen.losses, ref_seen.losses, rtol=1e-4)
  np.testing.assert_allclose(got_eval, ref.evaluate(x, y, batch_size=CFG.batch, verbose=0), rtol=1e-4)
  # Training matched step by step (the losses above) and in evaluation. Adam scales near-zero gradients up to
  # the learning rate, so a weight whose gradient is ~0 may move either way in the two runs (the partial sums
  # are added in another order): predictions are compared on the same weights, the partitioned model's.
  ref.set_weights(model.get_weights())
  want_pred = ref.predict(x[:16], batch_size=CFG.batch, verbose=0)
  assert_close(got_pred, want_pred, rtol=1e-5, atol=1e-5 * np.abs(want_pred).max())
  up = model.get_layer("l0_up").kernel
  assert gs.sharding_of(up).spec == P(None, "model")
  assert gs.sharding_of(model.get_layer("l1_attn")._query_dense.kernel).spec == P(None, "model", None)  # pylint: disable=protected-access
  low = next(iter(model.train_function.functions.values())).lower(
      *[tf.TensorSpec([CFG.batch, CFG.seq], tf.int32)] * 2)
  assert low.report.fallbacks == ()
  # Weights are never gathered; the accuracy metric's argmax over vocab-split logits gathers only winners.
  gathers = [c for c in low.report.collectives if c.kind == "all-gather"]
  assert all(c.source == "ArgMax" and c.shape[0] == 4 for c in gathers), [str(c) for c in gathers]


def test_own_layout_map_scope_and_save_load_weights(tmp_path):
  x, y = _data(2, seed=10)
  model, ref = _models()
  assert gs.keras is gsk   # the documented spelling
  layouts = gs.keras.LayoutMap(gs.Mesh((2, 4), ("data", "model")), batch_axis="data")
  layouts[".*_up/kernel"] = P(None, "model")
  layouts[".*_down/kernel"] = P("model", None)
  with gs.keras.scope(layouts):
    hist = model.fit(x, y, batch_size=CFG.batch, epochs=2, shuffle=False, verbose=0)
  want = ref.fit(x, y, batch_size=CFG.batch, epochs=2, shuffle=False, verbose=0)
  np.testing.assert_allclose(hist.history["loss"], want.history["loss"], rtol=1e-4)
  assert gs.sharding_of(model.get_layer("l1_down").kernel).spec == P("model", None)
  path = str(tmp_path / "m.weights.h5")
  model.save_weights(path)
  ref.load_weights(path)
  for a, b in zip(model.get_weights(), ref.get_weights()):
    assert_close(a, b, rtol=0, atol=0)
  with pytest.raises(gs.InputError, match="matches several layout keys"):
    layouts[".*_up/.*"] = P()
    layouts["l0_up/kernel"]   # pylint: disable=pointless-statement


def test_variables_are_created_sharded_under_a_layout_map(rng, monkeypatch):
  monkeypatch.setattr(gsk, "WHOLE_INIT_MAX_BYTES", 0)   # as for variables too large to build whole
  layouts = gsk.LayoutMap(gs.Mesh((2, 4), ("data", "model")), batch_axis="data")
  layouts[".*_up/kernel"] = P(None, "model")
  layouts[".*_down/kernel"] = P("model", None)
  with gsk.scope(layouts):
    model = tm.keras_model(CFG)
    up = model.get_layer("l0_up").kernel
    # Split from creation, shard by shard: the variable itself holds no value until read.
    assert gs.sharding_of(up).spec == P(None, "model") and not up.value.is_initialized()
    values = up.numpy()
    assert values.shape == (CFG.d_model, CFG.d_ff) and 0.0 < values.std() < 1.0
    assert not np.allclose(values, model.get_layer("l1_up").kernel.numpy())   # seeded per variable
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(2, seed=20)
  _fits_like_plain_keras(model, layouts, x, y)


def _fits_like_plain_keras(model, layouts, x, y):
  """One epoch of `model` (compiled with Adam(1e-2)) under `layouts` gives plain Keras's losses from the same
  weights."""
  keras.utils.set_random_seed(0)
  plain = tm.keras_model(CFG)
  plain.set_weights(model.get_weights())
  plain.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  with gsk.scope(layouts):
    got = model.fit(x, y, batch_size=CFG.batch, epochs=1, shuffle=False, verbose=0).history["loss"]
  want = plain.fit(x, y, batch_size=CFG.batch, epochs=1, shuffle=False, verbose=0).history["loss"]
  np.testing.assert_allclose(got, want, rtol=1e-4)


def test_optimizer_slots_are_created_in_their_variables_layout(monkeypatch):
  """Adam's moments of a sharded kernel are created sharded like it (shard by shard when large), not whole in
  every process until the first step; training from there matches plain Keras."""
  monkeypatch.setattr(gsk, "WHOLE_INIT_MAX_BYTES", 0)
  layouts = gsk.LayoutMap(gs.Mesh((2, 4), ("data", "model")), batch_axis="data")
  layouts[".*_up/kernel"] = P(None, "model")
  layouts[".*_down/kernel"] = P("model", None)
  with gsk.scope(layouts):
    model = tm.keras_model(CFG)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
  up = model.get_layer("l0_up").kernel
  slots = [v for v in model.optimizer.variables if v.path.endswith(("l0_up_kernel_momentum", "l0_up_kernel_velocity"))]
  assert len(slots) == 2
  for slot in slots:
    assert gs.sharding_of(slot) == gs.sharding_of(up) and not slot.value.is_initialized(), slot.path
    np.testing.assert_array_equal(slot.numpy(), np.zeros(up.shape, np.float32))
  x, y = _data(2, seed=21)
  _fits_like_plain_keras(model, layouts, x, y)
  assert gs.sharding_of(slots[0]) == gs.sharding_of(up)


INITIALIZERS = ["glorot_uniform", "glorot_normal", "he_uniform", "he_normal", "lecun_uniform", "lecun_normal",
                "random_normal", "random_uniform", "truncated_normal", "orthogonal", "variance_scaling", "zeros", "ones",
                "identity"]


@pytest.mark.parametrize("init", INITIALIZERS)
def test_same_seed_gives_the_same_weights_under_a_distribution(init):
  """A model built under ModelParallel starts from the weights it gets without a distribution."""
  def build():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, kernel_initializer=init, name="up"),
                             keras.layers.Dense(32, kernel_initializer=init, name="down")])

  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*up/kernel"] = (None, "model")
  layout_map[".*down/kernel"] = ("model", None)
  with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
    model = build()
  want = build().get_weights()
  assert gs.sharding_of(model.get_layer("up").kernel).spec == P(None, "model")
  for got, w in zip(model.get_weights(), want):
    np.testing.assert_array_equal(got, w)


def test_distribution_initialize_of_one_process_or_an_incomplete_cluster(monkeypatch):
  """One process needs nothing; several need every address (TF's runtime has no coordinator-only start-up).
  (Joining real clusters: tests/platform/test_cluster.py.)"""
  for var in ("KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID"):
    monkeypatch.delenv(var, raising=False)
  assert keras.distribution.initialize(num_processes=1, process_id=0) is None
  assert keras.distribution.initialize("127.0.0.1:1234", 1) is None
  with pytest.raises(gs.MeshError, match="single process has process_id 0"):
    keras.distribution.initialize(num_processes=1, process_id=3)
  with pytest.raises(gs.MeshError, match=r"describes 2 processes.*host:port of every one of them"):
    keras.distribution.initialize("127.0.0.1:1234", num_processes=2, process_id=1)
  monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "2")   # Keras reads the environment, the backend checks
  with pytest.raises(gs.MeshError, match="describes 2 processes"):
    keras.distribution.initialize()
  assert keras.distribution.list_devices("cpu")[:2] == ["cpu:0", "cpu:1"]   # one process: Keras's own spelling


def test_dense_model_gradients_stay_split_through_the_optimizer(rng):
  """Keras's TF optimizer sums gradients through one IdentityN over all of them: each keeps its own split."""
  x = rng.standard_normal((32, 24)).astype(np.float32)
  y = rng.integers(0, 10, 32)

  def build():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((24,))
    h = keras.layers.Dense(48, activation="relu", name="up")(inputs)
    h = keras.layers.Dense(24, activation="relu", name="down")(h)
    m = keras.Model(inputs, keras.layers.Dense(10, name="head")(keras.layers.Dense(48, name="up2")(h)))
    m.compile(optimizer=keras.optimizers.Adam(1e-2),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m

  model, ref = build(), build()
  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map["up.*/kernel"] = (None, "model")
  layout_map["down/kernel"] = ("model", None)
  layout_map["head/kernel"] = ("model", None)
  with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
    hist = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  want = ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  np.testing.assert_allclose(hist.history["loss"], want.history["loss"], rtol=1e-4)
  low = next(iter(model.train_function.functions.values())).lower(tf.TensorSpec([8, 24]), tf.TensorSpec([8], tf.int64))
  assert "all-gather" not in low.report.counts(), [str(c) for c in low.report.collectives if c.kind == "all-gather"]
  assert gs.sharding_of(model.get_layer("head").kernel).spec == P("model", None)


def _model_parallel(mesh):
  return keras.distribution.ModelParallel(layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch")


@pytest.mark.parametrize("shape,axes", [((8, 12), ("batch", "model")), ((3, 10), ("batch", "model")),
                                        ((6, 5, 4), (None, "model", None)), ((4,), (None,))],
                         ids=["even", "uneven", "rank3", "replicated"])
def test_eager_distribute_tensor_lays_the_value_out(shape, axes):
  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  layout = keras.distribution.TensorLayout(axes, mesh)
  own = keras.distribution.distribute_tensor(value, layout)   # no distribution: on the layout's own mesh (as JAX's)
  assert gs.sharding_of(own).spec == P(*axes) and np.array_equal(own.numpy(), value)
  with _model_parallel(mesh).scope():
    got = keras.distribution.distribute_tensor(tf.constant(value), layout)
    assert isinstance(got, gs.ShardedTensor)
    assert gs.sharding_of(got).spec == P(*axes)
    np.testing.assert_array_equal(got.numpy(), value)
    rebuilt = np.zeros(shape, np.float32)
    for piece in gs.shards_of(got):
      rebuilt[piece.index] = piece.numpy()
    np.testing.assert_array_equal(rebuilt, value)
    assert keras.distribution.distribute_tensor(got, layout) is got   # already laid out so
    again = keras.distribution.distribute_tensor(got, keras.distribution.TensorLayout((None,) * len(shape), mesh))
    assert gs.sharding_of(again).is_replicated and np.array_equal(again.numpy(), value)   # relaid out
    # TF ops and Keras layers read it as its global value (an eager layer output with a layout is one)
    np.testing.assert_array_equal(tf.reduce_sum(got).numpy(), value.sum())


def test_a_layout_without_a_mesh_is_keras_value_error():
  """Keras's words first (its backends' ValueError), then ours; outside any distribution and in backend_layout."""
  layout = keras.distribution.TensorLayout(("batch", None))
  with pytest.raises(ValueError, match="^Cannot create sharding when device mesh is not set"):
    keras.distribution.distribute_tensor(np.ones((8, 12), np.float32), layout)
  with pytest.raises(ValueError, match="^Cannot create sharding when device mesh is not set.*DeviceMesh"):
    layout.backend_layout   # pylint: disable=pointless-statement


def test_eager_distribute_tensor_rejects_layouts_that_do_not_fit():
  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  value = np.ones((8, 12), np.float32)
  with _model_parallel(mesh).scope():
    with pytest.raises(gs.SpecError, match=r"1 entries but the tensor of shape \(8, 12\).*rank 2"):
      keras.distribution.distribute_tensor(value, keras.distribution.TensorLayout(("batch",), mesh))
    with pytest.raises(gs.SpecError, match=r"dimension 1 of the tensor of shape \(8, 12\).*axis 'nope'.*"
                                           r"\['batch', 'model'\]"):
      keras.distribution.distribute_tensor(value, keras.distribution.TensorLayout(("batch", "nope")))
    with pytest.raises(gs.SpecError, match="dimensions 0 and 1 .* same mesh axis 'model'"):
      keras.distribution.distribute_tensor(value, keras.distribution.TensorLayout(("model", "model"), mesh))


def test_eager_model_call_with_an_output_layout_under_a_distribution():
  keras.utils.set_random_seed(1)
  model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(8, name="d0"), keras.layers.Dense(3, name="d1")])
  x = np.linspace(-1, 1, 40, dtype=np.float32).reshape(4, 10)
  want = model(x).numpy()
  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*d0/output"] = ("batch", "model")
  with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
    assert_close(np.asarray(model(x)), want, rtol=1e-6, atol=1e-6)
    assert_close(model.predict(x, verbose=0), want, rtol=1e-5, atol=1e-5)
