"""A decoder-only transformer language model in plain TensorFlow ops, with a full Adam training step.

Parameters are a flat dict of tensors passed as function arguments, so a `gs.function` sees every weight
and optimizer slot as an input it can shard. `megatron_specs` gives the Megatron-style layout on a
(data, model) mesh: attention heads and the MLP hidden dim split over `model`, the batch over `data`.
"""

import dataclasses
import functools
import math

import numpy as np
import tensorflow as tf

from tf_gspmd import P


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int = 12
  d_model: int = 64
  heads: int = 4
  d_ff: int = 256
  vocab: int = 128
  seq: int = 16
  batch: int = 8
  lr: float = 1e-3
  dropout: float = 0.0   # rate of the Keras model's dropout on each MLP's hidden activation (0: none)


def param_shapes(cfg):
  shapes = {"embed": (cfg.vocab, cfg.d_model), "pos": (cfg.seq, cfg.d_model), "ln_f/scale": (cfg.d_model,),
            "ln_f/bias": (cfg.d_model,)}
  hd = cfg.d_model // cfg.heads
  for l in range(cfg.layers):
    p = f"l{l}/"
    shapes.update({
        p + "ln1/scale": (cfg.d_model,), p + "ln1/bias": (cfg.d_model,),
        p + "wq": (cfg.d_model, cfg.heads, hd), p + "wk": (cfg.d_model, cfg.heads, hd),
        p + "wv": (cfg.d_model, cfg.heads, hd), p + "wo": (cfg.heads, hd, cfg.d_model),
        p + "ln2/scale": (cfg.d_model,), p + "ln2/bias": (cfg.d_model,),
        p + "w1": (cfg.d_model, cfg.d_ff), p + "b1": (cfg.d_ff,), p + "w2": (cfg.d_ff, cfg.d_model),
        p + "b2": (cfg.d_model,)})
  return shapes


def init_params(cfg, seed=0):
  rng = np.random.default_rng(seed)
  params = {}
  for name, shape in param_shapes(cfg).items():
    if name.endswith("scale"):
      params[name] = np.ones(shape, np.float32)
    elif name.endswith("bias") or name.split("/")[-1] in ("b1", "b2"):
      params[name] = np.zeros(shape, np.float32)
    else:
      fan_in = shape[0] if len(shape) < 3 or not name.endswith("wo") else shape[0] * shape[1]
      params[name] = (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)
  return params


def megatron_specs(cfg):
  """Megatron layout: heads and MLP hidden over `model`; vectors and embeddings replicated."""
  specs = {}
  for name, shape in param_shapes(cfg).items():
    leaf = name.split("/")[-1]
    specs[name] = {"wq": P(None, "model", None), "wk": P(None, "model", None), "wv": P(None, "model", None),
                   "wo": P("model", None, None), "w1": P(None, "model"), "b1": P("model"),
                   "w2": P("model", None)}.get(leaf, P())
  return specs


def causal_mask(seq):
  """[seq, seq] additive mask: -1e9 above the diagonal (a query never sees later keys), 0 elsewhere. Computed by
  ops, not held as a constant, so each device computes it (at its local shape when it is split)."""
  return (1.0 - tf.linalg.band_part(tf.ones((seq, seq)), -1, 0)) * -1e9


def layer_norm(x, scale, bias, eps=1e-5):
  mean = tf.reduce_mean(x, axis=-1, keepdims=True)
  var = tf.reduce_mean(tf.math.squared_difference(x, mean), axis=-1, keepdims=True)
  return (x - mean) * tf.math.rsqrt(var + eps) * scale + bias


