"""Fine-tune a keras-hub causal LM model-parallel on the TensorFlow backend, with the model's own layout map.

  python examples/finetune_keras_hub.py                          # Gemma, mesh (2,4) batch x model, 8 logical CPUs
  python examples/finetune_keras_hub.py --model=llama --lora_rank=4     # LoRA: only the adapters train
  python examples/finetune_keras_hub.py --model=qwen_moe --mesh=1,8

keras-hub documents model-parallel fine-tuning for JAX: a `keras.distribution.ModelParallel` whose layout map is
the backbone's own `get_layout_map(device_mesh)`. With `import tf_gspmd.keras` the same code runs on the
TensorFlow backend: every `fit` step is one SPMD program over the mesh's devices, the weights stored split as the
layout map says (attention heads, MLP hidden and vocabulary over `model`; the other dim of most weights over
`batch`, ZeRO-3 style), the batch split over `batch`.

The model is built from its backbone's constructor at a small size with random weights (nothing is downloaded) and
learns a short built-in English text, character by character (token 0 pads, 1..N are the text's characters).
Each step prints `step K loss X` (the loss of that step's batch); after training the model continues --prompt
greedily with `generate()`, partitioned under the same distribution (the KV cache split like the attention). With --check (the default) the same model is then built again from the same seed
without a distribution and trained on the same first --check_steps batches; the binary fails unless each of those
steps' losses agrees to --check_rtol, and unless, given the weights the partitioned fit trained, plain Keras
generates the same text.
"""

import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402

MODELS = ("gemma", "llama", "qwen", "qwen_moe")

flags.DEFINE_enum("model", "gemma", MODELS, "keras-hub model family.")
flags.DEFINE_list("mesh", ["2", "4"], "Mesh shape BATCH,MODEL: the batch is split over the first axis (`batch`), "
                  "the weights as the model's layout map says over both.")
flags.DEFINE_integer("steps", 30, "Training steps (one batch each).")
flags.DEFINE_integer("batch_size", 8, "Global batch size (sequences per step).")
flags.DEFINE_integer("seq_len", 32, "Tokens (characters) per training sequence.")
flags.DEFINE_integer("lora_rank", 0, "0: full fine-tuning; R > 0: backbone.enable_lora(R), only the LoRA weights "
                     "train (the frozen weights stay split as the layout map says).")
flags.DEFINE_float("lr", 1e-2, "Adam learning rate.")
flags.DEFINE_integer("seed", 0, "Seed of the initial weights and of the batches.")
flags.DEFINE_bool("check", True, "Train the same model without a distribution and fail unless the losses and the "
                  "generated text agree.")
flags.DEFINE_integer("check_steps", 10, "Steps --check compares, the first ones (0: all). Training amplifies float "
                     "rounding differences (the order of a sum), so two correct runs drift apart over many steps.")
flags.DEFINE_float("check_rtol", 1e-5, "Relative tolerance of the per-step loss comparison of --check.")
flags.DEFINE_integer("layers", 2, "Decoder layers.")
flags.DEFINE_integer("hidden_dim", 64, "Model width.")
flags.DEFINE_integer("heads", 4, "Query heads (head size hidden_dim / heads).")
flags.DEFINE_integer("kv_heads", 2, "Key/value heads (grouped-query attention); must divide --heads.")
flags.DEFINE_integer("intermediate_dim", 128, "MLP hidden width (for qwen_moe: of its shared expert; each "
                     "routed expert has half).")
flags.DEFINE_integer("vocab", 32, "Vocabulary size; at least the built-in text's characters + 1 (padding).")
flags.DEFINE_integer("experts", 4, "qwen_moe: routed experts.")
flags.DEFINE_integer("top_k", 2, "qwen_moe: experts per token.")
flags.DEFINE_string("prompt", "it was the ", "Text that generate() continues after training.")
flags.DEFINE_integer("generate_len", 24, "Characters generate() appends to --prompt.")
FLAGS = flags.FLAGS

