"""A step planned by gs.auto_parallel over 2 processes x 4 CPUs (mesh (2, 4): a row per process, so every stage
runs in one process): the model of tests/parallel/test_auto_parallel.py (an embedding, residual dense blocks, a
vocabulary head), three Adam steps with the parameters and moments on their stages' devices.

Prints one JSON line per process: the stages it runs, its losses (every process gets them), the unpartitioned
program's losses (plain TF, Keras's Adam) and whether each parameter this process holds equals plain TF's after
the steps.
"""

import json

import numpy as np

V, D, F, S, N, BLOCKS = 512, 32, 64, 8, 16, 3


def init(seed=0):
  rng = np.random.default_rng(seed)
  params = {"embed": rng.normal(0, 0.5, (V, D)), "head": rng.normal(0, 0.2, (D, V))}
  for b in range(BLOCKS):
    params[f"b{b}/w1"] = rng.normal(0, 0.2, (D, F))
    params[f"b{b}/w2"] = rng.normal(0, 0.2, (F, D))
  return {k: v.astype(np.float32) for k, v in params.items()}


def block(params, b, x):
  """Residual dense block b."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  h = tf.nn.relu(tf.einsum("nsd,df->nsf", x, params[f"b{b}/w1"]))
  return x + tf.einsum("nsf,fd->nsd", h, params[f"b{b}/w2"])


def token_losses(params, tokens, labels):
  """Each token's cross-entropy: the embedding, the blocks, the vocabulary head."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x = tf.gather(params["embed"], tokens)                      # [n, S, D]
  for b in range(BLOCKS):
    x = block(params, b, x)
  logits = tf.einsum("nsd,dv->nsv", x, params["head"])
  return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def loss_fn(params, tokens, labels):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.reduce_mean(token_losses(params, tokens, labels))


def data(seed=1):
  rng = np.random.default_rng(seed)
  return rng.integers(0, V, (N, S)).astype(np.int32), rng.integers(0, V, (N, S)).astype(np.int32)


def planned(gs):
  """The step planned on mesh (2, 4) (a row per process) under one calibration in every process, so that they
  plan alike (cheap calls and moves, under which it pipelines), and a budget under which the blocks and the head
  go to different stages."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from tf_gspmd.rewriter.stages import calibrate  # pylint: disable=g-import-not-at-top
  cal = dataclasses.replace(calibrate.DEFAULT, seconds_per_call=2e-5, seconds_per_transfer_byte=1e-11,
                            seconds_per_move=1e-7, parallel_devices=float("inf"))
  return gs.auto_parallel(loss_fn, init(), *data(), mesh=gs.Mesh((2, 4), ("host", "device")), microbatches=4,
                          layers=6, calibration=cal, memory_budget=250_000)


def main():
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  k, _ = gs.initialize()
  tokens, labels = data()
  step = planned(gs)
  params = step.place(init())
  opt = step.adam(0.01)
  losses = []
  for _ in range(3):
    loss, grads = step(params, tokens, labels)
    params = opt(params, grads)
    losses.append(float(loss))
  want = {n: tf.Variable(v) for n, v in init().items()}
  ref_opt, want_losses = keras.optimizers.Adam(0.01), []
  for _ in range(3):
    with tf.GradientTape() as tape:
      ref = loss_fn(want, tf.constant(tokens), tf.constant(labels))
    names = sorted(want)
    g = tape.gradient(ref, [want[n] for n in names])
    ref_opt.apply_gradients(zip([tf.convert_to_tensor(x) for x in g], [want[n] for n in names]))
    want_losses.append(float(ref.numpy()))
  held = sorted(n for n, v in params.items() if v is not None)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  try:   # (the Keras form runs in one process: refused, naming the functional form)
    gs.auto_parallel(model, np.ones((8, 4), np.float32), np.ones((8, 2), np.float32), mesh=step.stages[0].mesh,
                     microbatches=1, optimizer=keras.optimizers.Adam(), loss=keras.losses.MeanSquaredError())
    keras_refused = ""
  except gs.InputError as e:
    keras_refused = str(e)
  print("RESULT " + json.dumps({
      "keras_refused": keras_refused,
      "process": k, "stages": [i for i, s in enumerate(step.stages) if gs.is_local(s.mesh.resolve_devices()[0])],
      "losses": losses, "want_losses": want_losses, "held": held,
      "params_equal": {n: bool(np.allclose(params[n].numpy(), want[n].numpy(), rtol=1e-5, atol=2e-5)) for n in held},
      "on_devices": all(isinstance(params[n], gs.ShardedTensor) and all(gs.is_local(d) for d in
                                                                       params[n].sharding.mesh.resolve_devices())
                        for n in held)}), flush=True)


if __name__ == "__main__":
  main()