def forward(params, tokens, cfg):
  """Logits [batch, seq, vocab] of a causal decoder."""
  x = tf.gather(params["embed"], tokens) + params["pos"]
  hd = cfg.d_model // cfg.heads
  mask = causal_mask(cfg.seq)
  for l in range(cfg.layers):
    p = f"l{l}/"
    with tf.name_scope(f"l{l}"):   # the layer's ops (and their gradients) named by layer
      h = layer_norm(x, params[p + "ln1/scale"], params[p + "ln1/bias"])
      q = tf.einsum("bsd,dhk->bhsk", h, params[p + "wq"])
      k = tf.einsum("bsd,dhk->bhsk", h, params[p + "wk"])
      v = tf.einsum("bsd,dhk->bhsk", h, params[p + "wv"])
      att = tf.nn.softmax(tf.einsum("bhqk,bhsk->bhqs", q, k) / math.sqrt(hd) + mask)
      o = tf.einsum("bhqs,bhsk->bhqk", att, v)
      x = x + tf.einsum("bhqk,hkd->bqd", o, params[p + "wo"])
      h = layer_norm(x, params[p + "ln2/scale"], params[p + "ln2/bias"])
      h = tf.nn.gelu(h @ params[p + "w1"] + params[p + "b1"])
      x = x + h @ params[p + "w2"] + params[p + "b2"]
  with tf.name_scope("head"):
    x = layer_norm(x, params["ln_f/scale"], params["ln_f/bias"])
    return tf.einsum("bsd,vd->bsv", x, params["embed"])


def loss_fn(params, tokens, targets, cfg):
  logits = forward(params, tokens, cfg)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits))


def make_train_step(cfg, names):
  """train_step(step, tokens, targets, *params, *m, *v) -> (loss, *new_params, *new_m, *new_v): one Adam step."""
  n = len(names)
  b1, b2, eps = 0.9, 0.999, 1e-7

  def train_step(step, tokens, targets, *state):
    params = dict(zip(names, state[:n]))
    m, v = state[n:2 * n], state[2 * n:]
    with tf.GradientTape() as tape:
      tape.watch(list(params.values()))
      loss = loss_fn(params, tokens, targets, cfg)
    grads = tape.gradient(loss, [params[k] for k in names])
    t = tf.cast(step, tf.float32) + 1.0
    lr = cfg.lr * tf.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)
    new_p, new_m, new_v = [], [], []
    for k, g, mk, vk in zip(names, grads, m, v):
      mk = b1 * mk + (1.0 - b1) * g
      vk = b2 * vk + (1.0 - b2) * g * g
      new_p.append(params[k] - lr * mk / (tf.sqrt(vk) + eps))
      new_m.append(mk)
      new_v.append(vk)
    return (loss,) + tuple(new_p) + tuple(new_m) + tuple(new_v)

  return train_step


def megatron_train_args(cfg):
  """(train step, its arguments, their Megatron specs): one Adam step with params and slots as arguments."""
  names = sorted(param_shapes(cfg))
  params = init_params(cfg)
  tokens, targets = synthetic_batch(cfg)
  state = [params[k] for k in names] + [np.zeros_like(params[k]) for k in names] * 2
  specs = [P(), P("data", None), P("data", None)] + [megatron_specs(cfg)[k] for k in names] * 3
  return make_train_step(cfg, names), [np.int32(0), tokens, targets] + state, specs


def mlp_train_step(x, t, w1, w2):
  """Reference workload 2: one SGD step of a GELU MLP (Megatron layout: w1 P(None, "model"), w2 P("model", None))."""
  with tf.GradientTape() as tape:
    tape.watch([w1, w2])
    loss = tf.reduce_mean(tf.square(tf.nn.gelu(x @ w1) @ w2 - t))
  g1, g2 = tape.gradient(loss, [w1, w2])
  return w1 - 0.1 * g1, w2 - 0.1 * g2, loss