# A short public-domain text (Dickens, "A Tale of Two Cities", 1859), lower case.
TEXT = (
    "it was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of light, it "
    "was the season of darkness, it was the spring of hope, it was the winter of despair, we had everything "
    "before us, we had nothing before us, we were all going direct to heaven, we were all going direct the other "
    "way - in short, the period was so far like the present period, that some of its noisiest authorities "
    "insisted on its being received, for good or for evil, in the superlative degree of comparison only. "
)
ALPHABET = sorted(set(TEXT))   # token k + 1 is ALPHABET[k]; token 0 pads


def encode(text):
  return np.array([ALPHABET.index(c) + 1 for c in text], np.int32)


def decode(ids):
  return "".join(ALPHABET[i - 1] if 0 < i <= len(ALPHABET) else "?" for i in ids)


def _mesh_shape(mesh):
  try:
    shape = tuple(int(s) for s in mesh)
  except ValueError:
    shape = ()
  if len(shape) != 2 or min(shape) < 1:
    raise flags.ValidationError(f"--mesh must be two positive integers BATCH,MODEL (e.g. 2,4); got {','.join(mesh)}")
  return shape


def _require(names, holds, message):
  """A check of flags `names` at parsing (before TensorFlow starts): `message` (formatted with their values)
  unless `holds(**values)`."""
  def checker(values):
    if not holds(**values):
      raise flags.ValidationError(message.format(**values))
    return True
  flags.register_multi_flags_validator(names, checker)


flags.register_validator("mesh", lambda mesh: bool(_mesh_shape(mesh)))
for _name in ("steps", "batch_size", "layers", "hidden_dim", "heads", "kv_heads", "intermediate_dim", "experts",
              "top_k", "generate_len"):
  flags.register_validator(_name, lambda v: v >= 1, message=f"--{_name} must be at least 1")
flags.register_validator("seq_len", lambda v: 2 <= v < len(TEXT), message=f"--seq_len must be in 2..{len(TEXT) - 1} "
                         f"(the built-in text has {len(TEXT)} characters)")
flags.register_validator("lora_rank", lambda v: v >= 0, message="--lora_rank must be 0 (full fine-tuning) or positive")
flags.register_validator("lr", lambda v: v > 0, message="--lr must be positive")
flags.register_validator("check_steps", lambda v: v >= 0, message="--check_steps must be 0 (all) or positive")
flags.register_validator("check_rtol", lambda v: v > 0, message="--check_rtol must be positive")
flags.register_validator("vocab", lambda v: v >= len(ALPHABET) + 1, message=f"--vocab must be at least "
                         f"{len(ALPHABET) + 1} (the built-in text's {len(ALPHABET)} characters and padding)")
flags.register_validator("prompt", lambda v: bool(v) and set(v) <= set(ALPHABET), message=f"--prompt must be "
                         f"non-empty text made of the built-in text's characters {''.join(ALPHABET)!r}")
_require(["hidden_dim", "heads"], lambda hidden_dim, heads: hidden_dim % heads == 0,
         "--hidden_dim ({hidden_dim}) must be a multiple of --heads ({heads})")
_require(["heads", "kv_heads"], lambda heads, kv_heads: heads % kv_heads == 0,
         "--kv_heads ({kv_heads}) must divide --heads ({heads})")
_require(["model", "experts", "top_k"], lambda model, experts, top_k: model != "qwen_moe" or top_k <= experts,
         "--top_k ({top_k}) must be at most --experts ({experts})")
_require(["model", "intermediate_dim"], lambda model, intermediate_dim: model != "qwen_moe" or intermediate_dim >= 2,
         "--intermediate_dim must be at least 2 for qwen_moe (each routed expert has half)")


def batches(seed, steps, batch_size, seq_len):
  """`steps * batch_size` windows of seq_len + 1 characters of TEXT at seeded offsets: inputs and next tokens."""
  ids = encode(TEXT)
  starts = np.random.default_rng(seed).integers(0, len(ids) - seq_len, steps * batch_size)
  windows = np.stack([ids[s:s + seq_len + 1] for s in starts])
  x = {"token_ids": windows[:, :-1], "padding_mask": np.ones((len(windows), seq_len), bool)}
  return x, windows[:, 1:]


