"""The propagation table: for each op family, given annotations, the completed sharding of named tensors."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))
F32, I32 = tf.float32, tf.int32
I = tf.identity
D, M, DM = "data", "model", ("data", "model")


def _grad(f, x):
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = f(x)
  return tape.gradient(y, x)


# (id, function, argument specs [(shape, dtype)], in_shardings, out_shardings, {tensor: expected P})
CASES = [
    ("unary", lambda x: I(tf.tanh(x), name="y"), [((8, 8), F32)], (P(D, M),), None, {"y": P(D, M)}),
    ("binary_broadcast", lambda x, b: I(x * b, name="y"), [((8, 8), F32), ((8,), F32)], (None, P(M)), None,
     {"y": P(None, M)}),
    ("binary_merge", lambda x, y: I(x - y, name="z"), [((8, 8), F32)] * 2, (P(D), P(None, M)), None,
     {"z": P(D, M)}),
    ("select", lambda c, x: I(tf.where(c > 0, x, -x), name="y"), [((8, 8), F32)] * 2, (P(D, M), None), None,
     {"y": P(D, M), "x": P(D, M)}),
    ("add_n", lambda a, b: I(tf.add_n([a, b, a]), name="y"), [((8, 8), F32)] * 2, (P(D), None), None,
     {"y": P(D, None), "b": P(D, None)}),
    ("compare_cast", lambda x: I(tf.cast(x > 0.5, tf.int32), name="y"), [((8, 8), F32)], (P(None, M),), None,
     {"y": P(None, M)}),
    ("backward_elementwise", lambda x: tf.exp(x), [((8, 8), F32)], None, P(M, D), {"x": P(M, D)}),
    ("bias_add", lambda x, b: I(tf.nn.bias_add(x, b), name="y"), [((4, 8), F32), ((8,), F32)], (P(D, M), None),
     None, {"b": P(M)}),
    ("bias_add_grad", lambda x: I(_grad(lambda t: tf.reduce_sum(tf.nn.bias_add(x, t) ** 2), tf.zeros([8])),
                                  name="g"),
     [((4, 8), F32)], (P(D, M),), None, {"g": P(M)}),
    ("matmul", lambda x, w: I(x @ w, name="y"), [((8, 16), F32), ((16, 8), F32)], (P(D), P(None, M)), None,
     {"y": P(D, M)}),
    ("matmul_backward", lambda x, w: x @ w, [((8, 16), F32), ((16, 8), F32)], None, P(D, M),
     {"x": P(D, None), "w": P(None, M)}),
    ("matmul_contracting", lambda x, w: I(x @ w, name="y"), [((8, 16), F32), ((16, 8), F32)], (P(None, M), None),
     None, {"w": P(M, None), "y": P()}),
    ("matmul_transposed", lambda x, w: I(tf.matmul(x, w, transpose_a=True), name="y"),
     [((16, 8), F32), ((16, 4), F32)], (P(None, D), P(None, M)), None, {"y": P(D, M)}),
    ("batch_matmul", lambda a, b: I(a @ b, name="y"), [((4, 8, 16), F32), ((4, 16, 8), F32)],
     (P(D, None, None), P(None, None, M)), None, {"y": P(D, None, M)}),
    ("einsum_attention", lambda q, k: I(tf.einsum("bhqd,bhkd->bhqk", q, k), name="s"),
     [((4, 4, 8, 16), F32)] * 2, (P(D, M), None), None, {"s": P(D, M, None, None), "k": P(D, M, None, None)}),
    ("einsum_projection", lambda x, w: I(tf.einsum("bsd,dhk->bhsk", x, w), name="q"),
     [((4, 8, 16), F32), ((16, 4, 4), F32)], (P(D), P(None, M)), None, {"q": P(D, M, None, None)}),
    ("sum", lambda x: I(tf.reduce_sum(x, 1), name="y"), [((8, 8), F32)], (P(D, M),), None, {"y": P(D)}),
    ("mean_keepdims", lambda x: I(tf.reduce_mean(x, 0, keepdims=True), name="y"), [((8, 8), F32)], (P(D, M),),
     None, {"y": P(None, M)}),
    ("max", lambda x: I(tf.reduce_max(x, [0, 1]), name="y"), [((8, 8), F32)], (P(D, M),), None, {"y": P()}),
    ("min_prod", lambda x: (I(tf.reduce_min(x, 1), name="a"), I(tf.reduce_prod(x, 0), name="b")),
     [((8, 8), F32)], (P(D, M),), None, {"a": P(D), "b": P(M)}),
    ("all_any", lambda x: (I(tf.reduce_all(x > 0, 1), name="a"), I(tf.reduce_any(x > 0, 0), name="b")),
     [((8, 8), F32)], (P(D, M),), None, {"a": P(D), "b": P(M)}),
    ("argmax", lambda x: I(tf.argmax(x, 1), name="y"), [((8, 8), F32)], (P(D, M),), None, {"y": P(D)}),
    ("softmax", lambda x: I(tf.nn.softmax(x), name="y"), [((8, 8), F32)], (P(D, M),), None, {"y": P(D, M)}),
    ("log_softmax_backward", lambda x: tf.nn.log_softmax(x), [((8, 8), F32)], None, P(D), {"x": P(D)}),
    ("sparse_xent", lambda l, y: I(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=l), name="loss"),
     [((8, 16), F32), ((8,), I32)], (P(D, M), None), None, {"loss": P(D), "y": P(D)}),
    ("dense_xent", lambda l, y: I(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=l), name="loss"),
     [((8, 16), F32)] * 2, (P(D), None), None, {"loss": P(D), "y": P(D, None)}),
    ("reshape_split", lambda x: I(tf.reshape(x, [4, 4, 16]), name="y"), [((16, 16), F32)], (P(D, M),), None,
     {"y": P(D, None, M)}),
    ("reshape_merge", lambda x: I(tf.reshape(x, [32, 8]), name="y"), [((4, 8, 8), F32)], (P(D),), None,
     {"y": P(D, None)}),
    ("reshape_backward", lambda x: tf.reshape(x, [8, 2, 8]), [((8, 16), F32)], None, P(D, None, M),
     {"x": P(D, None)}),
    ("transpose", lambda x: I(tf.transpose(x, [2, 0, 1]), name="y"), [((4, 8, 16), F32)], (P(D, None, M),),
     None, {"y": P(M, D, None)}),
    ("expand_squeeze", lambda x: (I(tf.expand_dims(x, 1), name="e"), I(tf.squeeze(tf.expand_dims(x, 0), 0),
                                                                        name="s")),
     [((8, 8), F32)], (P(D, M),), None, {"e": P(D, None, M), "s": P(D, M)}),
    ("broadcast_to", lambda v: I(tf.broadcast_to(v, [8, 16]), name="y"), [((16,), F32)], (P(M),), None,
     {"y": P(None, M)}),
    ("tile", lambda x: I(tf.tile(x, [1, 3]), name="y"), [((8, 8), F32)], (P(D, M),), None, {"y": P(D, None)}),
    ("concat", lambda a, b: I(tf.concat([a, b], 1), name="y"), [((8, 8), F32)] * 2, (P(D, M), None), None,
     {"y": P(D, M), "b": P(D, M)}),   # GSPMD: concat keeps the operands' layout, concat dim included
    ("split", lambda x: I(tf.split(x, 2, axis=1)[1], name="y"), [((8, 8), F32)], (P(D, M),), None,
     {"y": P(D, None)}),
    ("split_v", lambda x: I(tf.split(x, [3, 5], axis=0)[0], name="y"), [((8, 8), F32)], (P(D, M),), None,
     {"y": P(None, M)}),
    ("pack_unpack", lambda a, b: (I(tf.stack([a, b], 1), name="s"), I(tf.unstack(a, axis=1)[0], name="u")),
     [((8, 8), F32)] * 2, (P(D, M), None), None, {"s": P(D, None, M), "u": P(D)}),
    ("slice", lambda x: I(tf.slice(x, [0, 1], [8, 4]), name="y"), [((8, 8), F32)], (P(D, M),), None,
     {"y": P(D, M)}),   # the sliced dim stays split (windows with halos)
    ("strided_slice", lambda x: (I(x[:, 2], name="a"), I(x[1:3], name="b")), [((8, 8), F32)], (P(D, M),), None,
     {"a": P(D), "b": P(D, M)}),
    ("pad", lambda x: I(tf.pad(x, [[0, 0], [1, 1]]), name="y"), [((8, 8), F32)], (P(D, M),), None,
     {"y": P(D, M)}),
    ("gather_ids", lambda t, i: I(tf.gather(t, i), name="y"), [((32, 8), F32), ((4, 6), I32)], (None, P(D)), None,
     {"y": P(D, None, None)}),
    ("gather_table", lambda t, i: I(tf.gather(t, i), name="y"), [((32, 8), F32), ((4, 6), I32)],
     (P(None, M), None), None, {"y": P(None, None, M)}),
    ("segment_sum", lambda d, i: I(tf.math.unsorted_segment_sum(d, i, 5), name="y"), [((8, 8), F32), ((8,), I32)],
     (P(D, M), None), None, {"y": P(None, M), "i": P(D)}),
    ("scatter_nd", lambda i, u: I(tf.scatter_nd(i, u, [10, 8]), name="y"), [((6, 1), I32), ((6, 8), F32)],
     (None, P(D, M)), None, {"y": P(None, M)}),
    ("tensor_scatter", lambda t, i, u: I(tf.tensor_scatter_nd_add(t, i, u), name="y"),
     [((10, 8), F32), ((6, 1), I32), ((6, 8), F32)], (P(None, M), None, None), None, {"y": P(None, M),
                                                                                     "u": P(None, M)}),
    ("one_hot", lambda i: I(tf.one_hot(i, 10), name="y"), [((8, 4), I32)], (P(D, M),), None, {"y": P(D, M, None)}),
    ("conv2d", lambda x, k: I(tf.nn.conv2d(x, k, 1, "SAME"), name="y"), [((8, 6, 6, 4), F32), ((3, 3, 4, 8), F32)],
     (P(D), P(None, None, None, M)), None, {"y": P(D, None, None, M)}),
    ("conv_filter_grad", lambda x, k: I(_grad(lambda t: tf.reduce_sum(tf.nn.conv2d(x, t, 1, "SAME")), k), name="g"),
     [((8, 6, 6, 4), F32), ((3, 3, 4, 8), F32)], (P(D, None, None, M), None), None, {"g": P(None, None, M, None)}),
    ("pools", lambda x: (I(tf.nn.max_pool2d(x, 2, 2, "VALID"), name="m"), I(tf.nn.avg_pool2d(x, 2, 2, "VALID"),
                                                                            name="a")),
     [((8, 6, 6, 4), F32)], (P(D, None, None, M),), None, {"m": P(D, None, None, M), "a": P(D, None, None, M)}),
    ("batch_norm_train", lambda x, s, o: I(tf.compat.v1.nn.fused_batch_norm(x, s, o, is_training=True)[0],
                                           name="y"),
     [((8, 6, 6, 4), F32), ((4,), F32), ((4,), F32)], (P(None, None, None, M), None, None), None,
     {"y": P(None, None, None, M), "s": P(M)}),
    ("top_k_cumsum", lambda x: (I(tf.math.top_k(x, 3).values, name="t"), I(tf.cumsum(x, axis=1), name="c")),
     [((8, 8), F32)], (P(D, M),), None, {"t": P(D), "c": P(D)}),
    ("fill_range", lambda x: (I(tf.cast(tf.range(8), F32) + x[0], name="r"), I(x + tf.fill([8, 8], 2.0), name="f")),
     [((8, 8), F32)], (P(D, M),), None, {"r": P(M), "f": P(D, M)}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_propagation(case):
  _, fn, args, ins, outs, expected = case
  f = gs.function(fn, mesh=MESH, in_shardings=ins, out_shardings=outs)
  low = f.lower(*[tf.TensorSpec(s, d) for s, d in args])
  for name, spec in expected.items():
    got = low.shardings[name]
    want = gs.Sharding.from_spec(MESH, spec, rank=got.rank)
    assert got == want, f"{name}: completed {got}, expected {want}\n{low.explain()}"
  assert low.report.fallbacks == ()


def test_table_covers_enough_cases():
  assert len(CASES) >= 40


def test_variable_layout_flows_from_an_annotated_read():
  v = tf.Variable(np.zeros((8, 16), np.float32))

  def step(x):
    w = gs.shard(v, P(None, M))
    y = tf.identity(x @ w, name="y")
    v.assign_add(tf.ones_like(v) * 0.1)
    return y

  low = gs.function(step, mesh=MESH, in_shardings=P(D)).lower(tf.TensorSpec([4, 8]))
  handle = low.program.variable_names[0]
  assert low.shardings[handle] == gs.Sharding.from_spec(MESH, P(None, M))
  assert low.shardings["y"].spec == P(D, M)


def test_fused_optimizer_update_ties_variable_slots_and_gradient():
  v, m, s = (tf.Variable(np.zeros((8, 16), np.float32)) for _ in range(3))

  def step(x):
    w = gs.shard(v, P(None, M))
    with tf.GradientTape() as tape:
      tape.watch(w)
      loss = tf.reduce_sum(x @ w)
    g = tape.gradient(loss, w)
    tf.raw_ops.ResourceApplyAdam(var=v.handle, m=m.handle, v=s.handle, beta1_power=0.9, beta2_power=0.99, lr=0.1,
                                 beta1=0.9, beta2=0.999, epsilon=1e-7, grad=g)
    return loss

  low = gs.function(step, mesh=MESH, in_shardings=P(D)).lower(tf.TensorSpec([4, 8]))
  assert low.report.fallbacks == ()
  assert [low.shardings[h].spec for h in low.program.variable_names] == [P(None, M)] * 3
