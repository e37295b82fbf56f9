"""Collectives inside loops count once per iteration: the report knows each record's While loops and their trip
counts (rewriter/graph/loops.py reads them off the loop's condition), and its totals are per step."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_report_counts_program, check_partitioned, ir_of
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.graph import loops
from tf_gspmd.rewriter.report import CollectiveRecord, Emitted, Loop, ReportBuilder

MESH = gs.Mesh((2, 4), ("data", "model"))
N, K = 8, 16
# y [N, K] replicated, w [K, K] split over model on its rows: y @ w is a partial sum over model, all-reduced
# into the replicated loop variable: one all-reduce of float32[N, K] on every iteration.
SPECS = (P(), P("model", None))
ALL_REDUCE_BYTES = N * K * 4


def _step(y, w):
  return gs.shard(tf.tanh(y @ w) * 0.5, P())


def _range_for(x, w):
  y = x
  for _ in tf.range(5):
    y = _step(y, w)
  return y


def _counter_below(x, w):
  return tf.while_loop(lambda i, y: i < 5, lambda i, y: (i + 1, _step(y, w)), [0, x])[1]


def _maximum_iterations(x, w):
  return tf.while_loop(lambda y: True, lambda y: (_step(y, w),), (x,), maximum_iterations=5)[0]


def _counting_down(x, w):
  return tf.while_loop(lambda i, y: i > 0, lambda i, y: (i - 2, _step(y, w)), [tf.constant(9), x])[1]


def _args(rng):
  return rng.standard_normal((N, K)).astype(np.float32), (rng.standard_normal((K, K)) * 0.3).astype(np.float32)


def _all_reduce(low):
  (record,) = low.report.collectives
  assert record.kind == "all-reduce" and record.bytes == ALL_REDUCE_BYTES, str(low.report)
  return record


@pytest.mark.parametrize("fn", [_range_for, _counter_below, _maximum_iterations, _counting_down],
                         ids=lambda f: f.__name__)
def test_a_loop_of_five_iterations_counts_its_all_reduce_five_times(rng, fn):
  low = check_partitioned(fn, _args(rng), SPECS, MESH, out=P())
  assert_report_counts_program(low)
  record = _all_reduce(low)
  (loop,) = record.loops
  assert loop.name in {n.name for n in low.global_graph_def.node if n.op in loops.WHILE_OPS}
  assert (loop.trips, record.times, record.within) == (5, 5, (loop.name,))
  rep = low.report
  assert rep.bytes_per_device(per_iteration=True) == ALL_REDUCE_BYTES
  assert rep.bytes_per_device() == rep.logical_bytes_per_device() == 5 * ALL_REDUCE_BYTES
  assert rep.wire_bytes_per_device() == 5 * rep.wire_bytes_per_device(per_iteration=True) == 5 * 2 * 512 * 3 // 4
  assert rep.counts() == {"all-reduce": 5} and rep.counts(per_iteration=True) == {"all-reduce": 1}
  assert f"B/device × 5 (loop {loop.name})" in str(rep) and "1 collective(s), 5 run per step" in str(rep)


def test_nested_loops_count_the_product_of_their_trip_counts(rng):
  def fn(x, w):
    y = x
    for _ in tf.range(3):
      for _ in tf.range(4):
        y = _step(y, w)
    return y

  low = check_partitioned(fn, _args(rng), SPECS, MESH, out=P())
  assert_report_counts_program(low)
  record = _all_reduce(low)
  outer, inner = record.loops
  assert (outer.trips, inner.trips, record.times) == (3, 4, 12)
  assert record.within == (outer.name, inner.name) and inner.name.startswith(outer.name + "/")
  assert low.report.bytes_per_device() == 12 * low.report.bytes_per_device(per_iteration=True) == 12 * ALL_REDUCE_BYTES
  assert f"× 12 (loop {outer.name} × 3; loop {inner.name} × 4)" in str(low.report)


def test_a_loop_of_data_dependent_trip_count_is_counted_per_iteration(rng):
  def fn(x, w, n):
    y = x
    for _ in tf.range(n):
      y = _step(y, w)
    return y

  x, w = _args(rng)
  low = check_partitioned(fn, (x, w, np.int32(3)), SPECS + (P(),), MESH, out=P())
  assert_report_counts_program(low)
  record = _all_reduce(low)
  (loop,) = record.loops
  assert (loop.trips, loop.at_most, record.times) == (None, None, 1)
  assert low.report.per_iteration_loops() == {loop.name: loop}
  assert low.report.bytes_per_device() == low.report.bytes_per_device(per_iteration=True) == ALL_REDUCE_BYTES
  text = str(low.report)
  assert f"per iteration of loop {loop.name} (trip count unknown): its 1 collective(s) count once" in text
  assert f"B/device per iteration of loop {loop.name} (trip count unknown) - " in text


def _pipeline_step(x, w):
  def stage(w, h):
    for k in range(w.shape[0]):
      h = h + tf.tanh(h @ w[k])
    return h

  with tf.GradientTape() as tape:
    tape.watch([x, w])
    y = gs.pipeline(stage, w, x, microbatches=8)
    loss = tf.reduce_mean(y ** 2)
  return (y,) + tuple(tape.gradient(loss, [x, w]))


def test_pipeline_loops_count_every_iteration_of_the_schedule(rng):
  """The forward loop and its gradient loop each run the schedule's R*M + S - 1 iterations (the gradient loop's
  trip count is the forward loop's counter): their collectives count that many times, the shift included."""
  stages, d, b = 4, 8, 16
  x = rng.standard_normal((b, d)).astype(np.float32)
  w = gs.stack_stages((rng.standard_normal((2 * stages, d, d)) * 0.3).astype(np.float32), stages)
  mesh = gs.Mesh((4, 2), ("stage", "data"))
  low = check_partitioned(_pipeline_step, (x, w), (P("data", None), P("stage")), mesh, tol=1e-5)
  assert_report_counts_program(low)
  rep = low.report
  (sched,) = rep.pipelines
  looped = [c for c in rep.collectives if c.loops]
  names = {c.loops[0].name.split("/")[-1] for c in looped}
  assert names == {f"{sched.name}_loop", f"{sched.name}_loop_grad"}, names
  assert all(len(c.loops) == 1 and c.loops[0].trips == c.times == sched.iterations == 11 for c in looped)
  outside = [c for c in rep.collectives if not c.loops]
  per_iteration = sum(c.bytes for c in looped)
  assert rep.logical_bytes_per_device() == sched.iterations * per_iteration + sum(c.bytes for c in outside)
  assert rep.logical_bytes_per_device(per_iteration=True) == per_iteration + sum(c.bytes for c in outside)
  ops_once = rep.bytes_per_device(per_iteration=True)
  looped_ops = {(c.within, op.name): op.bytes for c in looped for op in c.ops}
  assert rep.bytes_per_device() == ops_once + (sched.iterations - 1) * sum(looped_ops.values())
  shift = next(c for c in looped if c.source.endswith(f"{sched.name}_loop/{sched.name}_shift"))
  assert sched.shift_bytes == shift.bytes and shift.times == sched.iterations   # per iteration, run 11 times
  assert all("× 11 (loop " in c for c in sched.loop_stage_collectives)


