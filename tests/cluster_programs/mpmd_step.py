"""A 3-stage MPMD pipeline (gs.mpmd_pipeline) whose stages differ: an embedding-like stage, two dense residual
blocks, a vocabulary head with softmax cross-entropy. The model is shared with tests/parallel/test_mpmd.py; run as a
program by 2 processes x 4 CPUs: stage 0 on process 0's four devices, stages 1 and 2 on two devices each of
process 1, so activations and their gradients cross between the processes at one boundary and stay inside
process 1 at the other.

Prints one JSON line per process: per schedule, the loss (the process running the last stage), whether each
gradient this process holds equals plain TF's, and the stages' executed orders.
"""

import json

import numpy as np

V, D, H, T, N = 32, 16, 24, 6, 16   # vocabulary, model dim, hidden dim, tokens per row, batch rows


def embed(params, ids):   # embedding-like first stage: a table lookup, averaged over the tokens
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  (table,) = params
  return tf.reduce_mean(tf.gather(table, ids), axis=1)


def blocks(params, h):    # two residual dense blocks
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  w1, w2, w3, w4 = params
  h = h + tf.tanh(h @ w1) @ w2
  return h + tf.nn.relu(h @ w3) @ w4


def head(params, h, labels):   # vocabulary head with softmax cross-entropy
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  (w,) = params
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, h @ w))


def data(seed=0):
  """(params per stage, token ids [N, T], labels [N])."""
  rng = np.random.default_rng(seed)
  f = lambda *s: (rng.normal(size=s) * 0.3).astype(np.float32)  # noqa: E731
  params = [(f(V, D) * 3,), (f(D, H), f(H, D), f(D, H), f(H, D)), (f(D, V),)]
  ids = rng.integers(0, V, size=(N, T)).astype(np.int32)
  labels = rng.integers(0, V, size=(N,)).astype(np.int32)
  return params, ids, labels


def reference(params, ids, labels):
  """The unpartitioned step: the whole batch through the three stages, loss and gradients (plain TF)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  ps = [tuple(tf.Variable(p) for p in stage) for stage in params]
  with tf.GradientTape() as tape:
    loss = head(ps[2], blocks(ps[1], embed(ps[0], ids)), labels)
  grads = tape.gradient(loss, ps)
  return loss.numpy(), [tuple(tf.convert_to_tensor(g).numpy() for g in stage) for stage in grads]


def stages(gs, meshes):
  """The three stages on `meshes` (first: axes ("d", "m"); second: ("d", "m"); third: ("m",))."""
  P = gs.P
  return [gs.Stage(embed, meshes[0], (P(None, "m"),), P("d", None), P(None, "m")),
          gs.Stage(blocks, meshes[1], (P(None, "m"), P("m", None), P(None, "m"), P("m", None)), P("d", None),
                   P("d", None)),
          gs.Stage(head, meshes[2], (P(None, "m"),), P(None, None), target_sharding=P())]


def main():
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  k, _ = gs.initialize(cpu_devices=8)
  worker = lambda t, i: f"/job:worker/replica:0/task:{t}/device:CPU:{i}"  # noqa: E731
  meshes = [gs.Mesh((2, 2), ("d", "m"), devices=[worker(0, i) for i in range(4)]),
            gs.Mesh((1, 2), ("d", "m"), devices=[worker(1, 0), worker(1, 1)]),
            gs.Mesh((2,), ("m",), devices=[worker(1, 2), worker(1, 3)])]
  params, ids, labels = data()
  want_loss, want_grads = reference(params, ids, labels)
  out = {"process": k}
  for schedule in ("1f1b", "gpipe"):
    pipe = gs.mpmd_pipeline(stages(gs, meshes), microbatches=4, schedule=schedule)
    loss, grads = pipe(params, ids, labels)
    held = [i for i, g in enumerate(grads) if g is not None]
    out[schedule] = {
        "loss": None if loss is None else float(loss), "want_loss": float(want_loss), "stages": held,
        "grads_equal": all(np.allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)
                           for i in held for g, w in zip(grads[i], want_grads[i])),
        "order": pipe.last_run.order, "peak_alive": pipe.last_run.peak_alive,
        "crossing": sum(t.bytes for t in pipe.last_run.transfers.transfers
                        if gs.is_local(t.src_device) != gs.is_local(t.dst_device)),
    }
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
