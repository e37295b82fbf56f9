"""Keras's distribution API on the TensorFlow backend through tf_gspmd.keras: DeviceMesh, TensorLayout, LayoutMap,
DataParallel, ModelParallel, distribute_tensor (eager and traced), the backend's distribute_variable, initialize,
list_devices, num_processes -- the behaviours Keras's own distribution tests check on JAX, with tf_gspmd's Mesh and
Sharding as the backend's mesh and layout, and every trained result compared with plain Keras's.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P

keras = pytest.importorskip("keras")
import tf_gspmd.keras as gsk  # noqa: E402  pylint: disable=g-import-not-at-top
from tf_gspmd._platform import compat as _compat  # noqa: E402  pylint: disable=g-import-not-at-top

dist = keras.distribution
backend_dl = _compat.keras_backend_distribution_lib()


def _mesh(shape=(2, 4), names=("batch", "model")):
  return dist.DeviceMesh(shape, list(names), dist.list_devices("cpu")[:8])


# ---- devices and processes


def test_devices_and_processes_of_one_process():
  assert dist.list_devices("cpu") == [f"cpu:{i}" for i in range(8)]
  assert dist.list_devices() == dist.list_devices("cpu")      # no accelerator: the CPUs
  assert dist.get_device_count("cpu") == 8 == dist.get_device_count()
  assert backend_dl.num_processes() == 1 and backend_dl.process_id() == 0
  distribution = dist.ModelParallel(layout_map=dist.LayoutMap(_mesh((4, 2))), batch_dim_name="batch")
  assert distribution.num_processes == 1 and distribution.num_model_replicas == 4
  assert distribution.data_shard_id == 0
  dataset = tf.data.Dataset.range(8).batch(4)
  assert distribution.distribute_dataset(dataset) is dataset   # one process: the whole dataset, as given


def test_initialize_reads_the_environment_and_checks_it(monkeypatch):
  monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "127.0.0.1:1234")
  monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "1")
  monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "0")
  assert dist.initialize() is None
  monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "127.0.0.1:1234,127.0.0.1:1235")
  monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "3")
  with pytest.raises(gs.MeshError, match=r"describes 3 processes"):
    dist.initialize()


# ---- DeviceMesh and TensorLayout: tf_gspmd's Mesh and Sharding as the backend's


def test_device_mesh_backend_mesh_is_a_gs_mesh_over_the_same_devices():
  mesh = _mesh((4, 2), ("data", "model"))
  assert mesh.shape == (4, 2) and mesh.axis_names == ["data", "model"] and mesh.devices.shape == (4, 2)
  backend = mesh.backend_mesh
  assert isinstance(backend, gs.Mesh)
  assert backend == gs.Mesh((4, 2), ("data", "model"), devices=[f"/device:CPU:{i}" for i in range(8)])
  assert [tf.DeviceSpec.from_string(d).device_index for d in backend.resolve_devices()] == list(range(8))
  assert mesh.backend_mesh is backend   # Keras caches it
  with pytest.raises(ValueError, match="Shape does not match the number of devices"):
    dist.DeviceMesh((4, 2), ["data", "model"], dist.list_devices("cpu")[:4])


@pytest.mark.parametrize("axes,spec", [(("data", None), P("data", None)), ((None, "model"), P(None, "model")),
                                       ((None, None, None), P(None, None, None)),
                                       (("model", "data"), P("model", "data"))])
def test_tensor_layout_backend_layout_is_a_gs_sharding(axes, spec):
  mesh = _mesh((4, 2), ("data", "model"))
  layout = dist.TensorLayout(axes, mesh)
  assert layout.backend_layout == gs.Sharding.from_spec(mesh.backend_mesh, spec, len(axes))
  assert layout.backend_layout.spec == spec


def test_tensor_layout_without_a_mesh_and_with_unknown_axes():
  with pytest.raises(gs.SpecError, match="device mesh is not set"):
    dist.TensorLayout(("data", None)).backend_layout   # pylint: disable=expression-not-assigned
  with pytest.raises(ValueError, match="Invalid axis names"):
    dist.TensorLayout(("data", "nope"), _mesh((4, 2), ("data", "model")))
  # A LayoutMap gives its layouts its mesh (set lazily), and with it a backend layout.
  layout_map = dist.LayoutMap(_mesh((4, 2), ("data", "model")))
  layout_map["dense/kernel"] = dist.TensorLayout((None, "model"))
  assert layout_map["dense/kernel"].backend_layout.spec == P(None, "model")


# ---- distribute_tensor, eager and traced; distribute_variable


def test_distribute_tensor_with_a_backend_layout():
  mesh = _mesh()
  value = np.arange(32, dtype=np.float32).reshape(8, 4)
  sharding = dist.TensorLayout(("batch", "model"), mesh).backend_layout
  with dist.ModelParallel(layout_map=dist.LayoutMap(mesh), batch_dim_name="batch").scope():
    got = dist.distribute_tensor(value, sharding)
  assert gs.sharding_of(got) == sharding and np.array_equal(got.numpy(), value)
  assert {p.shape for p in gs.shards_of(got)} == {(4, 1)}


def test_distribute_tensor_traced_lays_out_inside_a_partitioned_step_and_nothing_elsewhere():
  mesh = _mesh()
  layout = dist.TensorLayout(("batch", "model"), mesh)
  x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)

  def step(t):
    return tf.nn.relu(dist.distribute_tensor(t * 2.0, layout)) + 1.0

  want = tf.function(step)(x).numpy()   # a plain tf.function: the tensor unchanged
  f = gs.function(step, mesh=mesh.backend_mesh, in_shardings=P())
  np.testing.assert_allclose(f(x).numpy(), want, rtol=1e-6)
  low = f.lower(tf.TensorSpec([8, 8]))
  assert low.out_shardings[0].spec == P("batch", "model")   # the annotation carried to the result
  assert low.report.fallbacks == ()
  # The backend layout (a gs.Sharding) is taken as well.
  g = gs.function(lambda t: dist.distribute_tensor(t * 2.0, dist.TensorLayout((None, "model"), mesh).backend_layout),
                  mesh=mesh.backend_mesh, in_shardings=P())
  assert g.lower(tf.TensorSpec([8, 8])).out_shardings[0].spec == P(None, "model")
  np.testing.assert_allclose(g(x).numpy(), x * 2.0, rtol=1e-6)


def test_distribute_variable_creates_a_variable_laid_out_shard_by_shard():
  mesh = _mesh()
  value = np.arange(30, dtype=np.float32).reshape(5, 6)   # 5 rows over 2: uneven, padded
  v = backend_dl.distribute_variable(value, dist.TensorLayout(("batch", "model"), mesh))
  assert isinstance(v, tf.Variable) and gs.sharding_of(v).spec == P("batch", "model")
  np.testing.assert_array_equal(v.numpy(), value)
  rebuilt = np.zeros_like(value)
  for piece in gs.shards_of(v):
    rebuilt[piece.index] = piece.numpy()
    assert piece.shape[0] in (2, 3)
  np.testing.assert_array_equal(rebuilt, value)
  # A partitioned step reads it in place, laid out.
  f = gs.function(lambda x: x @ tf.transpose(v), mesh=mesh.backend_mesh, in_shardings=P())
  x = np.ones((3, 6), np.float32)
  np.testing.assert_allclose(f(x).numpy(), x @ value.T, rtol=1e-6)


def test_distribute_variable_relays_out_a_keras_variable_in_place():
  mesh = _mesh()
  layer = keras.layers.Dense(8)
  layer.build((None, 6))
  kernel = layer.kernel.numpy()
  got = backend_dl.distribute_variable(layer.kernel, dist.TensorLayout((None, "model"), mesh))
  assert got is layer.kernel and gs.sharding_of(layer.kernel).spec == P(None, "model")
  np.testing.assert_array_equal(layer.kernel.numpy(), kernel)
  layer.kernel.assign(kernel + 1.0)   # a later assignment keeps the layout (as weight loading does)
  assert gs.sharding_of(layer.kernel).spec == P(None, "model")
  np.testing.assert_array_equal(layer.kernel.numpy(), kernel + 1.0)


def test_distribute_variable_rejects_layouts_that_do_not_fit():
  mesh = _mesh()
  value = np.ones((4, 6), np.float32)
  with pytest.raises(gs.SpecError, match=r"1 entries but the value of shape \(4, 6\).*rank 2"):
    backend_dl.distribute_variable(value, dist.TensorLayout(("model",), mesh))
  with pytest.raises(gs.SpecError, match="dimensions 0 and 1 .* same mesh axis 'batch'"):
    backend_dl.distribute_variable(value, dist.TensorLayout(("batch", "batch"), mesh))
  with pytest.raises(gs.SpecError, match="^Cannot create sharding when device mesh is not set.*no distribution active"):
    backend_dl.distribute_variable(value, dist.TensorLayout((None, "model")))


# ---- LayoutMap, DataParallel and ModelParallel end to end


def test_layout_map_lookup_exact_key_first_then_one_regex():
  layout_map = dist.LayoutMap(_mesh())
  layout_map["dense/kernel"] = (None, "model")
  layout_map[".*dense.*kernel"] = (None, None)
  layout_map[".*bias"] = ("model",)
  layout_map[".*dense.*bias"] = (None,)
  distribution = dist.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
  plan = gsk._plan_of(distribution)  # pylint: disable=protected-access
  assert plan.spec_for("dense/kernel") == P(None, "model")        # the exact key, though a regex matches too
  assert plan.spec_for("dense_2/kernel") == P(None, None)
  assert plan.spec_for("conv/kernel") is None
  with pytest.raises(ValueError, match="matches multiple layout"):
    plan.spec_for("dense_2/bias")
  assert plan.mesh == distribution.device_mesh.backend_mesh and plan.batch_axis == "batch"


def _mlp(seed=0, dropout=0.0):
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((6, 4))
  h = keras.layers.Flatten()(inputs)
  h = keras.layers.Dense(32, activation="relu", name="dense_up")(h)
  if dropout:
    h = keras.layers.Dropout(dropout, seed=7)(h)
  out = keras.layers.Dense(10, activation="softmax", name="dense_out")(h)
  model = keras.Model(inputs, out)
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  return model


def _batches(rng, n=16):
  return rng.standard_normal((n, 6, 4)).astype(np.float32), rng.standard_normal((n, 10)).astype(np.float32)


def test_data_parallel_fit_matches_plain_keras(rng):
  x, y = _batches(rng)
  distribution = dist.DataParallel(devices=dist.list_devices("cpu"))
  assert distribution.device_mesh.axis_names == ["batch"] and distribution.batch_dim_name == "batch"
  assert distribution.get_data_layout((16, 6, 4)).axes == ("batch", None, None)
  with distribution.scope():
    model = _mlp()
    got = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    assert isinstance(model.train_function, gsk._Partitioned)  # pylint: disable=protected-access
    low = next(iter(model.train_function.functions.values())).lower(tf.TensorSpec([8, 6, 4]), tf.TensorSpec([8, 10]))
  want = _mlp().fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert low.in_shardings[0].spec == P("batch", None, None)   # the batch split over the data axis
  assert all(gs.sharding_of(w) is None or gs.sharding_of(w).is_replicated for w in model.weights)
  # Data parallelism: the gradients' all-reduce over "batch", nothing gathered.
  assert "all-reduce" in low.report.counts() and "all-gather" not in low.report.counts()


def test_model_parallel_weights_outputs_and_dropout_match_plain_keras(rng):
  """Kernels split over "model" by a regex map, the first dense output pinned batch-parallel, Dropout drawn per
  shard: the losses equal plain Keras's for the same seeds, and the layout map's layouts are the weights'."""
  x, y = _batches(rng)
  mesh = _mesh()
  layout_map = dist.LayoutMap(mesh)
  layout_map[".*dense.*kernel"] = dist.TensorLayout([None, "model"])
  layout_map[".*dense.*bias"] = dist.TensorLayout(["model"])
  layout_map[".*dense_up.*output"] = ("batch", None)
  distribution = dist.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
  assert distribution.get_data_layout((16, 6, 4)).axes == ("batch", None, None)
  with distribution.scope():
    model = _mlp(dropout=0.25)
    for w in model.weights:
      want_spec = (P(None, "model") if "kernel" in w.path else P("model") if "bias" in w.path else None)
      got_spec = gs.sharding_of(w).spec if gs.sharding_of(w) is not None else None
      assert got_spec == want_spec, (w.path, got_spec)
    with warnings.catch_warnings():
      warnings.simplefilter("error")   # every key matches something: no warning
      got = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    low = next(iter(model.train_function.functions.values())).lower(tf.TensorSpec([8, 6, 4]), tf.TensorSpec([8, 10]))
  want = _mlp(dropout=0.25).fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert low.report.fallbacks == ()
  # The "dense_up/output" layout is honoured: the layer's model-split output is gathered to P("batch", None) there.
  gathers = [c for c in low.report.collectives if c.kind == "all-gather"]
  assert [("dense_up" in c.source, "needs P('batch', None)" in c.reason) for c in gathers] == [(True, True)], gathers


