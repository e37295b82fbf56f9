"""The programs tools/xla_oracle.py partitions both ways: the ten reference workloads and 23 more, small.

Each entry of `PROGRAMS` builds a `Job` (the function, its numpy arguments, their shardings, the output
shardings, the mesh) when called, so that building one costs nothing until it is used.
"""

import dataclasses
import math
import os
import sys
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("bench", "examples"):
  if os.path.join(ROOT, _sub) not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, _sub))


@dataclasses.dataclass
class Job:
  """One program for the oracle: `fn(*args)` with `args` laid out as `in_specs` on `mesh`."""

  name: str
  fn: Callable
  args: list
  in_specs: Any
  mesh: Any
  out_specs: Any = None
  note: Optional[str] = None


def _workload(name):
  def build():
    import workloads  # pylint: disable=g-import-not-at-top
    for n, fn, mesh, ins, outs, args, _ in workloads.workloads():
      if n == name:
        return Job(n, fn, list(args), ins, mesh, outs)
    raise KeyError(name)
  return build


REFERENCE = ("mlp_megatron", "mlp_train_step", "attention", "moe_gshard", "conv_spatial", "embedding_vocab_sharded",
             "uneven", "reshape_transpose", "layernorm_softmax_xent", "softmax_xent")


def _transformer_config():
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  return tm.Config(layers=12, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=8)


def transformer_megatron():
  """The 12-layer decoder's Adam step (parameters and slots as arguments), Megatron's layout on (2,4)."""
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  step, args, specs = tm.megatron_train_args(_transformer_config())
  return Job("transformer_megatron", step, args, specs, gs.Mesh((2, 4), ("data", "model")))


def transformer_2d():
  """The same decoder as a Keras model with Adam (captured variables), GSPMD's 2D layout on (2,4): every weight
  split over both axes, the residual stream batch over data and d_model over model."""
  import keras  # pylint: disable=g-import-not-at-top
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  cfg = _transformer_config()
  keras.utils.set_random_seed(0)
  model = tm.keras_model(cfg, activations=tm.ACTIVATIONS_2D)
  optimizer = keras.optimizers.Adam(1e-3)
  optimizer.build(model.trainable_variables)
  tokens, targets = tm.synthetic_batch(cfg)
  step = tm.make_keras_train_step(model, optimizer, layout="2d")
  return Job("transformer_2d", step, [tokens, targets], (P("data", None), P("data", None)),
             gs.Mesh((2, 4), ("data", "model")))


def _moe_layer(x, gate_w, w1, w2, capacity):
  """GShard top-2 mixture of experts on x [groups, tokens, d]: (y, load-balancing loss)."""
  e = gate_w.shape[1]
  gates = tf.nn.softmax(tf.einsum("gsm,me->gse", x, gate_w))
  mask1 = tf.one_hot(tf.argmax(gates, axis=-1, output_type=tf.int32), e)
  mask2 = tf.one_hot(tf.argmax(gates * (1.0 - mask1), axis=-1, output_type=tf.int32), e)
  aux = tf.reduce_mean(tf.reduce_mean(mask1, axis=1) * tf.reduce_mean(gates, axis=1)) * float(e * e)
  pos1 = tf.cumsum(mask1, axis=1, exclusive=True)
  mask1 *= tf.cast(pos1 < capacity, mask1.dtype)
  pos2 = tf.cumsum(mask2, axis=1, exclusive=True) + tf.reduce_sum(mask1, axis=1, keepdims=True)
  mask2 *= tf.cast(pos2 < capacity, mask2.dtype)
  g1, g2 = tf.reduce_sum(gates * mask1, axis=-1), tf.reduce_sum(gates * mask2, axis=-1)
  norm = g1 + g2 + 1e-9
  slot1 = tf.one_hot(tf.cast(tf.reduce_sum(pos1 * mask1, axis=-1), tf.int32), capacity)
  slot2 = tf.one_hot(tf.cast(tf.reduce_sum(pos2 * mask2, axis=-1), tf.int32), capacity)
  combine = ((g1 / norm)[..., None, None] * mask1[..., None] * slot1[:, :, None, :] +
             (g2 / norm)[..., None, None] * mask2[..., None] * slot2[:, :, None, :])
  dispatch = tf.cast(combine > 0.0, x.dtype)
  expert_in = gs.shard(tf.einsum("gsec,gsm->egcm", dispatch, x), P("expert", None, None, None))
  h = tf.nn.gelu(tf.einsum("egcm,emh->egch", expert_in, w1))
  expert_out = gs.shard(tf.einsum("egch,ehm->egcm", h, w2), P("expert", None, None, None))
  return tf.einsum("gsec,egcm->gsm", combine, expert_out), aux


