"""Graph plumbing: IdentityN passes several independent values through, each in its own layout; a splat constant
is filled per device, a constant of literal values stays whole."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import check_partitioned
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.ops import basic

MESH = gs.Mesh((2, 4), ("data", "model"))


def test_identity_n_keeps_every_value_split_on_the_same_axes(rng):
  """Independent values may share mesh axes (a custom gradient's IdentityN over all gradients)."""
  a = rng.standard_normal((8, 12)).astype(np.float32)
  b = rng.standard_normal((12, 16)).astype(np.float32)
  c = rng.standard_normal((16, 8)).astype(np.float32)

  def fn(x, y, z):
    return tf.raw_ops.IdentityN(input=[x * 2.0, y + 1.0, z])

  specs = (P(None, "model"), P("model", None), P("data", "model"))
  low = check_partitioned(fn, [a, b, c], specs, MESH, out=specs)
  assert low.report.counts() == {}   # nothing moves: every value stays where it is
  for k, spec in enumerate(specs):
    assert low.shardings["IdentityN" if k == 0 else f"IdentityN:{k}"].spec == spec


def test_custom_gradient_with_split_operands_moves_nothing(rng):
  """tf.custom_gradient wraps its inputs and results in IdentityN ops: every split operand stays split."""
  @tf.custom_gradient
  def pair(a, b, c, d):
    return (a * b, c * d), lambda g1, g2: (g1 * b, g1 * a, g2 * d, g2 * c)

  def fn(a, b, c, d):
    with tf.GradientTape() as tape:
      tape.watch([a, b, c, d])
      y1, y2 = pair(a, b, c, d)
      prod = y1 * y2   # (a non-scalar target: its gradient starts from ones, no reduction over split dims)
    return (prod,) + tuple(tape.gradient(prod, [a, b, c, d]))

  args = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(4)]
  low = check_partitioned(fn, args, (P("data", "model"),) * 4, MESH)
  assert low.report.counts() == {}   # forward and backward: every operand stays where it is


# ---- constants: a splat (every element one value) is filled per device, literal data stays whole ------------------

M8 = gs.Mesh((8,), ("d",))


def _program_ops(low):
  """(op type, name, static shape of output 0) of the per-device program's ops."""
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(low.graph_def, name="")
  return [(op.type, op.name, tuple(op.outputs[0].shape.as_list()) if op.outputs else None)
          for op in graph.get_operations()]


def _shard_of(ops, name, shape):
  """Whether node `name` of the program is a Fill of `shape` or the constant TF's optimizer folds a small Fill into
  (at most 64 KiB), of that shape."""
  return ("Fill", name, shape) in ops or ("Const", name, shape) in ops


@pytest.mark.parametrize("dtype,value", [(np.float32, 0.5), (np.int32, 7), (np.bool_, True)], ids=str)
def test_a_split_splat_constant_is_a_fill_of_the_shard(rng, dtype, value):
  """x + const([64, 4096] of one value) with x split 8 ways: each device fills its own [8, 4096], no device holds
  the [64, 4096] constant."""
  x = (rng.standard_normal((64, 4096)) > 0) if dtype is np.bool_ else rng.standard_normal((64, 4096)).astype(dtype)

  def fn(x):
    c = tf.constant(np.full((64, 4096), value, dtype))
    return tf.logical_and(x, c) if dtype is np.bool_ else x + c

  low = check_partitioned(fn, [x], (P(("data", "model"), None),), MESH, out=P(("data", "model"), None))
  ops = _program_ops(low)
  assert _shard_of(ops, "Const", (8, 4096))
  assert max(int(np.prod(shape)) for op, _, shape in ops if op == "Const") <= 8 * 4096
  assert low.report.constants.bytes <= 8 * 4096 * x.dtype.itemsize + 64
  assert low.report.counts() == {}


def test_an_unevenly_split_splat_constant_fills_its_padded_shard(rng):
  """61 rows over 8 devices: shards of 8 rows, the last holds 5 and padding; the results still match."""
  x = rng.standard_normal((61, 300)).astype(np.float32)
  fn = lambda x: x * tf.constant(np.full((61, 300), -2.0, np.float32))   # noqa: E731
  low = check_partitioned(fn, [x], (P("d", None),), M8, out=P("d", None))
  assert _shard_of(_program_ops(low), "Const", (8, 300))


def test_a_compactly_stored_splat_constant_is_filled_too(rng):
  """tf.constant(v, shape=...) stores one value for all elements in the proto (as Grappler's folded splats are)."""
  x = rng.standard_normal((16, 2048)).astype(np.float32)
  fn = lambda x: x - tf.constant(3.0, shape=[16, 2048])   # noqa: E731
  low = check_partitioned(fn, [x], (P(None, "model"),), MESH, out=P(None, "model"))
  assert _shard_of(_program_ops(low), "Const", (16, 512))


def test_a_large_replicated_splat_constant_is_a_fill_and_a_small_one_stays_a_constant(rng):
  x = rng.standard_normal((64, 4096)).astype(np.float32)
  fn = lambda x: (x + tf.constant(np.full((64, 4096), 1.5, np.float32)),   # noqa: E731
                  x[:4, :4] * tf.constant(np.full((4, 4), 2.0, np.float32)))
  low = check_partitioned(fn, [x], (P(),), MESH)
  ops = _program_ops(low)
  assert ("Fill", "Const", (64, 4096)) in ops and ("Const", "Const_1", (4, 4)) in ops
  assert low.report.constants.bytes < 1024


def test_a_constant_of_literal_values_stays_whole_and_is_sliced_locally(rng):
  x = rng.standard_normal((64, 512)).astype(np.float32)
  table = rng.standard_normal((64, 512)).astype(np.float32)
  low = check_partitioned(lambda x: x + tf.constant(table), [x], (P("d", None),), M8, out=P("d", None))
  assert ("Const", "Const", (64, 512)) in _program_ops(low)
  assert low.report.counts() == {}   # sliced where it is, nothing moves


@pytest.mark.parametrize("value", [np.full((3, 5), 0.25, np.float32), np.zeros((2, 9), np.float64),
                                   np.full((4,), np.nan, np.float32), np.full((2, 2), 1 + 2j, np.complex64),
                                   np.full((6,), 3, np.int64), np.full((5,), 1.5, np.float16),
                                   np.full((7,), 9, np.uint8)], ids=lambda v: f"{v.dtype}{list(v.shape)}")
def test_splat_value_reads_either_storage_of_a_splat(value):
  stored = tf.make_tensor_proto(value)                                   # tensor_content: every element's bytes
  compact = tf.make_tensor_proto(value.flat[0], value.dtype, value.shape)   # one value for all elements
  for proto in (stored, compact):
    got = basic.splat_value(proto)
    assert got is not None and got.dtype == value.dtype
    assert np.array_equal(got, value.flat[0], equal_nan=value.dtype.kind == "f")


@pytest.mark.parametrize("value", [np.arange(6, dtype=np.float32), np.array([0.0, -0.0], np.float32),
                                   np.array([1, 1, 1, 2], np.int32), np.array([5.0], np.float32),
                                   np.array(["a", "a"], object)], ids=str)
def test_splat_value_is_none_for_anything_else(value):
  assert basic.splat_value(tf.make_tensor_proto(value)) is None


def test_splat_value_of_a_proto_with_no_values_is_zero():
  proto = tf.make_tensor_proto(np.zeros((3, 4), np.float32))
  proto.ClearField("tensor_content")   # TF reads a proto without values as zeros
  assert basic.splat_value(proto) == 0.0