def test_a_layout_map_key_that_matches_nothing_warns_once_per_key(rng):
  x, y = _batches(rng)
  layout_map = dist.LayoutMap(_mesh())
  layout_map["dense_up/kernel"] = (None, "model")
  layout_map["dense_upp/bias"] = ("model",)           # a typo
  layout_map["encoder/.*/kernel"] = (None, "model")   # a layer that is not there
  with dist.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
    model = _mlp()
    with pytest.warns(UserWarning) as caught:
      model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
      model.evaluate(x, y, batch_size=8, verbose=0)   # checked once per model
  messages = [str(w.message) for w in caught if "layout map key" in str(w.message)]
  assert len(messages) == 2, messages
  assert "'dense_upp/bias' matches no variable" in messages[0] and "dense_up/bias" in messages[0]   # the nearest
  assert "'encoder/.*/kernel' matches no variable" in messages[1] and "stays replicated" in messages[1]
  assert gs.sharding_of(model.get_layer("dense_up").kernel).spec == P(None, "model")


def test_a_batch_dim_name_that_is_not_a_mesh_axis_is_a_typed_error(rng):
  """ModelParallel(batch_dim_name=...) naming no axis of its mesh: a MeshError naming that argument, its value and
  the axes to choose from (not an error about an internal P of the step's first argument)."""
  x, y = _batches(rng)
  distribution = dist.ModelParallel(layout_map=dist.LayoutMap(_mesh()), batch_dim_name="data")
  with pytest.raises(gs.MeshError, match=r"\[batch_dim_name\] ModelParallel\(batch_dim_name='data'\): the device mesh "
                                         r"\{'batch': 2, 'model': 4\} has no axis 'data'.*one of \['batch', 'model'\]"):
    with distribution.scope():
      _mlp().fit(x, y, batch_size=8, epochs=1, verbose=0)
