"""Horizontal fusion of the per-device program: like element-wise chains that do not depend on one another run as
one chain over a member dimension. Results are bit-identical to the chains run one by one; chains that depend on
one another, directly or through other ops, are never fused into a cycle."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from conftest import keras_adam_step
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.graph import graph_view
from tf_gspmd.rewriter.backend import horizontal
from tf_gspmd.rewriter import pipeline

RNG = np.random.default_rng(3)
M24 = gs.Mesh((2, 4), ("data", "model"))


def _normal(*shape):
  return RNG.standard_normal(shape).astype(np.float32)


def _graph(fn, args):
  """(GraphDef of `fn` traced on `args`' specs, its input tensor names, its output tensor names)."""
  cf = tf.function(fn, autograph=False).get_concrete_function(
      *[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])
  return cf.graph.as_graph_def(), [t.name for t in cf.inputs], [t.name for t in cf.outputs]


def _run(gd, inputs, outputs, args):
  def body(*xs):
    return tf.graph_util.import_graph_def(gd, input_map=dict(zip(inputs, xs)), return_elements=outputs)
  fn = tf.compat.v1.wrap_function(body, [tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])
  return [t.numpy() for t in fn(*[tf.constant(a) for a in args])]


def _fused(fn, args):
  """(the fused GraphDef or None, the original's op counts, the fused one's) after checking that the fused graph
  is acyclic and computes bit for bit what the original does."""
  gd, inputs, outputs = _graph(fn, args)
  keep = {graph_view.node_of(n) for n in inputs + outputs}
  fused = horizontal.fuse(gd, keep)
  before = collections.Counter(n.op for n in gd.node)
  if fused is None:
    return None, before, before
  graph_view.GraphView(fused).order()   # raises on a cycle
  for got, want in zip(_run(fused, inputs, outputs, args), _run(gd, inputs, outputs, args)):
    np.testing.assert_array_equal(got, want)
  return fused, before, collections.Counter(n.op for n in fused.node)


def _adam(w, g, m, v, lr, decay):
  m = 0.9 * m + 0.1 * g
  v = 0.999 * v + 0.001 * tf.square(g)
  return w - lr * (m / (tf.sqrt(v) + 1e-7) + decay * w), m, v


def test_like_optimizer_chains_run_once_over_the_members():
  shapes = [(8, 4), (8, 4), (8, 4), (4,), (4,)]

  def fn(lr, *flat):
    out = []
    for k in range(len(shapes)):
      w, g, m, v = flat[4 * k:4 * k + 4]
      out.extend(_adam(w, g, m, v, lr, 0.01 * (k + 1)))   # a constant of its own per weight
    return out

  args = [np.float32(0.01)] + [_normal(*s) for s in shapes for _ in range(4)]
  fused, before, after = _fused(fn, args)
  assert fused is not None
  # Two groups (the three (8, 4) chains, the two (4,) ones), each op of the chain once per group.
  assert after["Sqrt"] == 2 and before["Sqrt"] == 5, after
  assert after["Mul"] < before["Mul"] / 2
  assert after["Pack"] == 2 * 4 and after["Unpack"] == 2 * 3, after   # w, g, m, v packed; w, m, v unpacked
  # The per-weight decay constants became one constant per group; the shared learning rate broadcasts.
  lr = [n for n in fused.node if horizontal._elementwise_form(n.op) == "broadcasting" and
        any(i.startswith("lr") for i in n.input)]
  assert len(lr) == 2


def test_operands_of_lower_rank_get_unit_dimensions_after_the_member_dimension():
  def fn(*xs):
    # per member: x [3, 5] times its own scalar, plus its own bias [5], then a ReLU
    return [tf.nn.relu(xs[3 * k] * xs[3 * k + 1] + xs[3 * k + 2]) * 2.0 - 1.0 for k in range(4)]

  args = [a for _ in range(4) for a in (_normal(3, 5), _normal(), _normal(5))]
  fused, _, after = _fused(fn, args)
  assert fused is not None and after["Relu"] == 1 and after["Pack"] == 3
  # the scalar and the bias packed to [4] and [4, 5], then given unit dims: [4, 1, 1] and [4, 1, 5]
  ranked = sorted(tuple(tf.make_ndarray(n.attr["value"].tensor)) for n in fused.node
                  if n.name.endswith("/ranked/shape"))
  assert ranked == [(4, 1, 1), (4, 1, 5)], ranked


def test_chains_that_depend_on_one_another_are_not_fused_together():
  def fn(x, w):
    a = tf.nn.relu(x * 2.0 + 1.0)
    b = tf.nn.relu((a @ w) * 2.0 + 1.0)    # the same chain, on what the first one computed
    return b

  fused, before, after = _fused(fn, [_normal(4, 4), _normal(4, 4)])
  assert fused is None or after["Relu"] == before["Relu"] == 2


def test_a_chain_that_leaves_and_reenters_itself_is_not_fused():
  def fn(x1, x2, w):
    out = []
    for x in (x1, x2):
      c = x * 2.0
      out.append(c + c @ w)   # c -> matmul -> the add of the same chain
    return out

  fused, before, after = _fused(fn, [_normal(4, 4), _normal(4, 4), _normal(4, 4)])
  assert fused is None or after["AddV2"] == before["AddV2"]


def test_a_chain_that_starts_first_but_reads_a_later_one_is_not_fused_with_it():
  # p's first op precedes q's in the graph, but p's second op reads q's result (through a matmul).
  def fn(x, y, z, w):
    p1 = x * 2.0
    q = ((y * 2.0) + z) * 3.0 - 1.0
    return ((p1 + q @ w) * 3.0) - 1.0, q

  fused, before, after = _fused(fn, [_normal(4, 4), _normal(4, 4), _normal(4, 4), _normal(4, 4)])
  assert fused is None or after["Mul"] == before["Mul"]


def test_crossing_dependencies_between_two_groups_keep_the_graph_acyclic():
  # Group A: a1, a2 (((x * 3 + 1) * 2) - 1), group B: b1, b2 (((tanh(x) * 5) + 2) * 0.5); a1 -> b2 and b1 -> a2
  # through matmuls: each group is independent on its own, fusing both would close a cycle.
  a = lambda x: ((x * 3.0 + 1.0) * 2.0) - 1.0
  b = lambda x: ((tf.tanh(x) * 5.0) + 2.0) * 0.5

  def fn(x, y, w):
    a1, b1 = a(x), b(y)
    return a1, b1, b(a1 @ w), a(b1 @ w)

  fused, _, after = _fused(fn, [_normal(4, 4), _normal(4, 4), _normal(4, 4)])
  assert fused is not None and after["Unpack"] == 1, after   # one group fused; _fused checked the graph is acyclic


def test_reshapes_that_keep_the_shape_are_removed():
  def fn(x, y):
    return tf.reshape(x, [4, 6]) @ tf.reshape(y, [6, 2])

  fused, before, after = _fused(fn, [_normal(4, 6), _normal(3, 4)])
  assert fused is not None and before["Reshape"] == 2 and after["Reshape"] == 1


def _train_step(x, y, *params):
  """A 3-layer MLP trained with a hand-written Adam (weights, moments in, updated ones out)."""
  n = len(params) // 3
  ws, ms, vs = params[:n], params[n:2 * n], params[2 * n:]
  with tf.GradientTape() as tape:
    tape.watch(ws)
    h = x
    for w in ws:
      h = tf.nn.gelu(h @ w)
    loss = tf.reduce_mean(tf.square(h - y))
  grads = tape.gradient(loss, ws)
  out = [_adam(w, g, m, v, 1e-2, 1e-4) for w, g, m, v in zip(ws, grads, ms, vs)]
  return [loss] + [o[0] for o in out] + [o[1] for o in out] + [o[2] for o in out]


def test_a_partitioned_training_step_fuses_its_optimizer_and_matches_unpartitioned(monkeypatch):
  ws = [_normal(32, 32) * 0.2 for _ in range(3)]
  args = [_normal(16, 32), _normal(16, 32)] + ws + [np.zeros_like(w) for w in ws] * 2
  ins = (P("data", None), P("data", None)) + (P(None, "model"),) * 9
  specs = [tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args]
  want = [np.asarray(t) for t in tf.function(_train_step)(*[tf.constant(a) for a in args])]
  for exchange in ("auto", "collectives"):
    f = gs.function(_train_step, mesh=M24, in_shardings=ins, exchange=exchange)
    for got, w in zip(f(*args), want):
      np.testing.assert_allclose(got.numpy(), w, rtol=1e-4, atol=1e-4)   # Adam divides by small moments
  lowered = lambda exchange: gs.function(_train_step, mesh=M24, in_shardings=ins, exchange=exchange).lower(
      *specs).program.local_graph_def
  count = lambda gd, op: sum(n.op == op for n in gd.node)
  fused = lowered("collectives")
  # The one in-process graph stacks each op over the devices instead: its per-device program is not fused.
  in_process = lowered("auto")
  monkeypatch.setattr(pipeline, "PASSES", tuple(p for p in pipeline.PASSES if p[0] != "fuse"))
  plain = lowered("collectives")
  assert count(plain, "Sqrt") == count(in_process, "Sqrt") == 3 and count(fused, "Sqrt") == 1
  assert len(fused.node) < len(plain.node)


def test_an_optimizers_updates_of_captured_variables_fuse(monkeypatch):
  """Reads of variables have no static shape where TF imports the program; the pass gives them their shards'."""
  keras = pytest.importorskip("keras")
  x, y = _normal(8, 16), _normal(8, 16)
  step, model, _ = keras_adam_step(keras, 4)
  ref_step, ref, _ = keras_adam_step(keras, 4)
  f = gs.function(step, mesh=M24, in_shardings=(P("data", None),) * 2, exchange="collectives")
  specs = [tf.TensorSpec([8, 16])] * 2
  count = lambda gd, op: sum(n.op == op for n in gd.node)
  fused = f.lower(*specs).program.local_graph_def
  ref_step = tf.function(ref_step)
  for _ in range(3):
    np.testing.assert_allclose(f(x, y).numpy(), ref_step(x, y).numpy(), rtol=1e-5)
  for got, want in zip(model.get_weights(), ref.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  monkeypatch.setattr(pipeline, "PASSES", tuple(p for p in pipeline.PASSES if p[0] != "fuse"))
  plain = gs.function(step, mesh=M24, in_shardings=(P("data", None),) * 2, exchange="collectives").lower(
      *specs).program.local_graph_def
  # Per variable a square root of its second moment: the 8 of the moments run as 2 (the kernels', the biases'). The
  # scalar corrections, one per variable, read one step counter (cleanup.merge_reads): 2 remain, fused or not.
  assert count(plain, "Sqrt") == 10 and count(fused, "Sqrt") == 4


def test_differing_constants_become_one_constant_only_while_small():
  consts = [RNG.standard_normal((40, 400)).astype(np.float32) for _ in range(3)]   # 62.5 KiB each

  def fn(*xs):
    return [((x * c) + 1.0) * 2.0 - 3.0 for x, c in zip(xs, consts)]

  fused, _, after = _fused(fn, [_normal(40, 400) for _ in range(3)])
  assert fused is not None and after["Mul"] == 2
  sizes = [len(n.attr["value"].tensor.tensor_content) for n in fused.node if n.op == "Const"]
  assert max(sizes) <= horizontal.CONST_LIMIT and after["Pack"] == 2   # the xs, and the three constants