def _trips(fn):
  ir = ir_of(fn, (4,))
  return [loops.trip_count(ir, n.name) for n in ir.nodes if n.op in loops.WHILE_OPS]


@pytest.mark.parametrize("fn,want", [
    (lambda x: tf.while_loop(lambda i, y: i < 10, lambda i, y: (i + 2, y * 2.0), [1, x])[1], [(5, None)]),
    (lambda x: tf.while_loop(lambda i, y: i <= 6, lambda i, y: (i + 2, y * 2.0), [0, x])[1], [(4, None)]),
    (lambda x: tf.while_loop(lambda i, y: 6 != i, lambda i, y: (i + 2, y * 2.0), [0, x])[1], [(3, None)]),
    (lambda x: tf.while_loop(lambda i, y: i >= 1, lambda i, y: (i - 3, y * 2.0), [10, x])[1], [(4, None)]),
    (lambda x: tf.while_loop(lambda i, y: i < 0, lambda i, y: (i + 1, y * 2.0), [0, x])[1], [(0, None)]),
    (lambda x: tf.while_loop(lambda i, y: i < 10, lambda i, y: (i + 2, y * 2.0), [1, x],
                             maximum_iterations=3)[1], [(3, None)]),
    (lambda x: tf.while_loop(lambda y: tf.reduce_sum(y) < 1e9, lambda y: y * 2.0, [x], maximum_iterations=7)[0],
     [(None, 7)]),
    (lambda x: tf.while_loop(lambda y: tf.reduce_sum(y) < 1e9, lambda y: y * 2.0, [x])[0], [(None, None)]),
], ids=["counter", "less_equal", "not_equal", "down", "none", "maximum_iterations", "data_bounded", "data"])
def test_trip_count_of_a_while_loop(fn, want):
  assert _trips(fn) == want


