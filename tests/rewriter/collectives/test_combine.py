"""The combine pass: independent collectives become one collective; dependent ones stay apart.

Every partitioned result is compared with the unpartitioned program's on the same inputs.
"""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close, assert_report_counts_program
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.collectives import combine
from tf_gspmd.rewriter.graph.graph_view import GraphView
from tf_gspmd.rewriter.report import Combination

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

MESH = gs.Mesh((2, 4), ("data", "model"))


def _emitted(low, op_type="CollectiveReduceV2"):
  return sum(1 for n in low.graph_def.node if n.op == op_type)


def _run_and_compare(f, args, specs, out, rtol=1e-5):
  """The lowering of `f` partitioned; its results on `args` equal the unpartitioned program's."""
  g = gs.function(f, mesh=MESH, in_shardings=specs, out_shardings=out)
  want = tf.nest.flatten(f(*[tf.constant(a) for a in args]))
  got = tf.nest.flatten(g(*args))
  assert len(got) == len(want)
  for a, b in zip(got, want):
    assert_close(a.numpy(), b.numpy(), rtol=rtol, atol=rtol)
  low = g.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])
  GraphView(low.graph_def).order()   # acyclic
  assert_report_counts_program(low)
  return low


def test_independent_all_reduces_are_combined_and_results_match(rng):
  def f(x, w1, w2, w3):
    # Three contractions over the split dim: three independent partial sums.
    return x @ w1, x @ w2, tf.reduce_sum(x @ w3, axis=1)

  args = [rng.standard_normal((8, 16)).astype(np.float32)] + [
      rng.standard_normal((16, n)).astype(np.float32) for n in (4, 6, 5)]
  low = _run_and_compare(f, args, (P(None, "model"), P("model", None), P("model", None), P("model", None)), P())
  assert low.report.counts() == {"all-reduce": 3}      # the logical collectives stay reported one by one
  assert _emitted(low) == 1
  assert low.report.combined == (Combination("all-reduce", 3, 4 * 8 * (4 + 6 + 5), ("all-reduce",)),)
  assert "3 independent all-reduces combined into 1" in str(low.report)


def test_a_combined_collective_shares_the_per_device_tables(rng):
  """Two independent all-reduces over `model` are combined; a third depends on them and stays alone: the combined
  op reads the same group-key table the third one does, so each per-device table is held once."""
  def f(x, w1, w2):
    a, b = x @ w1, x @ w2
    return tf.reduce_sum(x * (tf.reduce_sum(a) + tf.reduce_sum(b)), axis=1)

  args = [rng.standard_normal((8, 16)).astype(np.float32)] + [
      rng.standard_normal((16, n)).astype(np.float32) for n in (4, 6)]
  specs = (P(None, "model"), P("model", None), P("model", None))
  assert _emitted(_run_and_compare(f, args, specs, P())) == 2
  # Planned for 16 devices (no devices: TF's optimizer, which would merge equal constants, does not run).
  big = gs.Mesh((4, 4), ("data", "model"))
  low = gs.function(f, mesh=big, in_shardings=specs).lower(*[tf.TensorSpec(a.shape) for a in args])
  assert _emitted(low) == 2
  tables = [tf.make_ndarray(n.attr["value"].tensor).tobytes() for n in low.graph_def.node
            if n.op == "Const" and [d.size for d in n.attr["value"].tensor.tensor_shape.dim][:1] == [big.size]]
  assert tables and len(tables) == len(set(tables))


def test_dependent_all_reduces_stay_separate(rng):
  def f(x, w1, w2):
    h = x @ w1                      # all-reduce 1
    return tf.tanh(h) @ w2          # needs all-reduce 1's result, then all-reduce 2

  args = [rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 16)).astype(np.float32),
          rng.standard_normal((16, 4)).astype(np.float32)]
  low = _run_and_compare(f, args, (P(None, "model"), P("model", None), P("model", None)), P())
  assert low.report.combined == () and _emitted(low) == low.report.counts()["all-reduce"]
  assert len(low.report.emitted_ops()) == len(low.report.collectives) == 2


def test_zero_style_weight_gathers_are_combined(rng):
  """Weights stored split over "data" (ZeRO-style), gathered whole for use by the data-parallel x: independent
  all-gathers of one dtype over the same axis, gathered in one op; each weight comes out whole and exact."""
  def f(x, w1, w2, w3, w4):
    return x @ w1, x @ w2, tf.nn.relu(x @ w3), x @ w4

  args = [rng.standard_normal((64, 16)).astype(np.float32)] + [
      rng.standard_normal((16, n)).astype(np.float32) for n in (8, 4, 6, 2)]
  low = _run_and_compare(f, args, (P("data", None),) * 5, P("data", None))
  assert low.report.counts() == {"all-gather": 4}
  assert _emitted(low, "CollectiveGatherV2") == 1
  ((op,),) = {c.ops for c in low.report.collectives}   # every record points at the one op
  assert op.shape == (16 * (8 + 4 + 6 + 2),) and op.bytes == 4 * 16 * (8 + 4 + 6 + 2)
  assert low.report.combined == (Combination("all-gather", 4, op.bytes, ("all-gather",)),)
  assert low.report.bytes_per_device() == low.report.logical_bytes_per_device()
  assert "4 independent all-gathers combined into 1" in str(low.report)


