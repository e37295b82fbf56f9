"""TensorLists keep their elements' layout: loop gradients (TF2's accumulators) and tf.TensorArray stay split."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.compiler.xla.experimental import xla_sharding

from conftest import assert_close, check_partitioned
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))
LAYERS, BATCH, D, H = 3, 8, 16, 32


@tf.custom_gradient
def _layer(x, w1, w2):
  """A residual MLP layer with its own gradient, annotated like GShard code (Megatron hidden over "model")."""
  h = xla_sharding.mesh_split(tf.nn.relu(x @ w1), MESH.device_ids, [0, 1])

  def grad(g):
    dh = tf.matmul(g, w2, transpose_b=True) * tf.cast(h > 0, g.dtype)
    return dh @ tf.transpose(w1), tf.matmul(x, dh, transpose_a=True), tf.matmul(h, g, transpose_a=True)

  return x + h @ w2, grad


def _repeat(x, w1s, w2s):
  """Lingvo's RepeatLayer: a While over the leading layer dim of stacked weights."""
  w1s = xla_sharding.mesh_split(w1s, MESH.device_ids, [-1, -1, 1])
  w2s = xla_sharding.mesh_split(w2s, MESH.device_ids, [-1, 1, -1])

  def body(i, y):
    return i + 1, _layer(y, tf.gather(w1s, i), tf.gather(w2s, i))

  return tf.while_loop(lambda i, y: i < LAYERS, body, [0, x])[1]


def _sgd_step_tape(x, w1s, w2s):
  with tf.GradientTape() as tape:
    tape.watch([w1s, w2s])
    loss = tf.reduce_sum(_repeat(x, w1s, w2s) ** 2)
  g1, g2 = tape.gradient(loss, [w1s, w2s])
  return loss, w1s - 0.01 * g1, w2s - 0.01 * g2


def _sgd_step_colocated(x, w1s, w2s):
  """The same step through tf.gradients with colocate_gradients_with_ops (as Lingvo builds it): the gradient
  loop's nodes carry colocation constraints on forward nodes that Grappler's inlining renames."""
  loss = tf.reduce_sum(_repeat(x, w1s, w2s) ** 2)
  g1, g2 = tf.compat.v1.gradients(loss, [w1s, w2s], colocate_gradients_with_ops=True)
  return loss, w1s - 0.01 * g1, w2s - 0.01 * g2


@pytest.mark.parametrize("step", [_sgd_step_tape, _sgd_step_colocated], ids=["tape", "colocated"])
def test_stacked_weight_loop_trains_without_gathering_the_stack(rng, step):
  low = _two_steps_match(rng, step)
  assert set(low.report.counts()) == {"all-reduce"}   # Megatron's all-reduces only: no gather, forward or backward
  assert low.report.fallbacks == ()
  lists = [k for k in low.shardings if "accumulator" in k and "element_shape" not in k]
  assert any(low.shardings[k].spec in (P(None, "model"), P("model", None)) for k in lists)   # weight slices stay split


def test_tensor_array_loop_keeps_elements_split(rng):
  """tf.TensorArray (reserve, unstack, read, write, stack, gather) inside a loop: elements stay split."""
  def fn(xs, w):
    inp = tf.TensorArray(tf.float32, size=4, element_shape=[8, 8]).unstack(xs)
    out = tf.TensorArray(tf.float32, size=4, element_shape=[8, 8])

    def body(i, h, out):
      h = tf.tanh(h @ w + inp.read(i))
      return i + 1, h, out.write(i, h)

    _, _, out = tf.while_loop(lambda i, *_: i < 4, body, [0, tf.zeros([8, 8]), out])
    return out.stack(), out.gather([1, 3])

  xs = rng.standard_normal((4, 8, 8)).astype(np.float32)
  w = (rng.standard_normal((8, 8)) * 0.3).astype(np.float32)
  low = check_partitioned(fn, [xs, w], (P(None, "data", "model"), P("model", None)), MESH)
  assert low.report.fallbacks == ()
  assert low.out_shardings[0].spec == P(None, "data", "model")
  # the matmul's partial sum, nothing for the lists: one reduce-scatter, run on each of the 4 iterations
  assert low.report.counts(per_iteration=True) == {"reduce-scatter": 1}
  assert low.report.counts() == {"reduce-scatter": 4}