def synthetic_batch(cfg, seed=0):
  """Token sequences with structure (each token predicts the next by a fixed rule), so the loss can fall."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, cfg.vocab, size=(cfg.batch, 1))
  steps = rng.integers(1, 4, size=(cfg.batch, 1))
  seq = (start + steps * np.arange(cfg.seq + 1)[None, :]) % cfg.vocab
  return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)


def keras_model(cfg, activations=None):
  """The same decoder as a Keras 3 model (Embedding, MultiHeadAttention, LayerNormalization, Dense).

  `activations`: a layout (`P`) for the [batch, seq, d_model] residual stream, annotated where it is formed
  (after the embedding and after every residual add); None leaves it to completion."""
  import keras  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top

  class Annotate(keras.layers.Layer):
    """The value unchanged, annotated with `activations` (a no-op when run eagerly, outside a gs.function)."""

    def call(self, x):
      return x if activations is None else gs.shard(x, activations)

  class PositionEmbedding(keras.layers.Layer):
    """x + a learned [seq, d_model] table (a weight of the model, unlike an Embedding called on a constant)."""

    def build(self, input_shape):
      self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal", name="table")

    def call(self, x):
      return x + self.table

  tokens = keras.Input((cfg.seq,), dtype="int32", batch_size=cfg.batch)
  embed = keras.layers.Embedding(cfg.vocab, cfg.d_model, name="embed")
  x = Annotate(name="pos_out")(PositionEmbedding(name="pos")(embed(tokens)))
  for l in range(cfg.layers):
    h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"l{l}_ln1")(x)
    h = keras.layers.MultiHeadAttention(cfg.heads, cfg.d_model // cfg.heads, name=f"l{l}_attn")(
        h, h, use_causal_mask=True)
    x = Annotate(name=f"l{l}_attn_out")(x + h)
    h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"l{l}_ln2")(x)
    h = keras.layers.Dense(cfg.d_ff, activation="gelu", name=f"l{l}_up")(h)
    if cfg.dropout:   # on [batch, seq, d_ff]: split over its last dim in Megatron's layout, over both in 2D's
      h = keras.layers.Dropout(cfg.dropout, seed=l, name=f"l{l}_dropout")(h)
    x = Annotate(name=f"l{l}_mlp_out")(x + keras.layers.Dense(cfg.d_model, name=f"l{l}_down")(h))
  x = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")(x)
  logits = keras.layers.Dense(cfg.vocab, name="head")(x)
  return keras.Model(tokens, logits)


def keras_megatron_spec(path, shape):
  """Megatron layout for a Keras variable path (query/key/value kernels [d, heads, hd], output [heads, hd, d])."""
  if any(k in path for k in ("query/kernel", "key/kernel", "value/kernel")):
    return P(None, "model", None)
  if any(k in path for k in ("query/bias", "key/bias", "value/bias")):
    return P("model", None)
  if "attention_output/kernel" in path:
    return P("model", None, None)
  if path.endswith("_up/kernel"):
    return P(None, "model")
  if path.endswith("_up/bias"):
    return P("model")
  if path.endswith("_down/kernel"):
    return P("model", None)
  if path.endswith("head/kernel"):
    return P(None, "model")
  if path.endswith("head/bias"):
    return P("model")
  return P(*([None] * len(shape)))


def keras_2d_spec(path, shape):
  """GSPMD's 2D layout (the paper's dense LMs; Lingvo's DenseLm configs) for a Keras variable path: every matrix
  split over both mesh axes, its model dim (d_model) over `data` and its other dim (heads, MLP hidden, vocabulary)
  over `model`; vectors over `model`. The [batch, seq, d_model] activations go batch over `data`, d_model over
  `model` (ACTIVATIONS_2D): a contraction gathers its weight over `data` and its activation's d_model over
  `model`, so no device ever holds a whole weight."""
  if any(k in path for k in ("query/kernel", "key/kernel", "value/kernel")):
    return P("data", "model", None)        # [d_model, heads, head_dim]
  if "attention_output/kernel" in path:
    return P("model", None, "data")        # [heads, head_dim, d_model]
  if path.endswith("_up/kernel") or path.endswith("head/kernel"):
    return P("data", "model")              # [d_model, d_ff] / [d_model, vocab]
  if path.endswith("_down/kernel"):
    return P("model", "data")              # [d_ff, d_model]
  if path.endswith("embed/embeddings"):
    return P("model", "data")              # [vocab, d_model]
  if path.endswith("pos/table"):
    return P(None, "model")                # [seq, d_model]
  if len(shape) == 2:                       # query/key/value biases [heads, head_dim]
    return P("model", None)
  return P("model") if len(shape) == 1 and shape[0] > 1 else P(*([None] * len(shape)))


ACTIVATIONS_2D = P("data", None, "model")
LAYOUTS = {"megatron": keras_megatron_spec, "2d": keras_2d_spec}


def make_keras_train_step(model, optimizer, annotate=True, layout="megatron"):
  """A Keras training step: forward, cross-entropy, GradientTape, optimizer.apply (the variables annotated with
  `layout`, "megatron" or "2d" (LAYOUTS), unless `annotate` is False: automatic sharding chooses it)."""
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  loss_obj = None
  spec_of = LAYOUTS[layout]

  def train_step(tokens, targets):
    nonlocal loss_obj
    for v in model.trainable_variables if annotate else ():
      gs.shard(v, spec_of(v.path, v.shape))
    with tf.GradientTape() as tape:
      logits = model(tokens, training=True)
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    return loss

  return train_step


# ---- pipelined (GSPMD pipeline over a `stage` mesh axis) ---------------------------------------------------------

LAYER_LEAVES = ("ln1/scale", "ln1/bias", "wq", "wk", "wv", "wo", "ln2/scale", "ln2/bias", "w1", "b1", "w2", "b2")
GLOBAL_LEAVES = ("embed", "pos", "ln_f/scale", "ln_f/bias")


def decoder_layer(p, x, cfg, causal=None):
  """One decoder layer on x [batch, seq, d] with the layer's weights `p` (leaf name -> tensor), as in `forward`."""
  hd = cfg.d_model // cfg.heads
  if causal is None:
    causal = causal_mask(cfg.seq)
  h = layer_norm(x, p["ln1/scale"], p["ln1/bias"])
  q = tf.einsum("bsd,dhk->bhsk", h, p["wq"])
  k = tf.einsum("bsd,dhk->bhsk", h, p["wk"])
  v = tf.einsum("bsd,dhk->bhsk", h, p["wv"])
  att = tf.nn.softmax(tf.einsum("bhqk,bhsk->bhqs", q, k) / math.sqrt(hd) + causal)
  x = x + tf.einsum("bhqk,hkd->bqd", tf.einsum("bhqs,bhsk->bhqk", att, v), p["wo"])
  h = layer_norm(x, p["ln2/scale"], p["ln2/bias"])
  return x + tf.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def pipelined_specs(cfg, repeats=1, megatron=False):
  """Layouts of the pipelined parameters: stage weights [S, (R,) layers per slot, ...] split over `stage` (and
  Megatron's `model` split inside each stage when `megatron`); the embedding and final norm replicated."""
  lead = (("stage",) + (None,) * (2 if repeats > 1 else 1))
  specs = {k: P() for k in GLOBAL_LEAVES}
  inner = megatron_specs(cfg) if megatron else {}
  for leaf in LAYER_LEAVES:
    own = inner.get(f"l0/{leaf}", P())
    rank = len(param_shapes(cfg)[f"l0/{leaf}"])
    specs[f"layers/{leaf}"] = P(*lead, *(tuple(own) + (None,) * (rank - len(own))))
  return specs