def test_all_gathers_along_other_dims_and_of_packed_dtypes_are_exact(rng):
  """float32 gathers over model along dims 0 and 1 share an op; bool and int8 travel packed into int32 and share
  another; a gather over (data, model) stays alone: each result equals the unpartitioned program's."""
  def f(a, b, c, d, e):
    return tf.identity(a), tf.identity(b), tf.identity(c), tf.logical_not(d), e + 1

  args = [rng.standard_normal((8, 12)).astype(np.float32), rng.standard_normal((3, 8, 5)).astype(np.float32),
          rng.standard_normal((2, 3, 8)).astype(np.float32), rng.standard_normal((8, 3)) > 0,
          rng.integers(-100, 100, (6, 8)).astype(np.int8)]
  specs = (P("model", None), P(None, "model", None), P(None, None, ("data", "model")), P("model", None),
           P(None, "model"))
  low = _run_and_compare(f, args, specs, P())
  assert low.report.counts() == {"all-gather": 5}
  assert _emitted(low, "CollectiveGatherV2") == 3   # float32 over model; int32 (bool, int8) over model; data,model
  assert sorted((c.members, c.bytes) for c in low.report.combined) == [
      (2, 4 * 4 * (2 + 3)), (2, 4 * 4 * (2 * 12 + 3 * 2 * 5))]   # bool [2,3] in 2 int32, int8 [6,2] in 3
  assert low.report.bytes_per_device() == sum(op.bytes for op in low.report.emitted_ops())


def test_reduce_scatters_exchanges_are_combined(rng):
  """Partial sums resharded to a split: reduce-scatters, emitted as all-to-alls (TF has no CPU reduce-scatter)
  and a local sum; the all-to-alls of independent ones travel as one."""
  def f(x, w1, w2, w3):
    return x @ w1, x @ w2, x @ w3

  args = [rng.standard_normal((8, 16)).astype(np.float32)] + [
      rng.standard_normal((16, n)).astype(np.float32) for n in (4, 8, 12)]
  low = _run_and_compare(f, args, (P(None, "model"), P("model", None), P("model", None), P("model", None)),
                         P("model", None))
  assert low.report.counts() == {"reduce-scatter": 3}
  assert _emitted(low, "CollectiveAllToAllV2") == 1
  assert low.report.combined == (Combination("all-to-all", 3, 4 * 8 * (4 + 8 + 12), ("reduce-scatter",)),)
  assert "3 independent all-to-alls (reduce-scatters' exchanges among them) combined into 1" in str(low.report)


def _depth_program(x, w1, v, x2, w2):
  a = x @ w1                                         # all-reduce over model (1 all-reduce deep)
  s = tf.reduce_sum(v, axis=0, keepdims=True)        # all-reduce over data (1 deep)
  b = (x2 + s) @ w2                                  # all-reduce over model, after the one over data (2 deep)
  return a, b


def _depth_args(rng):
  return [rng.standard_normal(s).astype(np.float32) for s in ((8, 16), (16, 4), (8, 16), (8, 16), (16, 6))]


DEPTH_SPECS = (P(None, "model"), P("model", None), P("data", None), P(None, "model"), P("model", None))


def test_independent_all_reduces_at_different_depths_are_combined(rng):
  """The model all-reduce of `b` waits for a data all-reduce, so it is one all-reduce deeper than that of `a`;
  neither depends on the other, so they share an op (combining by depth kept them apart)."""
  low = _run_and_compare(_depth_program, _depth_args(rng), DEPTH_SPECS, P())
  assert low.report.counts() == {"all-reduce": 3}
  assert _emitted(low) == 2
  assert low.report.combined == (Combination("all-reduce", 2, 4 * 8 * (4 + 6), ("all-reduce",)),)
  (model,) = {op for c in low.report.collectives if c.axes == ("model",) for op in c.ops}
  assert model.shape == (8 * (4 + 6),)


