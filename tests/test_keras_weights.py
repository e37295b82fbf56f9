"""Keras weight files with sharded variables (tf_gspmd/keras_weights.py): `save_weights` / `load_weights` under a
distribution write and read one tile at a time, never putting a variable together; the files are Keras's own
(plain Keras reads them and writes files a distribution loads); a file loads onto another mesh and layout; a
keras-hub preset loads slice by slice under its own layout map and generates plain Keras's tokens.
"""

import json
import os
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd._platform import compat as _compat
from tf_gspmd.runtime import state as _state

keras = pytest.importorskip("keras")
import tf_gspmd.keras as gsk  # noqa: E402  pylint: disable=g-import-not-at-top
from tf_gspmd import keras_weights  # noqa: E402  pylint: disable=g-import-not-at-top

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The model, as source: the plain-Keras subprocess builds the very same one.
MODEL_SOURCE = textwrap.dedent("""
    import keras
    import numpy as np

    def build_model():
      keras.utils.set_random_seed(7)
      inputs = keras.Input((12,))
      h = keras.layers.Dense(20, activation="relu", name="up")(inputs)
      h = keras.layers.Dense(6, name="down")(h)
      outputs = keras.layers.Dense(5, name="head")(h)
      model = keras.Model(inputs, outputs)
      model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
      model.optimizer.build(model.trainable_variables)
      return model

    def values(model):
      return [np.asarray(v.numpy()) for v in model.weights + model.optimizer.variables]
""")
_namespace = {}
exec(MODEL_SOURCE, _namespace)  # pylint: disable=exec-used
build_model, values = _namespace["build_model"], _namespace["values"]


def _distribution(shape, layouts):
  mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  layout_map = keras.distribution.LayoutMap(mesh)
  for key, axes in layouts.items():
    layout_map[key] = axes
  return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


# (2, 4): the up-projection split 4 ways over "model" (20 = 4 x 5), the head's rows unevenly (6 over 4), the
# down-projection over both axes.
LAYOUTS_A = {"up/kernel": (None, "model"), "up/bias": ("model",), "down/kernel": ("model", "batch"),
             "head/kernel": ("model", None)}
# (4, 2): other axes, other dims.
LAYOUTS_B = {"up/kernel": ("batch", "model"), "down/kernel": (None, "model"), "head/kernel": (None, "batch"),
             "head/bias": ("batch",)}


