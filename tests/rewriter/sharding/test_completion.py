"""Completion: propagation through each op family, merging, pinned annotations, determinism."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.compiler.xla.experimental import xla_sharding
from hypothesis import given, settings, strategies as st

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.rewriter.sharding.completion import merge

MESH = gs.Mesh((2, 4), ("data", "model"))


def complete(fn, *shapes, in_shardings=None, out_shardings=None):
  f = gs.function(fn, mesh=MESH, in_shardings=in_shardings, out_shardings=out_shardings)
  return f.lower(*[tf.TensorSpec(s) for s in shapes]).shardings


def spec(shardings, name):
  return shardings[name].spec


def test_forward_through_elementwise_chain():
  s = complete(lambda x: tf.identity(tf.tanh(tf.exp(x) * 2.0), name="out"), (8, 8), in_shardings=P("data", "model"))
  assert spec(s, "out") == P("data", "model")


def test_backward_from_output_to_unannotated_input():
  s = complete(lambda x: tf.exp(x), (8, 8), out_shardings=P(None, "model"))
  assert spec(s, "x") == P(None, "model")


def test_merge_of_compatible_partial_shardings():
  def f(a, b):
    return tf.identity(a * b, name="prod")

  s = complete(f, (8, 8), (8, 8), in_shardings=(P("data", None), P(None, "model")))
  assert spec(s, "prod") == P("data", "model")


def test_broadcast_operand_gets_only_its_dims():
  def f(x, b):
    return tf.identity(x + b, name="sum")

  s = complete(f, (8, 8), (8,), in_shardings=(P("data", "model"), None))
  assert spec(s, "b") == P("model")


def test_matmul_forward_and_backward():
  s = complete(lambda x, w: tf.identity(x @ w, name="y"), (8, 16), (16, 8), in_shardings=(P("data", None),
                                                                                           P(None, "model")))
  assert spec(s, "y") == P("data", "model")
  s = complete(lambda x, w: x @ w, (8, 16), (16, 8), out_shardings=P("data", "model"))
  assert spec(s, "x") == P("data", None) and spec(s, "w") == P(None, "model")


def test_matmul_contracting_dim_from_other_operand():
  s = complete(lambda x, w: x @ w, (8, 16), (16, 8), in_shardings=(P(None, "model"), None))
  assert spec(s, "w") == P("model", None)


def test_transposed_matmul():
  s = complete(lambda x, w: tf.identity(tf.matmul(x, w, transpose_a=True, transpose_b=True), name="y"),
               (16, 8), (4, 16), in_shardings=(P(None, "data"), P("model", None)))
  assert spec(s, "y") == P("data", "model")


def test_batch_matmul_with_broadcast_batch():
  s = complete(lambda a, b: tf.identity(tf.linalg.matmul(a, b), name="y"), (4, 8, 16), (16, 8),
               in_shardings=(P("data", "model", None), P()))
  assert spec(s, "y") == P("data", "model", None)


@pytest.mark.parametrize("op", [tf.reduce_sum, tf.reduce_mean, tf.reduce_max, tf.reduce_min, tf.reduce_prod])
def test_reduction_drops_reduced_dim(op):
  s = complete(lambda x: tf.identity(op(x, axis=1), name="r"), (8, 8), in_shardings=P("data", "model"))
  assert spec(s, "r") == P("data")
  s = complete(lambda x: tf.identity(op(x, axis=0, keepdims=True), name="r"), (8, 8), in_shardings=P("data", "model"))
  assert spec(s, "r") == P(None, "model")


def test_bias_add_nhwc_and_nchw():
  s = complete(lambda x, b: tf.identity(tf.nn.bias_add(x, b), name="y"), (2, 3, 3, 8), (8,),
               in_shardings=(P(None, None, None, "model"), None))
  assert spec(s, "b") == P("model")
  s = complete(lambda x, b: tf.identity(tf.nn.bias_add(x, b, data_format="NCHW"), name="y"), (2, 8, 3, 3), (8,),
               in_shardings=(None, P("model")))
  assert spec(s, "y") == P(None, "model", None, None)


def test_cast_and_select():
  def f(x, y):
    c = tf.cast(x, tf.float64)
    return tf.identity(tf.where(c > 0.0, c, tf.cast(y, tf.float64)), name="sel")

  s = complete(f, (8, 8), (8, 8), in_shardings=(P("data", None), None))
  assert spec(s, "sel") == P("data", None) and spec(s, "y") == P("data", None)


def test_annotation_is_pinned_and_conflict_left_for_partitioner():
  def f(x):
    h = gs.shard(tf.exp(x), P(None, "model"))
    return tf.identity(h * 2.0, name="out")

  f_ = gs.function(f, mesh=MESH, in_shardings=P("data", None))
  low = f_.lower(tf.TensorSpec([8, 8]))
  assert spec(low.shardings, "x") == P("data", None)
  assert spec(low.shardings, "out") == P(None, "model")
  assert low.report.counts() == {"all-gather": 1}


def _open_tf(t, dims_mapping, open_dims):
  return xla_sharding.mesh_split(t, MESH.device_ids, dims_mapping, use_sharding_op=True, unspecified_dims=open_dims)


# The same annotation both ways: rows pinned to "data", columns left to completion.
OPEN_ROWS = {
    "gs.shard": lambda t: gs.shard(t, P("data", P.UNCONSTRAINED)),
    "xla_sharding": lambda t: _open_tf(t, [0, -1], [1]),
}


@pytest.mark.parametrize("spelling", sorted(OPEN_ROWS))
def test_open_dim_takes_its_split_from_propagation(spelling):
  def f(x, w):
    h = tf.identity(OPEN_ROWS[spelling](tf.tanh(x)), name="h")
    return tf.identity(h @ w, name="y")

  f_ = gs.function(f, mesh=MESH, in_shardings=(None, P("model", None)))
  low = f_.lower(tf.TensorSpec([8, 16]), tf.TensorSpec([16, 4]))
  assert spec(low.shardings, "h") == P("data", "model")     # columns from the matmul's contracting dim
  assert spec(low.shardings, "x") == P("data", "model")
  assert "leaves open" in low.explain()


@pytest.mark.parametrize("spelling", sorted(OPEN_ROWS))
def test_pinned_dims_of_an_open_annotation_never_change(spelling):
  def f(x):
    return tf.identity(OPEN_ROWS[spelling](tf.exp(x)) * 2.0, name="out")

  # The argument proposes rows over "model": the pinned rows stay "data"; the open columns cannot be split by
  # "data" (a pinned dim uses it) and take nothing else.
  low = gs.function(f, mesh=MESH, in_shardings=P("model", "data")).lower(tf.TensorSpec([8, 8]))
  assert spec(low.shardings, "out") == P("data", None)
  # Columns over "model" are free to take.
  low = gs.function(f, mesh=MESH, in_shardings=P(None, "model")).lower(tf.TensorSpec([8, 8]))
  assert spec(low.shardings, "out") == P("data", "model")


def test_open_dims_in_in_and_out_shardings():
  def f(x, w):
    return tf.identity(x @ w, name="y")

  s = complete(f, (8, 16), (16, 4), in_shardings=(P(P.UNCONSTRAINED, None), P("model", None)),
               out_shardings=P(P.UNCONSTRAINED, P.UNCONSTRAINED))
  assert spec(s, "x") == P(None, None) and spec(s, "y") == P(None, None)   # x's contracting dim is pinned whole
  s = complete(f, (8, 16), (16, 4), in_shardings=(P(P.UNCONSTRAINED, None), P(None, "model")),
               out_shardings=P("data", P.UNCONSTRAINED))
  assert spec(s, "x") == P("data", None) and spec(s, "y") == P("data", "model")
  s = complete(f, (8, 16), (16, 4), in_shardings=(P(P.UNCONSTRAINED, "model"), None), out_shardings=P("data", None))
  assert spec(s, "x") == P("data", "model") and spec(s, "w") == P("model", None)


def test_unreached_tensors_are_replicated():
  s = complete(lambda x: tf.identity(x + 1.0, name="y"), (4, 4))
  assert s["y"].is_replicated and s["x"].is_replicated


def test_merge_function():
  a, b = Sharding.from_spec(MESH, P("data", None)), Sharding.from_spec(MESH, P(None, "model"))
  assert merge(a, b).spec == P("data", "model")
  assert merge(None, a) == a and merge(a, None) == a
  c = Sharding.from_spec(MESH, P("model", None))
  assert merge(a, c) == c          # incompatible: strictly more tiles wins
  assert merge(c, a) == c          # never less specific
  d = Sharding.from_spec(MESH, P(None, "data"))
  assert merge(a, d) == a          # same tile count: keep what is there (no needless reshard)


_OPS = [tf.exp, tf.tanh, lambda t: t * 2.0, lambda t: tf.reduce_sum(t, axis=0, keepdims=True) + t]
_SPECS = [None, P("data", None), P(None, "model"), P("model", "data"), P()]


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.integers(0, len(_OPS) - 1), min_size=1, max_size=5),
       ann=st.lists(st.integers(0, len(_SPECS) - 1), min_size=6, max_size=6))
def test_completion_is_deterministic_and_never_overwrites_annotations(ops, ann):
  def fn(x, w):
    h = x
    for k, op in enumerate(ops):
      h = _OPS[op](h)
      if _SPECS[ann[k]] is not None:
        h = gs.shard(h, _SPECS[ann[k]], name=f"ann{k}")
    return h @ w

  f = gs.function(fn, mesh=MESH, in_shardings=(_SPECS[ann[-1]], None))
  first = f.lower(tf.TensorSpec([8, 8]), tf.TensorSpec([8, 4])).shardings
  g = gs.function(fn, mesh=MESH, in_shardings=(_SPECS[ann[-1]], None))
  second = g.lower(tf.TensorSpec([8, 8]), tf.TensorSpec([8, 4])).shardings
  assert first == second
  for k in range(len(ops)):
    if _SPECS[ann[k]] is not None:
      assert first[f"ann{k}"] == Sharding.from_spec(MESH, _SPECS[ann[k]], rank=2)


@pytest.mark.parametrize("x_shape,w_shape,want", [
    ((8, 16), (16, 64), P(None, "model")),    # w is larger: the result follows w
    ((64, 16), (16, 8), P("model", None)),    # x is larger: the result follows x
    ((16, 16), (16, 16), P("model", None)),   # equal sizes: the first operand
], ids=str)
@pytest.mark.parametrize("op", ["matmul", "einsum"])
def test_dot_of_operands_split_differently_follows_the_larger_one(rng, x_shape, w_shape, want, op):
  """XLA's sharding propagation for a dot whose operands are split in ways that do not combine (both split over
  "model", on different result dims): the result takes the layout of the operand with more elements."""
  dot = (lambda x, w: tf.matmul(x, w)) if op == "matmul" else (lambda x, w: tf.einsum("mk,kn->mn", x, w))
  fn = lambda x, w: tf.identity(dot(x, w), name="y")
  specs = (P("model", None), P(None, "model"))
  s = complete(fn, x_shape, w_shape, in_shardings=specs)
  assert spec(s, "y") == want
  x = rng.standard_normal(x_shape).astype(np.float32)
  w = rng.standard_normal(w_shape).astype(np.float32)
  got = gs.function(fn, mesh=MESH, in_shardings=specs)(x, w)
  np.testing.assert_allclose(got.numpy(), fn(x, w).numpy(), rtol=1e-5, atol=1e-5)