def build(model_name, seed):
  """The causal LM from its backbone's constructor (random weights from `seed`), compiled as keras-hub's guides do."""
  import keras  # pylint: disable=g-import-not-at-top
  import keras_hub  # pylint: disable=g-import-not-at-top
  models = keras_hub.models
  keras.utils.set_random_seed(seed)
  sizes = dict(vocabulary_size=FLAGS.vocab, num_layers=FLAGS.layers, num_query_heads=FLAGS.heads,
               num_key_value_heads=FLAGS.kv_heads, hidden_dim=FLAGS.hidden_dim,
               intermediate_dim=FLAGS.intermediate_dim)
  if model_name == "gemma":
    backbone = models.GemmaBackbone(**sizes, head_dim=FLAGS.hidden_dim // FLAGS.heads)
  elif model_name == "llama":
    backbone = models.LlamaBackbone(**sizes)
  elif model_name == "qwen":
    backbone = models.QwenBackbone(**sizes)
  else:
    backbone = models.QwenMoeBackbone(**sizes, moe_intermediate_dim=FLAGS.intermediate_dim // 2,
                                      shared_expert_intermediate_dim=FLAGS.intermediate_dim,
                                      num_experts=FLAGS.experts, top_k=FLAGS.top_k)
  if FLAGS.lora_rank:
    backbone.enable_lora(FLAGS.lora_rank)
  lm = {"gemma": models.GemmaCausalLM, "llama": models.LlamaCausalLM, "qwen": models.QwenCausalLM,
        "qwen_moe": models.QwenMoeCausalLM}[model_name](backbone=backbone, preprocessor=None)
  lm.compile(optimizer=keras.optimizers.Adam(FLAGS.lr),
             loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), sampler="greedy")
  return lm


def backbone_class(model_name):
  import keras_hub  # pylint: disable=g-import-not-at-top
  return {"gemma": keras_hub.models.GemmaBackbone, "llama": keras_hub.models.LlamaBackbone,
          "qwen": keras_hub.models.QwenBackbone, "qwen_moe": keras_hub.models.QwenMoeBackbone}[model_name]


