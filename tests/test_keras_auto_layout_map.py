"""gs.keras.auto_layout_map: a Keras LayoutMap chosen by automatic sharding of a model's train step.

keras-hub models that ship no `get_layout_map` (GPT-2, BERT, Mistral), built small from their constructors (random
weights, nothing downloaded), train under ModelParallel with the map it returns: per-step losses equal plain
Keras's, and the memory per device of the step they run (the report's memory account) is within the budget.
"""

import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P

keras = pytest.importorskip("keras")
import tf_gspmd.keras as gsk  # noqa: E402  pylint: disable=g-import-not-at-top

VOCAB, SEQ, BATCH = 96, 12, 8
TIME_LIMIT = 5.0   # seconds the solver may take: its best plan within the budget by then


def _mesh():
  return keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])


def _compiled(build, seed=3):
  keras.utils.set_random_seed(seed)
  model = build()
  model.compile(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _dense():
  inputs = keras.Input((16,))
  h = keras.layers.Dense(256, activation="relu", name="up")(inputs)
  return keras.Model(inputs, keras.layers.Dense(8, name="down")(h))


def test_the_map_is_explicit_printable_and_editable(rng):
  model = _compiled(_dense)
  x, y = rng.standard_normal((32, 16)).astype(np.float32), rng.integers(0, 8, 32)
  mesh = _mesh()
  unbudgeted = gsk.auto_layout_map(model, mesh, data=(x[:8], y[:8]))
  budget = unbudgeted.memory.plan.peak_bytes // 2
  layout_map = gsk.auto_layout_map(model, mesh, budget, data=(x[:8], y[:8]), solver_time_limit=TIME_LIMIT)
  assert isinstance(layout_map, keras.distribution.LayoutMap) and layout_map.batch_dim_name == "batch"
  paths = [v.path for v in model.weights + model.optimizer.variables]
  # One key per variable: a weight's exact path; an optimizer variable's path with any name of the optimizer.
  assert list(layout_map)[:len(model.weights)] == [v.path for v in model.weights]
  assert [bool(re.fullmatch(k, p)) for k, p in zip(layout_map, paths)] == [True] * len(paths)
  assert list(layout_map)[len(model.weights):][2] == re.sub(r"_\d+$", "", model.optimizer.name) + (
      r"(?:_\d+)?/up_kernel_momentum")
  assert all(layout_map[p].device_mesh is mesh for p in paths)
  # The layouts are the plan's: the weights and Adam slots that hold most bytes are split to meet the budget.
  assert layout_map.memory.plan.peak_bytes <= budget
  assert any(a is not None for a in layout_map["up/kernel"].axes), layout_map["up/kernel"]
  text = str(layout_map)
  assert "layout_map = keras.distribution.LayoutMap(device_mesh)" in text
  assert f"layout_map['up/kernel'] = {tuple(layout_map['up/kernel'].axes)!r}" in text
  assert re.search(r"batch over 'batch'; [\d,]+ B per device", text)
  # Editable as any LayoutMap; ModelParallel then lays the model out as edited.
  del layout_map["down/kernel"]
  layout_map["down/kernel"] = ("model", None)
  ref = _compiled(_dense)
  ref.set_weights(model.get_weights())
  with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
    got = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history["loss"]
  want = ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history["loss"]
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert gs.sharding_of(model.get_layer("down").kernel).spec == P("model", None)
  assert gs.sharding_of(model.get_layer("up").kernel).spec == P(*layout_map["up/kernel"].axes)


def test_bad_calls_are_typed_errors(rng):
  x, y = rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 8, 8)
  plain = _dense()
  with pytest.raises(gs.InputError, match="compile the model first"):
    gsk.auto_layout_map(plain, _mesh(), data=(x, y))
  model = _compiled(_dense)
  with pytest.raises(gs.InputError, match="needs a keras.distribution.DeviceMesh"):
    gsk.auto_layout_map(model, gs.Mesh((2, 4), ("batch", "model")), data=(x, y))
  with pytest.raises(gs.MeshError, match="batch_dim_name 'data' is not an axis"):
    gsk.auto_layout_map(model, _mesh(), data=(x, y), batch_dim_name="data")
  with pytest.raises(gs.AutoShardingError, match="no layout fits memory_budget=1,024 B"):
    gsk.auto_layout_map(model, _mesh(), 1024, data=(x, y), solver_time_limit=TIME_LIMIT)
  with pytest.raises(gs.InputError, match=r"\[data\] data=ndarray\[8, 16\] has no targets, but model .* computes its "
                                          r"compiled loss from them: .* data=\(x, y\) or \(x, y, sample_weight\)"):
    gsk.auto_layout_map(model, _mesh(), data=x)


def test_the_map_lays_out_the_slots_of_the_model_and_optimizer_built_again(rng):
  """The map's optimizer keys match the optimizer's variables whatever name Keras gives it: the same model built
  again in the distribution's scope, with a new Adam ("adam_<n>"), gets every slot laid out as the map says (one
  edited unlike its weight, as a plan may lay it out) and no warning about keys that match nothing."""
  x, y = rng.standard_normal((32, 16)).astype(np.float32), rng.integers(0, 8, 32)
  model = _compiled(_dense)
  mesh = _mesh()
  budget = gsk.auto_layout_map(model, mesh, data=(x[:8], y[:8])).memory.plan.peak_bytes // 2
  layout_map = gsk.auto_layout_map(model, mesh, budget, data=(x[:8], y[:8]), solver_time_limit=TIME_LIMIT)
  (key,) = [k for k in layout_map if re.fullmatch(k, model.optimizer.name + "/up_kernel_momentum")]
  del layout_map[key]
  layout_map[key] = ("model", None)
  for _ in range(3):
    keras.optimizers.Adam()   # (Keras numbers the names of the optimizers it makes)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
      rebuilt = _compiled(_dense)
      rebuilt.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
  assert rebuilt.optimizer.name != model.optimizer.name
  assert [str(w.message) for w in caught if "layout map key" in str(w.message)] == []
  for v in rebuilt.weights + rebuilt.optimizer.variables:
    (k,) = [k for k in layout_map if re.fullmatch(k, v.path)]
    assert gs.sharding_of(v).spec == P(*layout_map[k].axes), v.path
  assert gs.sharding_of(rebuilt.optimizer.variables[2]).spec == P("model", None)


