"""keras-hub models as people use them: built from their constructors (small, random weights, nothing
downloaded), distributed with their own `get_layout_map` under `keras.distribution.ModelParallel` on mesh (2, 4).

Each trains as plain Keras does (per-step losses), gathers no split weight or gradient to full size, and after the
distributed fit, `generate()` (partitioned, its KV cache split) and a plain `tf.function` see the trained weights.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")
import tf_gspmd.keras  # noqa: E402,F401  pylint: disable=g-import-not-at-top,unused-import

VOCAB, SEQ = 96, 12   # sizes chosen apart from the hidden sizes, so a full weight's shape is recognisable


def _gemma(lora=False):
  backbone = keras_hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                            num_key_value_heads=4, hidden_dim=40, intermediate_dim=56, head_dim=12)
  if lora:
    backbone.enable_lora(4)
  return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def _qwen_moe():
  backbone = keras_hub.models.QwenMoeBackbone(
      vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=40,
      intermediate_dim=56, moe_intermediate_dim=20, shared_expert_intermediate_dim=28, num_experts=4, top_k=2)
  return keras_hub.models.QwenMoeCausalLM(backbone=backbone, preprocessor=None)


MODELS = {"gemma": (_gemma, keras_hub.models.GemmaBackbone), "gemma_lora": (lambda: _gemma(lora=True),
                                                                           keras_hub.models.GemmaBackbone),
          "qwen_moe": (_qwen_moe, keras_hub.models.QwenMoeBackbone)}


def _data():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, VOCAB, (24, SEQ + 1)).astype(np.int32)
  return {"token_ids": tokens[:, :-1], "padding_mask": np.ones((24, SEQ), bool)}, tokens[:, 1:]


def _built(build):
  keras.utils.set_random_seed(3)
  model = build()
  model.compile(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _fit(model):
  x, y = _data()
  losses = []

  class Record(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      losses.append(float(logs["loss"]))

  model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[Record()])
  return losses


def _squeezed(shape):
  return tuple(sorted(int(d) for d in shape if d != 1))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_parallel_fit_matches_plain_keras_without_full_weight_gathers(name):
  build, backbone_cls = MODELS[name]
  ref = _built(build)
  want = _fit(ref)
  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  layout_map = backbone_cls.get_layout_map(mesh)
  distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
  with distribution.scope():
    model = _built(build)
    got = _fit(model)
  assert len(got) == 6
  np.testing.assert_allclose(got, want, rtol=1e-5)
  split = {_squeezed(v.shape): v.path for v in model.weights
           if gs.sharding_of(v) is not None and not gs.sharding_of(v).is_replicated and math.prod(v.shape) > 64}
  assert split   # the layout map split the weights
  for f in model.train_function.functions.values():
    for lowered in f._cache.values():  # pylint: disable=protected-access
      assert lowered.report.fallbacks == ()
      # keras-hub's layout maps also split weights over "batch" (ZeRO-3 / FSDP style): those are gathered over
      # "batch" for use, by design (as under JAX). Nothing may be gathered to full size over "model".
      full = [(split[_squeezed(c.shape)], str(c)) for c in lowered.report.collectives
              if c.kind == "all-gather" and "model" in c.axes and _squeezed(c.shape) in split]
      assert not full, full
      # The report flags every gather of a weight-sized tensor; here only those over "batch" remain.
      assert all(c.axes == ("batch",) for c in lowered.report.rematerializations), lowered.report.warnings
  if name == "gemma":
    prompt = {"token_ids": _data()[0]["token_ids"][:2],
              "padding_mask": np.concatenate([np.ones((2, 6), bool), np.zeros((2, SEQ - 6), bool)], 1)}
    want_tokens = ref.generate(prompt, max_length=SEQ, stop_token_ids=None)["token_ids"]
    with distribution.scope():   # partitioned generation gives plain Keras's tokens
      np.testing.assert_array_equal(model.generate(prompt, max_length=SEQ, stop_token_ids=None)["token_ids"],
                                    want_tokens)
    # It ran partitioned: its KV cache [batch, layers, key|value, SEQ, kv heads, head dim] is carried through the
    # sampling loop split over "model" on the heads, like the attention weights.
    (gen,) = [low for f in model.generate_function.functions.values()
              for low in f._cache.values()]  # pylint: disable=protected-access
    caches = {str(s) for r, s in gen.program.shardings.items()
              if gen.program.ir.info(r).shape == (2, 2, 2, SEQ, 4, 12)}
    assert caches == {"P(None, None, None, None, 'model', None)"}, caches
    # After the distributed fit, programs outside the distribution see the trained weights.
    model.generate_function = None
    np.testing.assert_array_equal(model.generate(prompt, max_length=SEQ, stop_token_ids=None)["token_ids"],
                                  want_tokens)
    forward = tf.function(lambda t: model.backbone({"token_ids": t, "padding_mask": tf.ones_like(t, tf.bool)}))
    np.testing.assert_allclose(forward(prompt["token_ids"]).numpy(),
                               ref.backbone({"token_ids": prompt["token_ids"],
                                             "padding_mask": np.ones((2, SEQ), bool)}).numpy(), rtol=1e-4, atol=1e-4)


_IMPORT_ORDER_SCRIPT = r"""
import collections, json, sys
import numpy as np
import tensorflow as tf
import tf_gspmd as gs
gs.split_cpu_devices(8)
if sys.argv[1] == "keras_hub_first":
  import keras_hub
  import tf_gspmd.keras as gsk