def train(lm, x, y, verbose):
  """`fit` over the batches, one per epoch: with steps_per_epoch=1 Keras keeps one iterator across epochs, so epoch
  k trains on batch k and logs that batch's loss (not a running mean over several). Returns the per-step losses."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  losses = []

  class Log(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
      self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
      losses.append(float(logs["loss"]))
      if verbose:
        print(f"step {epoch} loss {losses[-1]:.6f} time {(time.perf_counter() - self.start) * 1e3:.0f} ms",
              flush=True)

  steps = len(y) // FLAGS.batch_size
  data = tf.data.Dataset.from_tensor_slices((x, y)).batch(FLAGS.batch_size)
  lm.fit(data, epochs=steps, steps_per_epoch=1, shuffle=False, verbose=0, callbacks=[Log()])
  return losses


def generate(lm):
  prompt = encode(FLAGS.prompt)
  length = len(prompt) + FLAGS.generate_len
  token_ids = np.zeros((1, length), np.int32)
  token_ids[0, :len(prompt)] = prompt
  padding_mask = np.arange(length)[None] < len(prompt)
  out = lm.generate({"token_ids": token_ids, "padding_mask": padding_mask}, stop_token_ids=None)
  ids = np.asarray(out["token_ids"])[0]
  return ids, decode(ids[np.asarray(out["padding_mask"])[0]])


def print_layouts(lm, gs):
  """The weights of the embedding and the first decoder block, with the layout each is stored in."""
  shown = [v for v in lm.weights if v.path.startswith(("token_embedding/", "transformer_layer_0/",
                                                       "decoder_block_0/"))]
  for v in shown:
    sharding = gs.sharding_of(v)
    layout = "replicated" if sharding is None or sharding.is_replicated else str(sharding.spec)
    frozen = "" if v.trainable else "  (frozen)"
    print(f"  {v.path:<64s} {str(tuple(v.shape)):<16s} {layout}{frozen}")
  split = [v for v in lm.weights if gs.sharding_of(v) is not None and not gs.sharding_of(v).is_replicated]
  params = sum(math.prod(v.shape) for v in lm.weights)
  trainable = sum(math.prod(v.shape) for v in lm.trainable_weights)
  print(f"{len(split)} of {len(lm.weights)} weights stored split; {trainable:,} of {params:,} parameters train")


def print_collectives(lm, x, y):
  """The collectives of one partitioned training step (Keras's train function is a gs.function per batch shape)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  (step,) = lm.train_function.functions.values()
  batch = tf.nest.flatten((x, y))
  low = step.lower(*[tf.TensorSpec((FLAGS.batch_size,) + a.shape[1:], a.dtype) for a in batch])   # cached
  print(f"collectives per step: {low.report.counts()}, {low.report.bytes_per_device():,} B/device")


def check(lm, losses, ids, x, y):
  """Plain Keras, no distribution: the same model (same seed) trained on the same first batches gives the same
  per-step losses, and with the weights the partitioned fit trained, generate() gives the same text."""
  n = min(FLAGS.check_steps or len(losses), len(losses))
  ref = build(FLAGS.model, FLAGS.seed)
  rows = n * FLAGS.batch_size
  want = train(ref, {k: v[:rows] for k, v in x.items()}, y[:rows], verbose=False)
  rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, want))
  if len(want) != n or rel > FLAGS.check_rtol:
    raise SystemExit(f"check FAILED: the first {n} losses of the partitioned fit differ from plain Keras's by up to "
                     f"{rel:.1e} (relative; --check_rtol={FLAGS.check_rtol:g}):\n  partitioned {losses[:n]}\n"
                     f"  plain Keras {want}")
  ref.set_weights(lm.get_weights())
  ref_ids, ref_text = generate(ref)
  if not np.array_equal(ids, ref_ids):
    raise SystemExit(f"check FAILED: generate() after the partitioned fit gave {decode(ids)!r}; plain Keras with "
                     f"the weights that fit trained gives {ref_text!r}")
  print(f"check: the first {n} losses match plain Keras without a distribution (max relative difference "
        f"{rel:.1e} <= {FLAGS.check_rtol:g}); generate() gives plain Keras's text with the trained weights")


def main(_):
  shape = _mesh_shape(FLAGS.mesh)
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  gs.initialize(cpu_devices=math.prod(shape))   # logical CPU devices, before TensorFlow runs anything
  import keras  # pylint: disable=g-import-not-at-top
  if keras.backend.backend() != "tensorflow":
    raise SystemExit(f"this binary runs Keras on the TensorFlow backend (KERAS_BACKEND=tensorflow); the backend is "
                     f"{keras.backend.backend()!r}")
  import tf_gspmd.keras  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import

  n = math.prod(shape)
  devices = keras.distribution.list_devices("gpu")
  devices = devices[:n] if len(devices) >= n else keras.distribution.list_devices("cpu")[:n]
  mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
  layout_map = backbone_class(FLAGS.model).get_layout_map(mesh)
  distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
  x, y = batches(FLAGS.seed, FLAGS.steps, FLAGS.batch_size, FLAGS.seq_len)
  what = f"LoRA rank {FLAGS.lora_rank}" if FLAGS.lora_rank else "full fine-tuning"
  print(f"{FLAGS.model}: {FLAGS.layers} layers, width {FLAGS.hidden_dim}, {FLAGS.heads} heads, vocabulary "
        f"{FLAGS.vocab}; {what}; mesh batch={shape[0]} x model={shape[1]} on {', '.join(map(str, devices))}")

  with distribution.scope():
    lm = build(FLAGS.model, FLAGS.seed)
    print_layouts(lm, gs)
    start = time.perf_counter()
    losses = train(lm, x, y, verbose=True)
  print(f"fit: {len(losses)} steps in {time.perf_counter() - start:.1f} s (the first traces and partitions the "
        f"step)")
  print_collectives(lm, x, y)
  with distribution.scope():   # partitioned: the sampling loop runs on the mesh, its KV cache split
    ids, text = generate(lm)
  print(f"generate: {text!r}")

  if FLAGS.check:
    check(lm, losses, ids, x, y)


if __name__ == "__main__":
  app.run(main)