def test_list_op_without_rule_on_split_elements_is_a_typed_error():
  def fn(x):
    handle = tf.raw_ops.TensorListFromTensor(tensor=x, element_shape=[8, 8])
    handle = tf.raw_ops.TensorListResize(input_handle=handle, size=3)
    return tf.raw_ops.TensorListStack(input_handle=handle, element_shape=[8, 8], element_dtype=tf.float32,
                                      num_elements=3)

  f = gs.function(fn, mesh=MESH, in_shardings=P(None, "data", None))
  with pytest.raises(gs.UnsupportedOpError, match=r"TensorList input 0 .* split as P\('data', None\)"):
    f.lower(tf.TensorSpec([2, 8, 8]))


def _scan_repeat(x, w1s, w2s):
  """A layer stack as tf.scan over the stacked weights (TensorLists of weight slices, read one per step)."""
  w1s = xla_sharding.mesh_split(w1s, MESH.device_ids, [-1, -1, 1])
  w2s = xla_sharding.mesh_split(w2s, MESH.device_ids, [-1, 1, -1])

  def step(y, ws):
    h = xla_sharding.mesh_split(tf.nn.relu(y @ ws[0]), MESH.device_ids, [0, 1])
    return y + h @ ws[1]

  return tf.scan(step, (w1s, w2s), initializer=x)[-1]


@tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
def _unshaped(t):
  """A call whose result has unknown rank (as a function traced without shapes leaves it)."""
  return t * 1.0


def _repeat_through_unshaped_call(x, w1s, w2s):
  """The loop body stacks two values through a call of unknown result rank and unstacks them: the gradient loop
  unstacks (Unpack) a gradient of unknown rank."""
  w1s = xla_sharding.mesh_split(w1s, MESH.device_ids, [-1, -1, 1])
  w2s = xla_sharding.mesh_split(w2s, MESH.device_ids, [-1, 1, -1])

  def body(i, y):
    h = xla_sharding.mesh_split(tf.nn.relu(y @ tf.gather(w1s, i)), MESH.device_ids, [0, 1])
    a, b = tf.unstack(_unshaped(tf.stack([h @ tf.gather(w2s, i), y])), num=2)
    return i + 1, a + b

  return tf.while_loop(lambda i, y: i < LAYERS, body, [0, x])[1]


def _sgd(repeat):
  def step(x, w1s, w2s):
    with tf.GradientTape() as tape:
      tape.watch([w1s, w2s])
      loss = tf.reduce_sum(repeat(x, w1s, w2s) ** 2)
    g1, g2 = tape.gradient(loss, [w1s, w2s])
    return loss, w1s - 0.01 * g1, w2s - 0.01 * g2
  return step


def _two_steps_match(rng, step):
  x = rng.standard_normal((BATCH, D)).astype(np.float32)
  w1s = (rng.standard_normal((LAYERS, D, H)) * 0.2).astype(np.float32)
  w2s = (rng.standard_normal((LAYERS, H, D)) * 0.2).astype(np.float32)
  f = gs.function(step, mesh=MESH, in_shardings=(P("data", None), P(None, None, "model"), P(None, "model", None)))
  ref = tf.function(step)
  got, want = (w1s, w2s), (w1s, w2s)
  for _ in range(2):
    loss, *got = f(x, *got)
    want_loss, *want = ref(x, *want)
    assert_close(loss.numpy(), want_loss.numpy(), rtol=1e-5, atol=1e-4)
    for g, w in zip(got, want):
      assert_close(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5)
  return f.lower(tf.TensorSpec([BATCH, D]), tf.TensorSpec([LAYERS, D, H]), tf.TensorSpec([LAYERS, H, D]))


def test_scan_over_stacked_weights_trains_without_gathering_them(rng):
  """tf.scan's gradient loop: weight-slice accumulators (ZerosLike/AddN of TensorLists, TensorListElementShape)
  keep the weights' split; only Megatron's all-reduces."""
  low = _two_steps_match(rng, _sgd(_scan_repeat))
  assert set(low.report.counts()) == {"all-reduce"}
  assert low.report.fallbacks == ()


def test_loop_gradient_unstacking_a_value_of_unknown_rank_takes_the_forward_shape(rng, recwarn):
  """The gradient loop pops what the forward loop stacked through a call of unknown result rank, and unstacks the
  call's gradient (an Unpack of unknown rank in TF's graph): the popped value takes the element shape the forward
  body pushed, the call's gradient the forward value's shape, so nothing runs whole: the two steps match plain TF
  with Megatron's all-reduces only, and no op is reported of unknown rank."""
  low = _two_steps_match(rng, _sgd(_repeat_through_unshaped_call))
  assert not [w for w in recwarn if "unknown rank" in str(w.message)]
  assert not [w for w in low.report.warnings if "unknown rank" in w], low.report.warnings
  assert set(low.report.counts()) == {"all-reduce"}, str(low.report)
