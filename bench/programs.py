"""Programs several benchmarks run (a module without flags, so that every bench script can import it)."""


def attention(x, wq, wk, wv, wo):
  """Workload 3 of the reference set: self-attention of [b, s, 512] with 8 heads of 64."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  b, s, _ = x.shape
  split = lambda t: tf.reshape(t, [b, s, 8, 64])  # noqa: E731
  q, k, v = split(x @ wq), split(x @ wk), split(x @ wv)
  att = tf.nn.softmax(tf.einsum("bqhd,bkhd->bhqk", q, k) / 8.0, axis=-1)
  o = tf.reshape(tf.einsum("bhqk,bkhd->bqhd", att, v), [b, s, 512])
  return o @ wo