def _trained(distribution=None):
  """The model, one Adam step taken (so the slots hold values), under `distribution` when given."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(8, 12)).astype(np.float32), rng.normal(size=(8, 5)).astype(np.float32)
  if distribution is None:
    model = build_model()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model
  with distribution.scope():
    model = build_model()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  return model


def _split(model):
  return [v for v in model.weights + model.optimizer.variables
          if gs.sharding_of(v) is not None and not gs.sharding_of(v).is_replicated]


@pytest.fixture
def no_gather(monkeypatch):
  """Putting a sharded variable together (ShardedStorage.gather) fails the test while the fixture is on."""
  def gather(self):
    raise AssertionError(f"a sharded variable of shape {self.shape} was put together whole")
  state = {"on": False}
  original = _state.ShardedStorage.gather
  monkeypatch.setattr(_state.ShardedStorage, "gather",
                      lambda self: gather(self) if state["on"] else original(self))

  class Switch:
    def __enter__(self):
      state["on"] = True

    def __exit__(self, *exc):
      state["on"] = False
  return Switch()


def _assert_values(got, want):
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


def test_save_weights_round_trip_streams_tiles_and_equals_plain_keras(tmp_path, no_gather):
  model = _trained(_distribution((2, 4), LAYOUTS_A))
  split = {v.path for v in _split(model)}
  assert {"up/kernel", "up/bias", "down/kernel", "head/kernel"} <= split and len(split) >= 12   # and Adam's slots
  want = values(model)
  path = str(tmp_path / "sharded.weights.h5")
  with no_gather:
    model.save_weights(path)
  with h5py.File(path) as f:   # Keras's layout: the global values, each a dataset of the variable's shape
    np.testing.assert_array_equal(f["layers/dense/vars/0"][...], want[0])
  plain = build_model()
  plain.load_weights(path)
  _assert_values(values(plain), want)
  # Loaded back under the distribution, after the weights were changed: slice by slice, nothing put together.
  with _distribution((2, 4), LAYOUTS_A).scope():
    other = build_model()
  other.fit(np.ones((8, 12), np.float32), np.ones((8, 5), np.float32), batch_size=8, verbose=0)
  with no_gather:
    other.load_weights(path)
    for v in _split(other):
      full = tuple(v.shape)
      assert all(tuple(s.shape) != full for s in gs.shards_of(v)), v.path
  _assert_values(values(other), want)


def test_load_onto_another_mesh_and_layout(tmp_path, monkeypatch, no_gather):
  model = _trained(_distribution((2, 4), LAYOUTS_A))
  want = values(model)
  path = str(tmp_path / "a.weights.h5")
  model.save_weights(path)
  distribution = _distribution((4, 2), LAYOUTS_B)
  monkeypatch.setattr(gsk, "WHOLE_INIT_MAX_BYTES", 0)   # created shard by shard: no whole value to begin with
  with distribution.scope():
    other = build_model()
  specs = {v.path: gs.sharding_of(v).spec for v in other.weights if gs.sharding_of(v) is not None}
  assert specs["up/kernel"] == gs.P("batch", "model") and specs["head/bias"] == gs.P("batch")
  with no_gather:
    other.load_weights(path)
  for v in other.weights:   # each device's slice went to its shard; the variables' own buffers never held values
    if v.path in LAYOUTS_B:
      assert not _compat.keras_inner_variable(v).is_initialized(), v.path
  _assert_values(values(other)[:len(other.weights)], want[:len(model.weights)])
  # The optimizer's slots follow their variables' layouts once it trains; its loaded state is Keras's.
  _assert_values(values(other)[len(other.weights):], want[len(model.weights):])
  # Training on from the loaded state gives the plain model's next loss.
  plain = build_model()
  plain.load_weights(path)
  x, y = np.ones((8, 12), np.float32), np.ones((8, 5), np.float32)
  with distribution.scope():
    got = other.fit(x, y, batch_size=8, verbose=0).history["loss"]
  np.testing.assert_allclose(got, plain.fit(x, y, batch_size=8, verbose=0).history["loss"], rtol=1e-5)


def test_weights_split_over_several_files_and_keras_archives(tmp_path, no_gather):
  model = _trained(_distribution((2, 4), LAYOUTS_A))
  want = values(model)
  path = str(tmp_path / "split.weights.json")
  with no_gather:   # files of at most ~1 KiB: every variable in its own file, Keras's weight map over them
    model.save_weights(path, max_shard_size=1e-6)
  plain = build_model()
  plain.load_weights(path)
  _assert_values(values(plain), want)
  plain.save_weights(str(tmp_path / "plain.weights.json"), max_shard_size=1e-6)
  with open(path) as f, open(tmp_path / "plain.weights.json") as g:   # the same files as Keras writes
    got, keras_map = json.load(f), json.load(g)
  assert got["metadata"] == keras_map["metadata"]
  assert {k: str(v).replace("split", "plain") for k, v in got["weight_map"].items()} == {
      k: str(v) for k, v in keras_map["weight_map"].items()}
  assert len(os.listdir(tmp_path)) > 8
  with _distribution((4, 2), LAYOUTS_B).scope():
    other = build_model()
  with no_gather:
    other.load_weights(path)
  _assert_values(values(other), want)
  # A .keras archive (the weights file inside a zip): written tile by tile too; loads as Keras loads it.
  archive = str(tmp_path / "m.keras")
  with no_gather:
    model.save(archive)
  restored = keras.saving.load_model(archive)
  _assert_values([np.asarray(v.numpy()) for v in restored.weights], want[:len(model.weights)])


def test_bfloat16_weights_round_trip(tmp_path, no_gather):
  def build():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(20, name="up", dtype="bfloat16")])
  distribution = _distribution((2, 4), {".*up/kernel": ("batch", "model")})
  with distribution.scope():
    model = build()
  kernel = model.weights[0]
  assert kernel.dtype == "bfloat16" and gs.sharding_of(kernel).spec == gs.P("batch", "model")
  want = [np.asarray(v.numpy()) for v in model.weights]
  path = str(tmp_path / "bf16.weights.h5")
  with no_gather:
    model.save_weights(path)
  with h5py.File(path) as f:   # marked as Keras marks bfloat16 datasets
    assert f["layers/dense/vars/0"].attrs["dtype"] == "bfloat16"
  plain = build()
  plain.set_weights([np.zeros_like(w) for w in want])
  plain.load_weights(path)
  _assert_values([np.asarray(v.numpy()) for v in plain.weights], want)
  with distribution.scope():
    other = build()
  other.set_weights([np.zeros_like(w) for w in want])
  with no_gather:
    other.load_weights(path)
  _assert_values([np.asarray(v.numpy()) for v in other.weights], want)


PLAIN_PROCESS = MODEL_SOURCE + textwrap.dedent("""
    import sys
    directory = sys.argv[1]
    model = build_model()
    model.load_weights(directory + "/sharded.weights.h5")
    np.savez(directory + "/plain_read.npz", *values(model))
    rng = np.random.default_rng(5)
    model.set_weights([rng.normal(size=w.shape).astype(w.dtype) for w in model.get_weights()])
    model.save_weights(directory + "/plain.weights.h5")
    np.savez(directory + "/plain_written.npz", *values(model))
    print("loaded modules:", sorted(m for m in sys.modules if m.startswith("tf_gspmd")))
