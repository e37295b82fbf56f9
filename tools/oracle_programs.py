"""The programs tools/xla_oracle.py partitions both ways: the ten reference workloads and six more, small.

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


# Where the two partitioners differ, and why (tools/xla_oracle.py prints these under the table; the oracle's tests
# assert them exactly).
KNOWN_DIFFERENCES = {
    "pool_halo": "XLA's result differs: its partition of MaxPoolGrad (select-and-scatter, 3x3 stride 1 SAME, rows "
                 "split) gives the first shard's rows a wrong input gradient, where the window reaches into the "
                 "padding; XLA unpartitioned (jit_compile) and tf_gspmd agree with TF",
}

PROGRAMS = {**{name: _workload(name) for name in REFERENCE},
            "transformer_megatron": transformer_megatron, "transformer_2d": transformer_2d, "moe_step": moe_step,
            "conv_halo": conv_halo, "pool_halo": pool_halo, "pipeline": pipeline, "pad_shift": pad_shift,
            "pad_conv": pad_conv}