def pipelined_shapes(cfg):
  """Shapes of the pipelined parameters before stacking: the global leaves', and each layer leaf's per layer."""
  flat = param_shapes(cfg)
  return {**{k: flat[k] for k in GLOBAL_LEAVES}, **{f"layers/{leaf}": flat[f"l0/{leaf}"] for leaf in LAYER_LEAVES}}


def init_pipelined_params(cfg, stages, repeats=1, seed=0):
  """The parameters of `init_params` (same values), the layers' stacked as stage weights (`gs.stack_stages`)."""
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  flat = init_params(cfg, seed)
  params = {k: flat[k] for k in GLOBAL_LEAVES}
  for leaf in LAYER_LEAVES:
    stacked = np.stack([flat[f"l{l}/{leaf}"] for l in range(cfg.layers)])
    params[f"layers/{leaf}"] = gs.stack_stages(stacked, stages, repeats, what=f"layers/{leaf}")
  return params


def pipelined_loss(params, tokens, targets, cfg, microbatches, repeats=1):
  """The loss of `loss_fn`, the layers run as a GSPMD pipeline (`gs.pipeline`, stage fn vectorized over stages)."""
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  x = tf.gather(params["embed"], tokens) + params["pos"]
  causal = causal_mask(cfg.seq)
  stage = {leaf: params[f"layers/{leaf}"] for leaf in LAYER_LEAVES}

  def stage_fn(w, h):   # one stage slot: its layers in order
    for l in range(w["wq"].shape[0]):
      h = decoder_layer({k: v[l] for k, v in w.items()}, h, cfg, causal)
    return h

  x = gs.pipeline(stage_fn, stage, x, microbatches=microbatches, circular_repeats=repeats, stage_axis="stage")
  x = layer_norm(x, params["ln_f/scale"], params["ln_f/bias"])
  logits = tf.einsum("bsd,vd->bsv", x, params["embed"])
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits))