def test_trip_count_of_a_range_loop_and_of_a_gradient_loop():
  def ranged(x):
    for _ in tf.range(2, 11, 3):   # 2, 5, 8
      x = x * 2.0
    for _ in tf.range(10, 0, -3):  # 10, 7, 4, 1
      x = x * 2.0
    return x

  def gradient(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      loss = tf.reduce_sum(tf.while_loop(lambda i, y: i < 6, lambda i, y: (i + 1, tf.sin(y)), [0, x])[1])
    return tape.gradient(loss, x)

  assert _trips(ranged) == [(3, None), (4, None)]
  assert _trips(gradient) == [(6, None), (6, None)]   # the forward loop, then its gradient loop


def test_report_counts_loops_by_their_trip_counts():
  """A record's `times` is the product of its loops' runs (a condition runs trips + 1 times, a loop of unknown
  trip count counts once); the totals and counts are per step, per_iteration=True counts every record once."""
  def record(source, nbytes):
    op = Emitted("all-reduce", ("m",), "Add", source + "/ar", "CollectiveReduceV2", "float32", (nbytes // 4,), 4,
                 nbytes)
    return CollectiveRecord("all-reduce", "float32", (nbytes // 4,), nbytes, 4, ("m",), source, "why", (op,))

  builder = ReportBuilder()
  builder.add(record("top", 8))
  with builder.inside("outer", Loop("outer", 3)):
    builder.add(record("a", 16))
    with builder.inside("inner", Loop("inner", 4)):
      builder.add(record("b", 32))
    with builder.inside("cond", Loop("cond", 4, condition=True)):
      builder.add(record("c", 64))
    with builder.inside("branch"):
      builder.add(record("d", 128))
  with builder.inside("open", Loop("open", None, at_most=9)):
    builder.add(record("e", 256))
  rep = builder.build()
  assert [c.times for c in rep.collectives] == [1, 3, 12, 15, 3, 1]
  assert rep.collectives[4].within == ("outer", "branch") and rep.collectives[4].loops == (Loop("outer", 3),)
  assert rep.bytes_per_device() == rep.logical_bytes_per_device() == 8 + 3 * 16 + 12 * 32 + 15 * 64 + 3 * 128 + 256
  assert rep.bytes_per_device(per_iteration=True) == 8 + 16 + 32 + 64 + 128 + 256
  assert rep.counts() == {"all-reduce": 35} and rep.counts(per_iteration=True) == {"all-reduce": 6}
  assert set(rep.emitted()) == {"top/ar"} and len(rep.emitted_ops()) == 6   # emitted(): the program's graph
  assert rep.per_iteration_loops() == {"open": Loop("open", None, at_most=9)}
  text = str(rep)
  assert "6 collective(s), 35 run per step" in text
  assert "per iteration of loop open (trip count unknown, at most 9): its 1 collective(s) count once" in text
  assert "× 12 (loop outer × 3; loop inner × 4)" in text
  assert "× 15 (loop outer × 3; loop cond (its condition) × 5)" in text
  # a pass that replaces ops of the program's graph leaves the bodies' records alone
  replaced = rep.with_ops_replaced({"a/ar": None, "top/ar": None})
  assert replaced.bytes_per_device(per_iteration=True) == 16 + 32 + 64 + 128 + 256
  assert rep.without_bodies_of({"outer"}).bytes_per_device() == 8 + 256


# ---- accumulators: a loop variable each iteration only adds to keeps its sum pending until after the loop ----------
# x [N, K] split over model on its columns, w [K, K] over model on its rows: x @ w is a sum pending over model.
ACC_SPECS = (P(None, "model"), P("model", None), P())


def _accumulate(x, w, acc):
  """acc + sum over 5 iterations of a partial product: the loop only adds to acc."""
  return tf.while_loop(lambda i, a: i < 5, lambda i, a: (i + 1, a + tf.tanh(x * tf.cast(i, x.dtype)) @ w),
                       [0, acc])[1]


def _accumulate_and_read(x, w, acc):
  """The same, but each iteration also reads acc (through tanh): its sum is needed inside the loop."""
  return tf.while_loop(lambda i, a: i < 5,
                       lambda i, a: (i + 1, a + 0.1 * tf.tanh(a) + tf.tanh(x * tf.cast(i, x.dtype)) @ w), [0, acc])[1]


def _accumulate_and_test(x, w, acc):
  """The same, but the loop's condition reads acc."""
  return tf.while_loop(lambda i, a: tf.logical_and(i < 5, tf.reduce_sum(a) < 1e9),
                       lambda i, a: (i + 1, a + tf.tanh(x * tf.cast(i, x.dtype)) @ w), [0, acc])[1]


def _acc_args(rng):
  x, w = _args(rng)
  return x, w, rng.standard_normal((N, K)).astype(np.float32)   # a nonzero initial value: one term of the sum


def test_an_accumulator_is_reduced_once_after_the_loop(rng):
  low = check_partitioned(_accumulate, _acc_args(rng), ACC_SPECS, MESH, out=P())
  assert_report_counts_program(low)
  (record,) = low.report.collectives
  assert (record.kind, record.axes, record.bytes, record.loops, record.times) == \
      ("all-reduce", ("model",), ALL_REDUCE_BYTES, (), 1), str(low.report)
  assert low.report.bytes_per_device() == ALL_REDUCE_BYTES


@pytest.mark.parametrize("fn", [_accumulate_and_read, _accumulate_and_test], ids=lambda f: f.__name__)
def test_an_accumulator_read_inside_the_loop_is_reduced_in_every_iteration(rng, fn):
  low = check_partitioned(fn, _acc_args(rng), ACC_SPECS, MESH, out=P())
  assert_report_counts_program(low)
  reduced = [c for c in low.report.collectives if c.kind == "all-reduce" and c.axes == ("model",)]
  assert [(c.bytes, len(c.loops)) for c in reduced] == [(ALL_REDUCE_BYTES, 1)], str(low.report)   # in the body


def test_sums_pending_over_different_axes_are_reduced_in_every_iteration(rng):
  """acc + (a sum pending over model) + (a sum pending over data): the two cannot be carried as one pending sum,
  so the body is partitioned again with both reduced in every iteration."""
  def fn(x, w, z, v, acc):
    return tf.while_loop(lambda i, a: i < 5, lambda i, a: (i + 1, a + tf.tanh(x * 0.5) @ w + tf.tanh(z) @ v),
                         [0, acc])[1]

  x, w, acc = _acc_args(rng)
  z, v = x * 0.25, (rng.standard_normal((K, K)) * 0.3).astype(np.float32)
  specs = (P(None, "model"), P("model", None), P(None, "data"), P("data", None), P())
  low = check_partitioned(fn, (x, w, z, v, acc), specs, MESH, out=P())
  assert_report_counts_program(low)
  assert sorted((c.axes, c.times) for c in low.report.collectives if c.kind == "all-reduce") == \
      [(("data",), 5), (("model",), 5)], str(low.report)


def _data_bytes(rep, in_loops):
  return sum(c.bytes * c.times for c in rep.collectives if "data" in c.axes and bool(c.loops) == in_loops)


def test_pipeline_weight_gradients_are_reduced_over_data_once_per_step(rng, monkeypatch):
  """The gradient loop only adds each iteration's weight gradient (partial over the data axis) to its
  accumulator: the sum stays pending over data across the 11 iterations and is all-reduced once after the loop,
  so the step's bytes over data fall by the trip count (compared with reducing in every iteration)."""
  stages, d, b = 4, 8, 16
  x = rng.standard_normal((b, d)).astype(np.float32)
  w = gs.stack_stages((rng.standard_normal((2 * stages, d, d)) * 0.3).astype(np.float32), stages)
  mesh = gs.Mesh((4, 2), ("stage", "data"))
  specs = (P("data", None), P("stage"))
  low = check_partitioned(_pipeline_step, (x, w), specs, mesh, tol=1e-5)
  assert_report_counts_program(low)
  rep = low.report
  (sched,) = rep.pipelines
  gradient_shard = (stages // 4) * 2 * d * d * 4   # dw [S, 2, d, d] split over stage: [1, 2, d, d] float32
  assert _data_bytes(rep, in_loops=True) == 0, str(rep)
  after = [c for c in rep.collectives if c.axes == ("data",) and not c.loops]
  assert [(c.kind, c.bytes, c.times) for c in after] == [("all-reduce", gradient_shard, 1)], str(rep)
  # the same program with every loop variable reduced in each iteration
  monkeypatch.setattr(loops, "accumulators", lambda body, candidates: {})
  every = gs.function(_pipeline_step, mesh=mesh, in_shardings=specs).lower(
      tf.TensorSpec(x.shape), tf.TensorSpec(w.shape)).report
  assert _data_bytes(every, in_loops=False) == 0
  assert _data_bytes(every, in_loops=True) == sched.iterations * _data_bytes(rep, in_loops=False) == 11 * gradient_shard
