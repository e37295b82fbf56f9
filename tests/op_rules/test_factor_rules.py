"""Rule unit tests: forward and backward candidates of the factor rules, without running anything."""

import tensorflow as tf

from conftest import first_node, ir_of
import tf_gspmd as gs
from tf_gspmd import P, ops
from tf_gspmd.ops.factors import broadcast_labels, identity_value

MESH = gs.Mesh((2, 4), ("data", "model"))


def S(*spec):
  return gs.Sharding.from_spec(MESH, P(*spec))


def specs(cands):
  return [c.spec for c in cands]


def test_broadcast_labels():
  ins, out = broadcast_labels((4, 8, 16), [(4, 8, 16), (16,), (4, 1, 16)])
  assert out == ("d0", "d1", "d2")
  assert ins == (("d0", "d1", "d2"), ("d2",), ("d0", None, "d2"))


def test_elementwise_forward_backward():
  ir = ir_of(lambda a, b: a + b, (4, 8), (8,))
  node = first_node(ir, "AddV2")
  rule = ops.lookup("AddV2")
  assert specs(rule.forward(None, node, [S("data", "model"), None])[0]) == [P("data", "model")]
  assert specs(rule.forward(None, node, [None, S("model")])[0]) == [P(None, "model")]
  back = rule.backward(None, node, [S("data", "model")], [None, None])
  assert specs(back[0]) == [P("data", "model")] and specs(back[1]) == [P("model")]


def test_matmul_rules():
  ir = ir_of(lambda a, b: tf.matmul(a, b, transpose_b=True), (8, 16), (4, 16))
  node = first_node(ir, "MatMul")
  rule = ops.lookup("MatMul")
  fwd = rule.forward(None, node, [S("data", "model"), S(None, "model")])[0]
  assert specs(fwd) == [P("data", None), P(None, None)]    # contracting dim never reaches the output
  back = rule.backward(None, node, [S("data", "model")], [None, S(None, "data")])
  assert specs(back[0]) == [P("data", None), P(None, "data")]   # from output; contracting dim from rhs
  assert specs(back[1]) == [P("model", None)]


def test_reduce_rules():
  ir = ir_of(lambda a: tf.reduce_max(a, axis=[0, 2], keepdims=True), (4, 8, 6))
  node = first_node(ir, "Max")
  rule = ops.lookup("Max")
  assert rule.data_inputs(node) == [0]
  f = rule.factors(node)
  assert f.reduced == ["r0", "r2"] and f.reduce_op == "Max"
  fwd = rule.forward(None, node, [gs.Sharding.from_spec(MESH, P("data", "model", None)), None])[0]
  assert specs(fwd) == [P(None, "model", None)]


def test_identity_values():
  assert identity_value("Add", tf.float32) == 0
  assert identity_value("Max", tf.float32) == float("-inf")
  assert identity_value("Min", tf.int32) == 2**31 - 1
  assert identity_value("Mul", tf.float64) == 1


def test_bias_add_nchw_factor():
  ir = ir_of(lambda x, b: tf.nn.bias_add(x, b, data_format="NCHW"), (2, 8, 3, 3), (8,))
  node = first_node(ir, "BiasAdd")
  f = ops.lookup("BiasAdd").factors(node)
  assert f.operands[1] == ("d1",)


def test_weight_gradient_keeps_the_batch_split_when_the_output_split_would_gather_it(rng):
  """The paper's 2-D layout ((M,H) weights over both axes, activations B over the first and M over the second):
  the gradient of the second weight, einsum bsh,bsm->hm with h and dy split over the batch, is computed with the
  batch split (partial sums over `data`, then a reduce-scatter of the small [H,M] result) rather than split as
  its output wants (which gathers both activations to the full batch). The partitioned gradients equal the
  unpartitioned ones."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from conftest import assert_close, assert_report_counts_program  # pylint: disable=g-import-not-at-top
  act = P("data", None, "model")

  def step(x, w1, w2):
    with tf.GradientTape() as tape:
      tape.watch([w1, w2])
      h = gs.shard(tf.nn.relu(tf.einsum("bsm,mh->bsh", x, w1)), act)
      y = gs.shard(tf.einsum("bsh,hm->bsm", h, w2), act)
      loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, [w1, w2])

  f = gs.function(step, mesh=MESH, in_shardings=(act, P("data", "model"), P("model", "data")),
                  out_shardings=(P("data", "model"), P("model", "data")))
  shapes = ([16, 32, 64], [64, 128], [128, 64])
  low = f.lower(*[tf.TensorSpec(s) for s in shapes])
  assert_report_counts_program(low)
  assert not low.report.rematerializations, str(low.report)
  full_batch = [c for c in low.report.collectives if c.kind == "all-gather" and c.shape[0] == 16]
  assert not full_batch, str(low.report)
  dw2 = [c for c in low.report.collectives if c.source == "gradient_tape/einsum_1/Einsum_1"]
  assert [c.kind for c in dw2] == ["reduce-scatter"] and dw2[0].shape == (32, 64), str(low.report)
  args = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in shapes]
  for got, want in zip(f(*args), step(*[tf.constant(a) for a in args])):
    assert_close(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