def test_dependent_all_gathers_stay_separate(rng):
  """The second weight is scaled by a value computed from the first, gathered: its gather waits for the first one,
  so the two stay apart (merging them would make the op wait for itself)."""
  def f(x, w1, w2):
    y1 = x @ w1                                      # gathers w1
    w2 = w2 * tf.reduce_mean(y1)                     # still split over data
    return y1, x @ w2                                # gathers the scaled w2

  args = [rng.standard_normal((64, 16)).astype(np.float32), rng.standard_normal((16, 8)).astype(np.float32),
          rng.standard_normal((16, 8)).astype(np.float32)]
  low = _run_and_compare(f, args, (P("data", None),) * 3, P("data", None))
  assert low.report.counts() == {"all-gather": 2, "all-reduce": 1}
  assert _emitted(low, "CollectiveGatherV2") == 2 and low.report.combined == ()


def test_crossed_dependences_do_not_make_a_cycle(rng):
  """a1 -> b1 and b2 -> a2 (a: all-reduces over model, b: over data). {a1, a2} and {b1, b2} are each
  independent, but merging both pairs would make each merged op wait for the other: one pair only."""
  def f(x1, w1, v1, v2, x2, w2):
    a1 = x1 @ w1                                     # model all-reduce
    b1 = tf.reduce_sum(v1 * tf.reduce_sum(a1), axis=0)   # data all-reduce after a1
    b2 = tf.reduce_sum(v2, axis=0, keepdims=True)    # data all-reduce
    a2 = (x2 + b2) @ w2                              # model all-reduce after b2
    return a1, b1, a2

  args = [rng.standard_normal(s).astype(np.float32)
          for s in ((8, 16), (16, 4), (8, 4), (8, 16), (8, 16), (16, 4))]
  low = _run_and_compare(f, args, (P(None, "model"), P("model", None), P("data", None), P("data", None),
                                   P(None, "model"), P("model", None)), P())
  by_axes = {}
  for c in low.report.collectives:
    if c.kind == "all-reduce":
      by_axes.setdefault(c.axes, set()).update(op.name for op in c.ops)
  assert len(by_axes[("model",)]) + len(by_axes[("data",)]) == 3
  assert _emitted(low) == 3 and [c.members for c in low.report.combined] == [2]


def _plan(edges, keys, order):
  """combine.plan on a DAG given by `edges` (a -> b) over the collectives `order` (topological)."""
  parents = {n: {a for a, b in edges if b == n} for n in order}
  anc = {}
  for n in order:
    anc[n] = 0
    for p in parents[n]:
      anc[n] |= anc[p] | (1 << order.index(p))
  return combine.plan(order, anc, keys.get, lambda n: 1)


@pytest.mark.parametrize("order", [["a1", "b2", "b1", "a2"], ["b2", "a1", "a2", "b1"], ["a1", "b1", "b2", "a2"]])
def test_plan_never_merges_into_a_cycle(order):
  bins = _plan([("a1", "b1"), ("b2", "a2")], {"a1": "A", "a2": "A", "b1": "B", "b2": "B"}, order)
  assert sorted(map(len, bins)) == [1, 1, 2]


def test_plan_sees_dependences_through_merged_bins():
  """p -> m2 and m1 -> z; m1 and m2 are independent and merged, so z waits for m2's op and with it for p: z may not
  join p's bin, though it depends on p through no path of the program as it was."""
  bins = _plan([("p", "m2"), ("m1", "z")], {"p": "K", "m1": "L", "m2": "L", "z": "K"}, ["p", "m1", "m2", "z"])
  assert bins == [["p"], ["m1", "m2"], ["z"]]


def test_plan_keeps_the_byte_cap():
  order = [f"c{k}" for k in range(5)]
  anc = {n: 0 for n in order}
  bins = combine.plan(order, anc, lambda n: "K", lambda n: 3, max_bytes=7)
  assert bins == [["c0", "c1"], ["c2", "c3"], ["c4"]]


def test_a_transformer_steps_gradient_reductions_across_processes_are_one_collective():
  """Megatron on (2, 4) over 2 processes: the data axis joins them, and every gradient's all-reduce over it (some
  behind reshapes whose static shape the per-device graph does not infer) travels in one collective; the
  reductions of the model axis stay inside each process."""
  keras = pytest.importorskip("keras")
  cfg = tm.Config(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=8)
  keras.utils.set_random_seed(0)
  model = tm.keras_model(cfg)
  opt = keras.optimizers.Adam(1e-2)
  opt.build(model.trainable_variables)
  step = gs.function(tm.make_keras_train_step(model, opt), mesh=MESH, in_shardings=(P("data", None),) * 2)
  low = step.lower(*[tf.TensorSpec([cfg.batch, cfg.seq], tf.int32)] * 2, processes=2)
  crossing = [c for c in low.report.collectives if c.cross_process]
  assert len(crossing) > 20 and all(c.axes == ("data",) for c in crossing)
  (op,) = {op for c in crossing for op in c.ops}
  assert op.cross_process and op.bytes == sum(c.bytes for c in crossing)
  assert sum(1 for op in low.report.emitted_ops() if op.cross_process) == 1