class PipelinedLM(tf.Module):
  """The pipelined language model with Adam: variables (parameters, Adam moments, step), and `train_step`.

  Built from the same seed, it holds `init_params`' values, so its losses are the unpipelined model's. Each
  stage weight and its Adam moments are annotated split over `stage`: a device stores only its stages'.
  """

  def __init__(self, cfg, stages, microbatches, repeats=1, megatron=False, seed=0):
    super().__init__(name="pipelined_lm")
    self.cfg, self.microbatches, self.repeats = cfg, microbatches, repeats
    import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
    # Initial values are computed when a variable is created with a value (not inside gs.plan_scope()).
    values = functools.lru_cache(maxsize=None)(lambda: init_pipelined_params(cfg, stages, repeats, seed))
    layers = gs.stack_stages(np.zeros((cfg.layers,), np.int8), stages, repeats, what="layers").shape
    shapes = {k: tuple(layers) + s if k.startswith("layers/") else s for k, s in pipelined_shapes(cfg).items()}
    self.specs = pipelined_specs(cfg, repeats, megatron)
    self.names = sorted(shapes)

    def var(k, init, suffix=""):
      return tf.Variable(init, shape=shapes[k], dtype=tf.float32, name=k.replace("/", "_") + suffix)

    self.params = {k: var(k, lambda k=k: values()[k]) for k in self.names}
    self.m = {k: var(k, lambda k=k: tf.zeros(shapes[k]), "_m") for k in self.names}
    self.v = {k: var(k, lambda k=k: tf.zeros(shapes[k]), "_v") for k in self.names}
    self.step = tf.Variable(0, dtype=tf.int64, name="adam_step")

  def train_step(self, tokens, targets):
    import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
    b1, b2, eps = 0.9, 0.999, 1e-7
    params = {k: gs.shard(self.params[k], self.specs[k]) for k in self.names}
    with tf.GradientTape() as tape:
      tape.watch(list(params.values()))
      loss = pipelined_loss(params, tokens, targets, self.cfg, self.microbatches, self.repeats)
    grads = tape.gradient(loss, [params[k] for k in self.names])
    t = tf.cast(self.step, tf.float32) + 1.0
    lr = self.cfg.lr * tf.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)
    for k, g in zip(self.names, grads):
      m = gs.shard(b1 * self.m[k] + (1.0 - b1) * g, self.specs[k])
      v = gs.shard(b2 * self.v[k] + (1.0 - b2) * g * g, self.specs[k])
      self.m[k].assign(m)
      self.v[k].assign(v)
      self.params[k].assign(params[k] - lr * m / (tf.sqrt(v) + eps))
    self.step.assign_add(1)
    return loss