def moe_step():
  """One SGD step of a GShard top-2 MoE layer (gating, capacity, load-balancing loss), experts over (8,)."""
  rng = np.random.default_rng(1)
  g, s, d, e, h = 8, 16, 16, 8, 32
  capacity = int(math.ceil(2 * s * 2.0 / e))

  def step(x, gate_w, w1, w2):
    with tf.GradientTape() as tape:
      tape.watch([gate_w, w1, w2])
      y, aux = _moe_layer(x, gate_w, w1, w2, capacity)
      loss = tf.reduce_mean(tf.square(y)) + 0.01 * aux
    grads = tape.gradient(loss, [gate_w, w1, w2])
    return (loss,) + tuple(w - 0.1 * gr for w, gr in zip((gate_w, w1, w2), grads))

  args = [rng.standard_normal((g, s, d)).astype(np.float32),
          (rng.standard_normal((d, e)) * 0.5).astype(np.float32),
          (rng.standard_normal((e, d, h)) * 0.2).astype(np.float32),
          (rng.standard_normal((e, h, d)) * 0.2).astype(np.float32)]
  return Job("moe_step", step, args, (P("expert", None, None), P(), P("expert", None, None), P("expert", None, None)),
             gs.Mesh((8,), ("expert",)))


def conv_halo():
  """Two 5x5 SAME convolutions on an image split over rows (4) and columns (2): halos of two rows and columns,
  both ways, and the kernels' gradients (partial sums over the whole mesh)."""
  rng = np.random.default_rng(2)

  def step(x, k1, k2):
    with tf.GradientTape() as tape:
      tape.watch([k1, k2])
      y = tf.nn.conv2d(tf.nn.relu(tf.nn.conv2d(x, k1, 1, "SAME")), k2, 1, "SAME")
      loss = tf.reduce_mean(tf.square(y))
    return (y,) + tuple(tape.gradient(loss, [k1, k2]))

  args = [rng.standard_normal((2, 32, 32, 8)).astype(np.float32),
          (rng.standard_normal((5, 5, 8, 8)) * 0.1).astype(np.float32),
          (rng.standard_normal((5, 5, 8, 8)) * 0.1).astype(np.float32)]
  return Job("conv_halo", step, args, (P(None, "rows", "cols", None), P(), P()), gs.Mesh((4, 2), ("rows", "cols")),
             (P(None, "rows", "cols", None), P(), P()))


def pool_halo():
  """3x3 stride-1 SAME max pooling and 3x3 stride-2 SAME average pooling of rows split 8 ways (halos on both
  sides), with the gradient with respect to the input."""
  rng = np.random.default_rng(3)

  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.nn.avg_pool2d(tf.nn.max_pool2d(x, 3, 1, "SAME"), 3, 2, "SAME")
      loss = tf.reduce_sum(tf.square(y))
    return y, tape.gradient(loss, x)

  return Job("pool_halo", step, [rng.standard_normal((2, 64, 16, 4)).astype(np.float32)],
             (P(None, "rows", None, None),), gs.Mesh((8,), ("rows",)),
             (P(None, "rows", None, None), P(None, "rows", None, None)))


def pad_shift():
  """tf.pad(x, [[7, 0], [0, 0]])[:64]: x [64,1024] over 8 rows shifted down by 7 (each device needs the 7 rows
  before its own: one collective-permute)."""
  x = np.random.default_rng(5).standard_normal((64, 1024)).astype(np.float32)
  return Job("pad_shift", lambda t: tf.pad(t, [[7, 0], [0, 0]])[:64], [x], (P("rows", None),), gs.Mesh((8,), ("rows",)),
             P("rows", None))


def pad_conv():
  """tf.pad by 3 then a VALID 7x7 stride-2 convolution (ResNet's stem as the pad and the conv), rows split 8
  ways: XLA folds the pad into the convolution's padding."""
  rng = np.random.default_rng(6)
  args = [rng.standard_normal((2, 64, 32, 3)).astype(np.float32),
          (rng.standard_normal((7, 7, 3, 8)) * 0.2).astype(np.float32)]
  return Job("pad_conv", lambda x, k: tf.nn.conv2d(tf.pad(x, [[0, 0], [3, 3], [3, 3], [0, 0]]), k, 2, "VALID"), args,
             (P(None, "rows", None, None), P()), gs.Mesh((8,), ("rows",)), P(None, "rows", None, None))