""")


def _npz(path):
  with np.load(path) as f:
    return [f[f"arr_{i}"] for i in range(len(f.files))]


def test_plain_keras_process_reads_sharded_files_and_writes_files_a_distribution_loads(tmp_path, no_gather):
  model = _trained(_distribution((2, 4), LAYOUTS_A))
  want = values(model)
  with no_gather:
    model.save_weights(str(tmp_path / "sharded.weights.h5"))
  env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
  env.pop("PYTHONPATH", None)   # plain Keras: tf_gspmd not even importable
  out = subprocess.run([sys.executable, "-c", PLAIN_PROCESS, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "loaded modules: []" in out.stdout
  _assert_values(_npz(tmp_path / "plain_read.npz"), want)
  written = _npz(tmp_path / "plain_written.npz")
  with no_gather:
    model.load_weights(str(tmp_path / "plain.weights.h5"))
  _assert_values(values(model), written)


def test_arrays_that_outlive_the_load_do_not_follow_the_file(tmp_path):
  path = str(tmp_path / "w.weights.h5")
  model = build_model()
  model.save_weights(path)
  want = values(model)
  store_cls, _ = _compat.keras_weight_store_classes()
  store = store_cls(path, mode="r")
  store.get("layers/dense")
  kept = store["0"]
  assert isinstance(kept, np.ndarray) and kept.base is not None   # mapped from the file, not read
  np.testing.assert_array_equal(kept, want[0])
  store.close()
  with open(path, "wb"):   # the file truncated, as a new save to the same path does
    pass
  np.testing.assert_array_equal(kept, want[0])
  kept[0, 0] = 1.0   # writable, as Keras's arrays are


def test_compat_adapters_for_weight_stores():
  store, sharded = _compat.keras_weight_store_classes()
  assert issubclass(sharded, store)
  for name in ("__getitem__", "__setitem__", "close", "get", "make", "_create_h5_group"):
    assert callable(getattr(store, name)), name
  for name in ("_restore_h5_file", "_create_new_shard_file"):
    assert callable(getattr(sharded, name)), name
  assert not _compat.keras_in_stateless_scope()
  with keras.StatelessScope():
    assert _compat.keras_in_stateless_scope()
  assert isinstance(keras.Variable(np.zeros(3)), _compat.keras_variable_class())


MEMORY_PROCESS = textwrap.dedent("""
    import gc, json, os, sys
    import numpy as np
    import tensorflow as tf
    import tf_gspmd as gs
    gs.split_cpu_devices(8)
    import keras
    import tf_gspmd.keras

    def status(key):
      with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))

    def peak_growth(fn):   # the peak resident set during fn() above the resident set before it
      gc.collect()
      before = status("VmRSS")
      with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # the high-water mark starts again from here
      fn()
      return status("VmHWM") - before

    rows, cols = 4096, 8192   # a 128 MiB float32 kernel, split over 8 devices
    mesh = keras.distribution.DeviceMesh((1, 8), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*big/kernel"] = (None, "model")
    with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
      model = keras.Sequential([keras.Input((rows,)), keras.layers.Dense(cols, use_bias=False, name="big")])
    kernel = model.weights[0]
    assert gs.sharding_of(kernel).spec == gs.P(None, "model")
    path = os.path.join(sys.argv[1], "big.weights.h5")
    save = peak_growth(lambda: model.save_weights(path))
    want = [s.numpy() for s in gs.shards_of(kernel)[:2]]
    kernel.assign(np.zeros((rows, cols), np.float32))
    load = peak_growth(lambda: model.load_weights(path))
    equal = all(np.array_equal(s.numpy(), w) for s, w in zip(gs.shards_of(kernel), want))
    print(json.dumps({"variable": rows * cols * 4, "save": save, "load": load, "equal": equal}))
""")


def test_save_and_load_add_at_most_a_quarter_more_than_the_largest_variable(tmp_path):
  # Fresh process, glibc handing freed buffers back at once (the high-water mark follows what is live).
  env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", TF_CPP_MIN_LOG_LEVEL="2",
             KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, "-c", MEMORY_PROCESS, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["equal"]
  # Keras alone puts the variable together on save and reads it whole on load (about 2x each); here each moves
  # one tile (16 MiB) at a time.
  assert got["save"] <= 1.25 * got["variable"], got
  assert got["load"] <= 1.25 * got["variable"], got


VOCAB, SEQ = 96, 12


def test_keras_hub_preset_loads_slice_by_slice_under_its_layout_map(tmp_path, monkeypatch, no_gather):
  keras_hub = pytest.importorskip("keras_hub")

  def gemma():
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=4, hidden_dim=40, intermediate_dim=56, head_dim=12)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)

  keras.utils.set_random_seed(3)
  plain = gemma()   # random weights, nothing downloaded
  preset = str(tmp_path / "gemma_preset")
  plain.save_to_preset(preset)
  assert os.path.exists(os.path.join(preset, "model.weights.h5"))
  rng = np.random.default_rng(0)
  prompt = {"token_ids": rng.integers(1, VOCAB, (2, SEQ)).astype(np.int32),
            "padding_mask": np.concatenate([np.ones((2, 6), bool), np.zeros((2, SEQ - 6), bool)], 1)}
  want = plain.generate(prompt, max_length=SEQ, stop_token_ids=None)["token_ids"]

  # Variables created shard by shard (as for ones too large to build whole), then filled from the file slice by
  # slice: no whole value of a split weight exists anywhere, before, during or after loading.
  monkeypatch.setattr(gsk, "WHOLE_INIT_MAX_BYTES", 0)
  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
  distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
  with distribution.scope(), no_gather:
    lm = keras_hub.models.GemmaCausalLM.from_preset(preset)
    got = lm.generate(prompt, max_length=SEQ, stop_token_ids=None)["token_ids"]
  np.testing.assert_array_equal(got, want)
  # The weights keras-hub's layout map splits: stored split from creation, never a whole value on any device.
  split = [v for v in lm.weights if layout_map[v.path] is not None and any(layout_map[v.path].axes)]
  assert len(split) >= 10, [v.path for v in split]
  for v in split:
    assert not gs.sharding_of(v).is_replicated, v.path
    assert all(s.shape != tuple(v.shape) for s in gs.shards_of(v)), v.path
    assert not _compat.keras_inner_variable(v).is_initialized(), v.path   # never put together
  for a, b in zip(lm.backbone.weights, plain.backbone.weights):   # read eagerly, the values are the preset's
    np.testing.assert_array_equal(a.numpy(), b.numpy())