else:   # the README's order
  import tf_gspmd.keras as gsk
  import keras_hub
import keras

runs = collections.Counter()   # partitioned calls, by kind (train, test, predict, generate)
run = gsk._Partitioned.run
def counted(self, data, **options):
  runs[self.kind] += 1
  if self.kind == "generate":   # the prompts keras-hub's generate() passed through distribute_tensor
    runs["sharded prompt"] += all(isinstance(t, gs.ShardedTensor) for t in tf.nest.flatten(data))
  return run(self, data, **options)
gsk._Partitioned.run = counted

VOCAB, SEQ = 96, 12
def build():
  keras.utils.set_random_seed(3)
  backbone = keras_hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=1, num_query_heads=4,
                                            num_key_value_heads=4, hidden_dim=40, intermediate_dim=56, head_dim=12)
  lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
  lm.compile(optimizer=keras.optimizers.Adam(1e-2), sampler="greedy",
             loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return lm

tokens = np.random.default_rng(0).integers(1, VOCAB, (8, SEQ + 1)).astype(np.int32)
x, y = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((8, SEQ), bool)}, tokens[:, 1:]
prompt = {"token_ids": tokens[:2, :-1],
          "padding_mask": np.concatenate([np.ones((2, 6), bool), np.zeros((2, SEQ - 6), bool)], 1)}
want = build().generate(prompt, max_length=SEQ, stop_token_ids=None)["token_ids"]
mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
distribution = keras.distribution.ModelParallel(
    layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh), batch_dim_name="batch")
with distribution.scope():
  model = build()   # the same seed: the same weights
  got = model.generate(prompt, max_length=SEQ, stop_token_ids=None)["token_ids"]
  model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
  model.evaluate(x, y, batch_size=8, verbose=0)
  model.predict(x, batch_size=8, verbose=0)
print("RESULT " + json.dumps({
    "runs": dict(runs), "tokens_equal": bool(np.array_equal(np.asarray(got), np.asarray(want))),
    "functions": {k: type(getattr(model, k + "_function")).__name__
                  for k in ("train", "test", "predict", "generate")}}))
"""


@pytest.mark.parametrize("order", ["keras_hub_first", "tf_gspmd_keras_first"])
def test_fit_evaluate_predict_generate_are_partitioned_whichever_is_imported_first(order):
  """Import order is per process: each order in its own interpreter. generate() gives plain Keras's tokens."""
  out = subprocess.run([sys.executable, "-c", _IMPORT_ORDER_SCRIPT, order], capture_output=True, text=True,
                       timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
  assert out.returncode == 0 and lines, out.stderr[-4000:]
  result = json.loads(lines[-1][len("RESULT "):])
  assert result["runs"] == {"generate": 1, "sharded prompt": 1, "train": 1, "test": 1, "predict": 1}, result
  assert set(result["functions"].values()) == {"_Partitioned"}, result
  assert result["tokens_equal"], result