def pipeline():
  """gs.pipeline: 4 stages of two residual tanh layers, 8 microbatches, on (stage 4, data 2); forward and the
  pipelined backward pass."""
  rng = np.random.default_rng(4)
  stages, width, batch = 4, 8, 16
  layers = (rng.standard_normal((stages * 2, width, width)) * 0.3).astype(np.float32)

  def stage_fn(w, h):
    for k in range(w.shape[0]):
      h = h + tf.tanh(h @ w[k])
    return h

  def step(x, w):
    with tf.GradientTape() as tape:
      tape.watch([x, w])
      y = gs.pipeline(stage_fn, w, x, microbatches=8)
      loss = tf.reduce_mean(y ** 2)
    gx, gw = tape.gradient(loss, [x, w])
    return y, gx, gw

  args = [rng.standard_normal((batch, width)).astype(np.float32), gs.stack_stages(layers, stages)]
  return Job("pipeline", step, args, (P("data", None), P("stage")), gs.Mesh((4, 2), ("stage", "data")))


def unet3d_block():
  """A 3-D U-Net block (two 3x3x3 SAME convolutions, ReLU, a 2x2x2 max pool) and its gradients, the volume split
  over its three spatial dims on (2, 2, 2)."""
  rng = np.random.default_rng(7)
  vol = P(None, "depth", "rows", "cols", None)

  def step(x, k1, k2):
    with tf.GradientTape() as tape:
      tape.watch([x, k1, k2])
      h = tf.nn.relu(tf.nn.conv3d(x, k1, [1] * 5, "SAME"))
      y = tf.nn.max_pool3d(tf.nn.conv3d(h, k2, [1] * 5, "SAME"), 2, 2, "VALID")
      loss = tf.reduce_mean(tf.square(y))
    return (y,) + tuple(tape.gradient(loss, [x, k1, k2]))

  args = [rng.standard_normal((2, 16, 16, 16, 4)).astype(np.float32),
          (rng.standard_normal((3, 3, 3, 4, 8)) * 0.2).astype(np.float32),
          (rng.standard_normal((3, 3, 3, 8, 8)) * 0.1).astype(np.float32)]
  return Job("unet3d_block", step, args, (vol, P(), P()), gs.Mesh((2, 2, 2), ("depth", "rows", "cols")),
             (vol, vol, P(), P()))


def top_k_split():
  """tf.math.top_k over the last dim, split 8 ways: each device its own top k, then the top k of the candidates."""
  x = np.random.default_rng(9).standard_normal((16, 1024)).astype(np.float32)
  return Job("top_k_split", lambda t: tf.math.top_k(t, 4), [x], (P(None, "d"),), gs.Mesh((8,), ("d",)), (P(), P()))


def cumsum_split():
  """tf.cumsum over dim 0 split 8 ways (forward and reverse): each device's own prefix sums plus its predecessors'
  totals."""
  x = np.random.default_rng(10).standard_normal((256, 64)).astype(np.float32)
  return Job("cumsum_split", lambda t: (tf.cumsum(t, 0), tf.cumsum(t, 0, reverse=True)), [x], (P("d", None),),
             gs.Mesh((8,), ("d",)), (P("d", None), P("d", None)))


def scan_stacked():
  """A tanh layer applied with each of 6 stacked weights in turn (a while loop reading weight i of the stack),
  weights and activations split Megatron-style, and the gradient of the stack."""
  rng = np.random.default_rng(11)

  def step(x, ws):
    with tf.GradientTape() as tape:
      tape.watch(ws)
      _, y = tf.while_loop(lambda i, h: i < 6, lambda i, h: (i + 1, tf.tanh(h @ tf.gather(ws, i))),
                           (tf.constant(0), x), maximum_iterations=6)
      loss = tf.reduce_mean(tf.square(y))
    return y, tape.gradient(loss, ws)

  args = [rng.standard_normal((16, 64)).astype(np.float32), (rng.standard_normal((6, 64, 64)) * 0.2).astype(np.float32)]
  return Job("scan_stacked", step, args, (P("data", None), P(None, None, "model")), gs.Mesh((2, 4), ("data", "model")))


def argmax_split():
  """tf.argmax over the last dim, split 8 ways: each shard's winner, value and global index, gathered."""
  x = np.random.default_rng(12).standard_normal((32, 1024)).astype(np.float32)
  return Job("argmax_split", lambda t: tf.argmax(t, -1), [x], (P(None, "d"),), gs.Mesh((8,), ("d",)), P())


