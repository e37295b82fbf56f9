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
