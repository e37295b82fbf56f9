"""The ten reference workloads of GSPMD, partitioned on 8 logical CPUs, next to XLA's own communication.

Each workload is built in TF exactly as specified (shapes, shardings), run partitioned and unpartitioned
on the same inputs (results must agree to rtol 1e-4), and its collectives, the collective ops the per-device
program emits for them and the bytes per device those ops send are printed beside XLA's figure, with the
ratio (<= 1.00 means no more communication than XLA).

  python bench/workloads.py [--only=mlp_megatron,attention]
"""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402

from programs import attention  # noqa: E402

flags.DEFINE_list("only", [], "Run only these workloads.")
FLAGS = flags.FLAGS


def workloads():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top

  m24 = gs.Mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(0)

  def normal(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)

  def mlp(x, w1, w2):
    return tf.nn.gelu(x @ w1) @ w2

  def mlp_train(x, t, w1, w2):
    with tf.GradientTape() as tape:
      tape.watch([w1, w2])
      loss = tf.reduce_mean(tf.square(mlp(x, w1, w2) - t))
    g1, g2 = tape.gradient(loss, [w1, w2])
    return w1 - 0.1 * g1, w2 - 0.1 * g2, loss

  def moe(x, mask, w1, w2):
    xg = tf.reshape(x, [8, 256, 512])
    disp = gs.shard(tf.einsum("gsm,gsec->egcm", xg, mask), P("expert", None, None, None))
    h = tf.nn.relu(tf.einsum("egcm,emh->egch", disp, w1))
    y = gs.shard(tf.einsum("egch,ehm->egcm", h, w2), P(None, "expert", None, None))
    return tf.reshape(tf.einsum("egcm,gsec->gsm", y, mask), [2048, 512])

  def conv(x, k1, k2):
    return tf.nn.conv2d(tf.nn.conv2d(x, k1, 1, "SAME"), k2, 1, "SAME")

  def embedding(table, ids):
    return tf.gather(table, tf.clip_by_value(ids, 0, 31999))

  def uneven(x, w):
    return tf.reduce_sum(tf.exp(x), axis=0), x @ w

  def reshape_transpose(x, w):
    return tf.transpose(tf.reshape(x, [16, 2048])) @ w

  def xent(logits, labels):
    m = tf.reduce_max(logits, axis=-1, keepdims=True)
    lse = tf.math.log(tf.reduce_sum(tf.exp(logits - m), axis=-1)) + tf.squeeze(m, -1)
    label_logit = tf.reduce_sum(logits * tf.one_hot(labels, logits.shape[-1]), axis=-1)
    return tf.reduce_mean(lse - label_logit)

  def layernorm_xent(logits, labels):
    mean = tf.reduce_mean(logits, axis=-1, keepdims=True)
    var = tf.reduce_mean(tf.square(logits - mean), axis=-1, keepdims=True)
    return xent((logits - mean) * tf.math.rsqrt(var + 1e-5), labels)

  mask = np.zeros((8, 256, 8, 256), np.float32)
  for g in range(8):
    for s in range(256):
      mask[g, s, (g + s) % 8, s % 256] = 1.0   # fixed top-1 dispatch, capacity 256

  yield ("mlp_megatron", mlp, m24, (P("data", None), P(None, "model"), P("model", None)), P("data", None),
         [normal(64, 1024), normal(1024, 4096, scale=0.03), normal(4096, 1024, scale=0.03)], 131072)
  yield ("mlp_train_step", mlp_train, m24,
         (P("data", None), P("data", None), P(None, "model"), P("model", None)), (P(None, "model"), P("model", None), P()),
         [normal(64, 1024), normal(64, 1024), normal(1024, 4096, scale=0.03), normal(4096, 1024, scale=0.03)], 8519684)
  yield ("attention", attention, m24, (P("data", None, None), P(None, "model"), P(None, "model"), P(None, "model"),
                                       P("model", None)), P("data", None, None),
         [normal(8, 128, 512)] + [normal(512, 512, scale=0.04) for _ in range(4)], 1048576)
  yield ("moe_gshard", moe, gs.Mesh((8,), ("expert",)),
         (P("expert", None), P("expert", None, None, None), P("expert", None, None), P("expert", None, None)),
         P("expert", None), [normal(2048, 512), mask, normal(8, 512, 1024, scale=0.04), normal(8, 1024, 512, scale=0.03)],
         8388608)
  yield ("conv_spatial", conv, gs.Mesh((8,), ("spatial",)), (P(None, "spatial", None, None), P(), P()),
         P(None, "spatial", None, None), [normal(8, 128, 128, 16), normal(3, 3, 16, 32, scale=0.1),
                                          normal(3, 3, 32, 32, scale=0.1)], 393216)
  yield ("embedding_vocab_sharded", embedding, m24, (P("model", None), P("data", None)), P("data", None, None),
         [normal(32000, 512), rng.integers(0, 32000, size=(64, 128)).astype(np.int32)], 8388608)
  yield ("uneven", uneven, gs.Mesh((4,), ("data",)), (P("data", None), P()), (P(), P()),
         [normal(17, 33), normal(33, 5)], 532)
  yield ("reshape_transpose", reshape_transpose, gs.Mesh((4,), ("data",)), (P("data", None, None), P()), None,
         [normal(16, 32, 64), normal(16, 8)], 65536)
  labels = rng.integers(0, 32000, size=(64,)).astype(np.int32)
  yield ("layernorm_softmax_xent", layernorm_xent, m24, (P("data", "model"), P("data")), P(),
         [normal(64, 32000), labels], 644)
  yield ("softmax_xent", xent, m24, (P("data", "model"), P("data")), P(), [normal(64, 32000), labels], 388)


def main(_):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  gs.split_cpu_devices(8)
  rows = []
  failures = []
  for name, fn, mesh, ins, outs, args, xla in workloads():
    if FLAGS.only and name not in FLAGS.only:
      continue
    f = gs.function(fn, mesh=mesh, in_shardings=ins, out_shardings=outs)
    low = f.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])
    got = tf.nest.flatten(f(*args))
    want = tf.nest.flatten(tf.function(fn)(*[tf.constant(a) for a in args]))
    err = max(float(np.max(np.abs(g.numpy() - w.numpy()) / (1e-4 + 1e-4 * np.abs(w.numpy())))) for g, w in
              zip(got, want))
    r = low.report
    counts = ", ".join(f"{n} {k}" for k, n in sorted(r.counts().items())) or "none"
    ratio = r.bytes_per_device() / xla if xla else math.nan
    ok = err <= 1.0
    if not ok:
      failures.append(name)
    rows.append((name, str(mesh.shape), counts, str(len(r.emitted_ops())), f"{r.bytes_per_device():,}", f"{xla:,}",
                 f"{ratio:.2f}", "yes" if ok else f"NO ({err:.1f}x tol)"))
  head = ("workload", "mesh", "collectives", "ops", "bytes/device", "XLA bytes", "ratio", "matches")
  widths = [max(len(x) for x in col) for col in zip(head, *rows)]
  for row in [head] + rows:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
  if failures:
    raise SystemExit(f"results differ from the unpartitioned program: {failures}")


if __name__ == "__main__":
  app.run(main)