def megatron_dropout():
  """A Megatron MLP block with dropout on its hidden activation (split over its last dim) and its gradients."""
  rng = np.random.default_rng(14)

  def step(x, w1, w2, seed):
    with tf.GradientTape() as tape:
      tape.watch([w1, w2])
      h = tf.nn.experimental.stateless_dropout(tf.nn.relu(x @ w1), rate=0.25, seed=seed)
      loss = tf.reduce_mean(tf.square(h @ w2))
    return (loss,) + tuple(tape.gradient(loss, [w1, w2]))

  args = [rng.standard_normal((16, 64)).astype(np.float32), (rng.standard_normal((64, 256)) * 0.1).astype(np.float32),
          (rng.standard_normal((256, 64)) * 0.1).astype(np.float32), np.array([3, 7], np.int32)]
  return Job("megatron_dropout", step, args, (P("data", None), P(None, "model"), P("model", None), P()),
             gs.Mesh((2, 4), ("data", "model")))


def resnet_stem_2d():
  """ResNet's stem (7x7 stride-2 convolution, 3x3 stride-2 max pool) on an image split over rows and columns, and
  its gradients."""
  rng = np.random.default_rng(15)
  spatial = P(None, "rows", "cols", None)

  def step(x, k):
    with tf.GradientTape() as tape:
      tape.watch([x, k])
      y = tf.nn.max_pool2d(tf.nn.relu(tf.nn.conv2d(x, k, 2, "SAME")), 3, 2, "SAME")
      loss = tf.reduce_mean(tf.square(y))
    return (y,) + tuple(tape.gradient(loss, [x, k]))

  args = [rng.standard_normal((2, 64, 64, 3)).astype(np.float32), (rng.standard_normal((7, 7, 3, 8)) * 0.1).astype(
      np.float32)]
  return Job("resnet_stem_2d", step, args, (spatial, P()), gs.Mesh((4, 2), ("rows", "cols")), (spatial, spatial, P()))


def reduce_both():
  """Sums and means over both split dims of a [rows, cols] matrix on (2, 4), one dim at a time and both at once."""
  x = np.random.default_rng(16).standard_normal((64, 128)).astype(np.float32)
  return Job("reduce_both", lambda t: (tf.reduce_sum(t), tf.reduce_mean(t, 0), tf.reduce_max(t, 1)), [x],
             (P("data", "model"),), gs.Mesh((2, 4), ("data", "model")), (P(), P("model"), P("data")))


def layer_norm_model():
  """Layer normalisation over a hidden dim split 4 ways (statistics all-reduced), scaled and shifted, and its
  gradients."""
  rng = np.random.default_rng(18)

  def step(x, g, b):
    with tf.GradientTape() as tape:
      tape.watch([x, g, b])
      mean, var = tf.nn.moments(x, [-1], keepdims=True)
      y = (x - mean) * tf.math.rsqrt(var + 1e-5) * g + b
      loss = tf.reduce_mean(tf.square(y) * tf.range(1.0, 65.0))
    return (y,) + tuple(tape.gradient(loss, [x, g, b]))

  args = [rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((64,)).astype(np.float32),
          rng.standard_normal((64,)).astype(np.float32)]
  return Job("layer_norm_model", step, args, (P("data", "model"), P("model"), P("model")),
             gs.Mesh((2, 4), ("data", "model")))


def mlp_2d_dropout():
  """The 2D weight layout (GSPMD's 2D sharding: weights split over both axes, activations over data and model) of an
  MLP with dropout on its hidden activation, and its gradients."""
  rng = np.random.default_rng(19)

  def step(x, w1, w2, seed):
    with tf.GradientTape() as tape:
      tape.watch([w1, w2])
      h = tf.nn.experimental.stateless_dropout(tf.nn.gelu(gs.shard(x @ w1, P("data", "model"))), rate=0.1, seed=seed)
      loss = tf.reduce_mean(tf.square(gs.shard(h @ w2, P("data", "model"))))
    return (loss,) + tuple(tape.gradient(loss, [w1, w2]))

  args = [rng.standard_normal((32, 64)).astype(np.float32), (rng.standard_normal((64, 128)) * 0.1).astype(np.float32),
          (rng.standard_normal((128, 64)) * 0.1).astype(np.float32), np.array([5, 1], np.int32)]
  return Job("mlp_2d_dropout", step, args, (P("data", "model"), P("data", "model"), P("model", "data"), P()),
             gs.Mesh((2, 4), ("data", "model")))