# ---- keras-hub models that ship no layout map


def _tokens(n, seed=0):
  return np.random.default_rng(seed).integers(1, VOCAB, (n, SEQ + 1)).astype(np.int32)


def _gpt2():
  import keras_hub  # pylint: disable=g-import-not-at-top
  backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=1, num_heads=4, hidden_dim=32,
                                           intermediate_dim=64, max_sequence_length=SEQ)
  return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _mistral():
  import keras_hub  # pylint: disable=g-import-not-at-top
  backbone = keras_hub.models.MistralBackbone(vocabulary_size=VOCAB, num_layers=1, num_query_heads=4,
                                              num_key_value_heads=2, hidden_dim=32, intermediate_dim=64)
  return keras_hub.models.MistralCausalLM(backbone=backbone, preprocessor=None)


def _bert():
  import keras_hub  # pylint: disable=g-import-not-at-top
  backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=4, hidden_dim=32,
                                           intermediate_dim=64, max_sequence_length=SEQ)
  return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=4, preprocessor=None)


def _lm_data(n):
  tokens = _tokens(n)
  return {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, SEQ), bool)}, tokens[:, 1:]


def _classifier_data(n):
  tokens = _tokens(n)
  return ({"token_ids": tokens[:, :-1], "segment_ids": np.zeros((n, SEQ), np.int32),
           "padding_mask": np.ones((n, SEQ), bool)}, tokens[:, -1] % 4)


HUB_MODELS = {"gpt2": (_gpt2, _lm_data), "bert": (_bert, _classifier_data), "mistral": (_mistral, _lm_data)}


def _first(data):
  return tf.nest.map_structure(lambda t: t[:BATCH], data)


@pytest.mark.parametrize("name", sorted(HUB_MODELS))
def test_keras_hub_model_without_a_layout_map_trains_with_the_auto_map_within_the_budget(name):
  pytest.importorskip("keras_hub")
  build, make_data = HUB_MODELS[name]
  x, y = make_data(3 * BATCH)
  model = _compiled(build)
  ref = _compiled(build)
  ref.set_weights(model.get_weights())
  mesh = _mesh()
  unbudgeted = gsk.auto_layout_map(model, mesh, data=_first((x, y)))
  budget = int(unbudgeted.memory.plan.peak_bytes * 0.8)
  layout_map = gsk.auto_layout_map(model, mesh, budget, data=_first((x, y)), solver_time_limit=TIME_LIMIT)
  split = [k for k, layout in layout_map.items() if any(a is not None for a in layout.axes)]
  assert split   # the budget is met by splitting weights or optimizer state
  losses = []

  class Record(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      losses.append(float(logs["loss"]))

  distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
  with distribution.scope():
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[Record()])
  want = []

  class RecordPlain(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      want.append(float(logs["loss"]))

  ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[RecordPlain()])
  assert len(losses) == 3
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  # The step that ran holds, per device, what the plan was priced at: within the budget.
  (low,) = [low for f in model.train_function.functions.values() for low in f._cache.values()]  # pylint: disable=protected-access
  account = low.report.memory
  assert account.plan.peak_bytes <= budget, str(account)
  assert account.peak_bytes <= budget + account.added_bytes, str(account)
  assert low.report.fallbacks == ()
  for key in split:   # every variable is stored as the map says
    v = next(v for v in model.weights + model.optimizer.variables if re.fullmatch(key, v.path))
    assert gs.sharding_of(v).spec == P(*layout_map[key].axes), key


def test_identical_calls_give_identical_maps_also_when_the_solver_runs_out_of_time():
  """docs/keras.md's call (GPT-2, 0.8 x the unbudgeted plan, solver_time_limit=5) gives one map every time; a limit
  too short for the solver to find any plan says so (a warning, `auto_plan.timed_out`) and gives the deterministic
  fallback's map, within the budget, the same every time -- not "no layout fits"."""
  pytest.importorskip("keras_hub")
  data = _first(_lm_data(BATCH))
  model = _compiled(_gpt2)
  mesh = _mesh()
  budget = int(gsk.auto_layout_map(model, mesh, data=data).memory.plan.peak_bytes * 0.8)
  maps = {}
  for limit in (0.01,) * 2 + (TIME_LIMIT,) * 3:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      layout_map = gsk.auto_layout_map(model, mesh, budget, data=data, solver_time_limit=limit)
    plan = layout_map.auto_plan
    said = [str(w.message) for w in caught if "sharding solver ran out of time" in str(w.message)]
    if limit != TIME_LIMIT:   # too short for the solver: it says so, and the plan is the fallback's
      assert said and plan.status == "time limit reached: deterministic local search", (plan.status, said)
    assert bool(said) == plan.timed_out, (said, plan.status)
    assert layout_map.memory.plan.peak_bytes <= budget
    maps.setdefault(limit, []).append({k: tuple(v.axes) for k, v in layout_map.items()})
  assert all(m == maps[TIME_LIMIT][0] for m in maps[TIME_LIMIT])
  assert maps[0.01][0] == maps[0.01][1]