def softmax_split():
  """Softmax over a last dim split 8 ways (its max and sum all-reduced) and its gradient."""
  x = np.random.default_rng(20).standard_normal((64, 512)).astype(np.float32)

  def step(t):
    with tf.GradientTape() as tape:
      tape.watch(t)
      y = tf.nn.softmax(t)
      loss = tf.reduce_sum(y * tf.range(512.0))
    return y, tape.gradient(loss, t)

  return Job("softmax_split", step, [x], (P(None, "d"),), gs.Mesh((8,), ("d",)), (P(None, "d"), P(None, "d")))


def einsum_two_contracted():
  """An einsum contracting two dims split over both mesh axes: one all-reduce over both."""
  rng = np.random.default_rng(21)
  args = [rng.standard_normal((16, 32, 64)).astype(np.float32), rng.standard_normal((32, 64, 24)).astype(np.float32)]
  return Job("einsum_two_contracted", lambda x, w: tf.einsum("bij,ijo->bo", x, w), args,
             (P(None, "data", "model"), P("data", "model", None)), gs.Mesh((2, 4), ("data", "model")), P())


def bert_tied_mlm():
  """A BERT encoder layer with its masked-LM head reading the word-embedding table (tied), one SGD step: table split
  over the vocabulary, attention heads and the feed-forward hidden dim over model, batch over data, on (2,4)."""
  rng = np.random.default_rng(22)
  b, s, d, heads, f, v, masked = 8, 16, 32, 4, 64, 128, 4

  def step(ids, positions, labels, table, pos_emb, wqkv, wo, w1, w2, wt):
    ws = [table, pos_emb, wqkv, wo, w1, w2, wt]
    with tf.GradientTape() as tape:
      tape.watch(ws)
      x = tf.gather(table, ids) + pos_emb[None]
      qkv = tf.einsum("bsd,dthk->tbshk", x, wqkv)
      att = tf.nn.softmax(tf.einsum("bshk,bthk->bhst", qkv[0], qkv[1]) / math.sqrt(d // heads))
      x = x + tf.einsum("bhst,bthk,hkd->bsd", att, qkv[2], wo)
      mean, var = tf.nn.moments(x, [-1], keepdims=True)
      x = (x - mean) * tf.math.rsqrt(var + 1e-6)
      x = x + tf.einsum("bsf,fd->bsd", tf.nn.gelu(tf.einsum("bsd,df->bsf", x, w1)), w2)
      h = tf.gather(x, positions, batch_dims=1)                       # [b, masked, d]: the masked tokens
      h = tf.nn.gelu(tf.einsum("bmd,de->bme", h, wt))
      logits = tf.einsum("bmd,vd->bmv", h, table)                     # the tied output projection
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    grads = [tf.convert_to_tensor(gr) for gr in tape.gradient(loss, ws)]   # the table's IndexedSlices dense
    return (loss,) + tuple(w - 0.1 * gr for w, gr in zip(ws, grads))

  args = [rng.integers(0, v, (b, s)).astype(np.int32),
          np.stack([rng.permutation(s)[:masked] for _ in range(b)]).astype(np.int32),
          rng.integers(0, v, (b, masked)).astype(np.int32),
          (rng.standard_normal((v, d)) * 0.2).astype(np.float32),
          (rng.standard_normal((s, d)) * 0.1).astype(np.float32),
          (rng.standard_normal((d, 3, heads, d // heads)) * 0.2).astype(np.float32),
          (rng.standard_normal((heads, d // heads, d)) * 0.2).astype(np.float32),
          (rng.standard_normal((d, f)) * 0.2).astype(np.float32),
          (rng.standard_normal((f, d)) * 0.2).astype(np.float32),
          (rng.standard_normal((d, d)) * 0.2).astype(np.float32)]
  batch = P("data", None)
  specs = (batch, batch, batch, P("model", None), P(), P(None, None, "model", None), P("model", None, None),
           P(None, "model"), P("model", None), P())
  return Job("bert_tied_mlm", step, args, specs, gs.Mesh((2, 4), ("data", "model")))


def moe_loss():
  """A GShard MoE language model's step: embedding, the top-2 MoE layer (experts over model), the output projection
  and the token cross-entropy over [groups, tokens] flattened, plus the load-balancing loss; groups over data."""
  rng = np.random.default_rng(23)
  g, s, d, e, h, v = 8, 16, 16, 4, 32, 64
  capacity = int(math.ceil(2 * s * 2.0 / e))

  def step(tokens, targets, emb, gate_w, w1, w2, out):
    ws = [emb, gate_w, w1, w2, out]
    with tf.GradientTape() as tape:
      tape.watch(ws)
      x = tf.gather(emb, tokens)
      y, aux = _moe_layer(x, gate_w, w1, w2, capacity)
      logits = tf.einsum("gsm,mv->gsv", x + y, out)
      lm = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=tf.reshape(targets, [-1]), logits=tf.reshape(logits, [-1, v])))
      loss = lm + 0.01 * aux
    grads = [tf.convert_to_tensor(gr) for gr in tape.gradient(loss, ws)]   # the embedding's IndexedSlices dense
    return (loss,) + tuple(w - 0.1 * gr for w, gr in zip(ws, grads))

  args = [rng.integers(0, v, (g, s)).astype(np.int32), rng.integers(0, v, (g, s)).astype(np.int32),
          (rng.standard_normal((v, d)) * 0.5).astype(np.float32),
          (rng.standard_normal((d, e)) * 0.5).astype(np.float32),
          (rng.standard_normal((e, d, h)) * 0.2).astype(np.float32),
          (rng.standard_normal((e, h, d)) * 0.2).astype(np.float32),
          (rng.standard_normal((d, v)) * 0.2).astype(np.float32)]
  specs = (P("data", None), P("data", None), P(), P(), P("expert", None, None), P("expert", None, None), P())
  return Job("moe_loss", step, args, specs, gs.Mesh((2, 4), ("data", "expert")))


def unet_loss():
  """A U-Net output head's per-pixel loss: a 3x3 convolution to class logits and the sparse softmax cross-entropy
  over [batch, rows, cols], rows and columns split on (4,2), and the gradients."""
  rng = np.random.default_rng(24)
  image = P(None, "rows", "cols", None)

  def step(x, labels, k):
    with tf.GradientTape() as tape:
      tape.watch([x, k])
      logits = tf.nn.conv2d(x, k, 1, "SAME")
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    return (loss,) + tuple(tape.gradient(loss, [x, k]))

  args = [rng.standard_normal((2, 32, 32, 8)).astype(np.float32), rng.integers(0, 5, (2, 32, 32)).astype(np.int32),
          (rng.standard_normal((3, 3, 8, 5)) * 0.2).astype(np.float32)]
  return Job("unet_loss", step, args, (image, P(None, "rows", "cols"), P()), gs.Mesh((4, 2), ("rows", "cols")),
             (P(), image, P()))


# Where the two partitioners differ, and why (tools/xla_oracle.py prints these under the table; the oracle's tests
# assert them exactly).
KNOWN_DIFFERENCES = {
    "mlp_2d_dropout": "XLA's result differs: as in megatron_dropout, its partition of the dropout's random bits (the "
                      "hidden activation split over both axes) draws other values than its unpartitioned program",
    "megatron_dropout": "XLA's result differs: its partition of the dropout's stateless random bits (the hidden "
                        "activation split over its last dim) draws other values than its unpartitioned program; "
                        "tf_gspmd generates each shard's bits at their own counters, equal to TF's",
    "pool_halo": "XLA's result differs: its partition of MaxPoolGrad (select-and-scatter, 3x3 stride 1 SAME, rows "
                 "split) gives the first shard's rows a wrong input gradient, where the window reaches into the "
                 "padding; XLA unpartitioned (jit_compile) and tf_gspmd agree with TF",
}

PROGRAMS = {**{name: _workload(name) for name in REFERENCE},
            "transformer_megatron": transformer_megatron, "transformer_2d": transformer_2d, "moe_step": moe_step,
            "conv_halo": conv_halo, "pool_halo": pool_halo, "pipeline": pipeline, "pad_shift": pad_shift,
            "pad_conv": pad_conv, "unet3d_block": unet3d_block, "top_k_split": top_k_split,
            "cumsum_split": cumsum_split, "scan_stacked": scan_stacked, "argmax_split": argmax_split,
            "megatron_dropout": megatron_dropout, "resnet_stem_2d": resnet_stem_2d,
            "reduce_both": reduce_both, "layer_norm_model": layer_norm_model, "mlp_2d_dropout": mlp_2d_dropout,
            "softmax_split": softmax_split, "einsum_two_contracted": einsum_two_contracted,
            "bert_tied_mlm": bert_tied_mlm, "moe_loss": moe_loss, "unet_loss": unet_loss}
