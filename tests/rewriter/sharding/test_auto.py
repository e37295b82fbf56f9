"""Automatic sharding (the auto_shard pass): plans no worse than the hand-written ones, results unchanged."""

import collections
import itertools
import math
import os
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import first_node, ir_of, loop_step, pipeline_step
import tf_gspmd as gs
from tf_gspmd import ops, P
from tf_gspmd.errors import AutoShardingError, InputError, MeshError
from tf_gspmd.ops.factors import dims_from, FactorRule
from tf_gspmd.rewriter.sharding.auto import plan_memory

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

M24 = gs.Mesh((2, 4), ("data", "model"))
MEGATRON_MLP = (P("data", None), P("data", None), P(None, "model"), P("model", None))


def _specs(args):
  return [tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in args]


def _memory(low):
  """Bytes per device of a lowered plan as memory_budget counts them: arguments, variables, constants and the
  activations live at the peak, at the plan's layouts."""
  return sum(plan_memory(low.program))


def _replicated_memory(fn, args):
  return _memory(gs.function(fn, mesh=M24, in_shardings=P()).lower(*_specs(args)))


def _mlp_args(rng, batch=64, d=256, h=1024):
  return [rng.standard_normal((batch, d)).astype(np.float32), rng.standard_normal((batch, d)).astype(np.float32),
          (rng.standard_normal((d, h)) * 0.05).astype(np.float32),
          (rng.standard_normal((h, d)) * 0.05).astype(np.float32)]


def _assert_same_results(f, fn, args):
  got = tf.nest.flatten(f(*args))
  want = tf.nest.flatten(tf.function(fn)(*[tf.constant(a) for a in args]))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), w.numpy(), rtol=1e-4, atol=1e-5)


def test_no_annotations_at_most_the_data_parallel_bytes_and_same_results(rng):
  args = _mlp_args(rng)
  dp = gs.function(tm.mlp_train_step, mesh=M24,
                   in_shardings=(P(("data", "model"), None), P(("data", "model"), None), P(), P()))
  auto = gs.function(tm.mlp_train_step, mesh=M24, in_shardings="auto")
  low_dp, low = dp.lower(*_specs(args)), auto.lower(*_specs(args))
  plan = low.auto_plan
  assert low.report.bytes_per_device() <= low_dp.report.bytes_per_device()
  # The program priced what the partitioner emits (to a scalar's all-reduce: the loss's 4 bytes).
  assert abs(plan.predicted_bytes - low.report.bytes_per_device()) <= 4
  assert plan.status == "Optimal"
  _assert_same_results(auto, tm.mlp_train_step, args)


def test_budget_below_the_replicated_weights_splits_them_and_meets_it(rng):
  args = _mlp_args(rng)
  budget = _replicated_memory(tm.mlp_train_step, args) // 4
  auto = gs.function(tm.mlp_train_step, mesh=M24, in_shardings="auto", memory_budget=budget)
  low = auto.lower(*_specs(args))
  plan = low.auto_plan
  state, rest = plan_memory(low.program)
  assert state + rest <= budget
  # Under a budget the plan states its count as plan_memory counts it.
  assert (plan.state_bytes_per_device, plan.memory_bytes_per_device) == (state, state + rest)
  # The per-device program: the plan's count plus what partitioning adds, stated.
  account = low.report.memory
  assert account.plan.peak_bytes == state + rest
  assert account.plan.peak_bytes <= account.peak_bytes <= budget + account.added_bytes
  w1, w2 = low.in_shardings[2:]
  assert w1.num_tiles > 1 and w2.num_tiles > 1
  _assert_same_results(auto, tm.mlp_train_step, args)


def test_state_pins_bound_the_program_that_pins_only_the_arguments(rng):
  """auto_pins="state": only arguments and variables are pinned, so the plan the budget bounds is the program a
  user gets by writing the chosen layouts as in_shardings (completion lays out the rest the same way)."""
  args = _mlp_args(rng)
  budget = _replicated_memory(tm.mlp_train_step, args) // 3
  f = gs.function(tm.mlp_train_step, mesh=M24, in_shardings="auto", memory_budget=budget, auto_pins="state",
                  solver_time_limit=30.0)
  low = f.lower(*_specs(args))
  assert _memory(low) <= budget
  written = gs.function(tm.mlp_train_step, mesh=M24, in_shardings=tuple(low.in_shardings)).lower(*_specs(args))
  assert _memory(written) == _memory(low)
  assert written.shardings == low.shardings
  _assert_same_results(f, tm.mlp_train_step, args)


def test_megatron_mlp_step_no_more_bytes_than_megatron_at_its_memory(rng):
  args = _mlp_args(rng)
  hand = gs.function(tm.mlp_train_step, mesh=M24, in_shardings=MEGATRON_MLP).lower(*_specs(args))
  budget = _memory(hand)
  f = gs.function(tm.mlp_train_step, mesh=M24, in_shardings="auto", memory_budget=budget)
  low = f.lower(*_specs(args))
  assert _memory(low) <= budget
  assert low.auto_plan.predicted_bytes <= hand.report.bytes_per_device()
  assert low.report.bytes_per_device() <= hand.report.bytes_per_device()
  _assert_same_results(f, tm.mlp_train_step, args)


def _each_sum_reduced_apart(report):
  """The bytes per device of a program without loops had each partial sum been reduced where it was produced: a
  reduction of N terms added first counted N times (each term has the sum's shape and layout)."""
  assert not any(c.loops for c in report.collectives)
  terms = [re.search(r"sum of (\d+) partial terms reduced once", c.reason) for c in report.collectives]
  assert sum(c.bytes for c in report.collectives) == report.bytes_per_device()
  return sum(c.bytes * (int(m.group(1)) if m else 1) for c, m in zip(report.collectives, terms))


def test_transformer_step_no_more_bytes_than_megatron_at_its_memory():
  """The 12-layer Adam step with every weight and slot an argument; the batch arguments left to the solver."""
  step, args, specs = tm.megatron_train_args(tm.Config())
  hand = gs.function(step, mesh=M24, in_shardings=specs).lower(*_specs(args))
  budget = _memory(hand)
  f = gs.function(step, mesh=M24, in_shardings=[P()] + ["auto"] * (len(args) - 1), memory_budget=budget)
  low = f.lower(*_specs(args))
  plan = low.auto_plan
  assert _memory(low) <= budget
  account = low.report.memory   # the per-device program: the plan's count plus what partitioning adds
  assert account.plan.peak_bytes == _memory(low) and account.peak_bytes <= budget + account.added_bytes
  assert low.report.peak_bytes_per_device <= hand.report.peak_bytes_per_device   # (the memory pass agrees)
  # The solver prices each reduction where it is produced; emitted, partial sums are added before they travel
  # (rewriter/partition/sums.py: "sum of N partial terms reduced once"). Priced alike, the plan sends no more than
  # Megatron; what it emits is at most what it predicted.
  assert plan.predicted_bytes <= _each_sum_reduced_apart(hand.report)
  assert low.report.bytes_per_device() <= plan.predicted_bytes
  assert plan.folded_blocks < plan.blocks / 4    # twelve identical layers priced as one
  # It found tensor parallelism: the MLP weights of every layer split over `model`, as Megatron does.
  names = sorted(tm.param_shapes(tm.Config()))
  for layer in range(12):
    k = 3 + names.index(f"l{layer}/w1")
    assert "model" in low.in_shardings[k].used_axes


@pytest.mark.parametrize("name", ["while_loop", "pipeline"])
def test_a_plan_chosen_under_a_budget_is_estimated_within_it_plus_what_partitioning_adds(name):
  """Programs with loops (a tf.while_loop and its gradient, a gs.pipeline step): the solver prices a loop's body
  and the lists it keeps for the backward at the share of the loop's operands, then counts the plan it chose as
  plan_memory does. That count is within the budget, and the per-device program's estimate within the budget
  plus the bytes partitioning added (the memory pass's Account states both)."""
  if name == "while_loop":
    step, mesh, hand_in = loop_step, M24, (P("data", None), P(None, "model"))
    specs = [tf.TensorSpec([256, 256]), tf.TensorSpec([256, 256])]
  else:
    step, mesh, hand_in = pipeline_step, gs.Mesh((4, 2), ("stage", "data")), (P("data", None), P("stage"))
    specs = [tf.TensorSpec([16, 8]), tf.TensorSpec([4, 2, 8, 8])]
  budget = int(1.25 * _memory(gs.function(step, mesh=mesh, in_shardings=hand_in).lower(*specs)))
  low = gs.function(step, mesh=mesh, in_shardings="auto", memory_budget=budget).lower(*specs)
  account = low.report.memory
  assert account.plan.peak_bytes == _memory(low) <= budget
  assert account.peak_bytes <= budget + account.added_bytes
  assert f"memory_budget {budget:,}: the plan's count is within it" in str(low.report)


def test_training_with_auto_sharded_variables_gives_the_unpartitioned_losses(rng):
  """Captured tf.Variables (weights and momentum) laid out by the solver under a budget; 5 SGD-momentum steps."""
  init = [(rng.standard_normal((128, 512)) * 0.05).astype(np.float32),
          (rng.standard_normal((512, 128)) * 0.05).astype(np.float32)]
  batches = [(rng.standard_normal((32, 128)).astype(np.float32), rng.standard_normal((32, 128)).astype(np.float32))
             for _ in range(5)]

  def make():
    ws = [tf.Variable(w) for w in init]
    ms = [tf.Variable(np.zeros_like(w)) for w in init]

    def step(x, t):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.nn.relu(x @ ws[0]) @ ws[1] - t))
      for w, m, g in zip(ws, ms, tape.gradient(loss, ws)):
        m.assign(0.9 * m + g)
        w.assign_sub(0.1 * m)
      return loss
    return step, ws + ms

  plain, _ = make()
  want = [float(tf.function(plain)(*b)) for b in batches]
  probe, _ = make()
  budget = _replicated_memory(probe, batches[0]) // 3
  step, variables = make()
  f = gs.function(step, mesh=M24, in_shardings="auto", memory_budget=budget)
  got = [float(f(*b)) for b in batches]
  np.testing.assert_allclose(got, want, rtol=1e-4)
  low = f.lower(*_specs(batches[0]))
  assert _memory(low) <= budget
  assert any(not gs.sharding_of(v).is_replicated for v in variables)   # stored split, as chosen


def test_fixed_entries_are_kept_and_the_plan_explains_every_choice(rng):
  args = _mlp_args(rng)
  f = gs.function(tm.mlp_train_step, mesh=M24, in_shardings=[P("data", None), "auto", "auto", "auto"],
                  memory_budget=_replicated_memory(tm.mlp_train_step, args) // 2)
  low = f.lower(*_specs(args))
  assert low.in_shardings[0] == gs.Sharding(M24, (("data",), ()))
  plan = low.auto_plan
  assert [c.name for c in plan.choices] == ["argument 1", "argument 2", "argument 3"]
  for c, s in zip(plan.choices, low.in_shardings[1:]):
    assert c.sharding == s
    assert c.runner_up is not None and c.runner_up != c.sharding and c.runner_up_extra >= 0
  text = str(plan)
  assert "runner-up" in text and "argument 2" in text and "predicted" in text


def test_a_costly_axis_carries_fewer_bytes(rng):
  """axis_cost: a cross-host `data` axis 50x as slow moves traffic onto `model` (or removes it)."""
  args = _mlp_args(rng)

  def bytes_by_axis(low):
    out = collections.Counter()
    for c in low.report.collectives:
      for a in c.axes:
        out[a] += c.bytes
    return out

  budget = _replicated_memory(tm.mlp_train_step, args) // 4
  even = gs.function(tm.mlp_train_step, mesh=M24, in_shardings="auto", memory_budget=budget).lower(*_specs(args))
  slow = gs.function(tm.mlp_train_step, mesh=M24, in_shardings="auto", memory_budget=budget,
                     axis_cost={"data": 50.0}).lower(*_specs(args))
  assert bytes_by_axis(slow)["data"] < bytes_by_axis(even)["data"] or bytes_by_axis(even)["data"] == 0
  assert _memory(slow) <= budget


def test_a_budget_nothing_fits_is_a_typed_error(rng):
  args = _mlp_args(rng)
  f = gs.function(tm.mlp_train_step, mesh=M24, in_shardings="auto", memory_budget=1024)
  with pytest.raises(AutoShardingError, match=r"memory_budget=1,024 B per device \(arguments, variables, constants "
                     r"and the activations live at the peak: the smallest possible is"):
    f.lower(*_specs(args))


def test_a_solver_time_out_says_so_and_gives_the_same_plan_every_call(rng):
  """The solver's limit is wall-clock time; where it runs out, the plan is the deterministic fallback's
  (`solver.local_search`), within the budget and the same for the same call, and a warning says so."""
  args = _mlp_args(rng)
  budget = _replicated_memory(tm.mlp_train_step, args) // 4
  plans = []
  for _ in range(2):
    f = gs.function(tm.mlp_train_step, mesh=M24, in_shardings="auto", memory_budget=budget, solver_time_limit=1e-6)
    with pytest.warns(UserWarning, match=r"sharding solver ran out of time \(solver_time_limit=1e-06 s\).*"
                                         r"deterministic fallback"):
      low = f.lower(*_specs(args))
    plans.append(low.auto_plan)
  assert all(p.timed_out and p.status == "time limit reached: deterministic local search" for p in plans)
  assert [(c.name, c.sharding) for c in plans[0].choices] == [(c.name, c.sharding) for c in plans[1].choices]
  assert _memory(low) <= budget
  _assert_same_results(f, tm.mlp_train_step, args)


def test_bad_auto_arguments_are_typed_errors():
  with pytest.raises(InputError, match="only string accepted is \"auto\""):
    gs.function(tm.mlp_train_step, mesh=M24, in_shardings="atuo")
  with pytest.raises(InputError, match="apply to automatic sharding"):
    gs.function(tm.mlp_train_step, mesh=M24, in_shardings=P("data", None), memory_budget=1 << 20)
  with pytest.raises(MeshError, match="'host', which is not an axis"):
    gs.function(tm.mlp_train_step, mesh=M24, in_shardings="auto", axis_cost={"host": 8.0})
  with pytest.raises(InputError, match="positive"):
    gs.function(tm.mlp_train_step, mesh=M24, in_shardings="auto", memory_budget=-5)
  with pytest.raises(InputError, match="solver_time_limit=0"):
    gs.function(tm.mlp_train_step, mesh=M24, in_shardings="auto", solver_time_limit=0)
  with pytest.raises(InputError, match="auto_pins='some'"):
    gs.function(tm.mlp_train_step, mesh=M24, in_shardings="auto", auto_pins="some")
  with pytest.raises(InputError, match="apply to automatic sharding"):
    gs.function(tm.mlp_train_step, mesh=M24, in_shardings=P(), solver_time_limit=5.0)


def _every_even_split(mesh, sizes):
  """Every map label -> mesh axes (each axis of size > 1 on at most one label) that divides each label's size."""
  axes = [a for a in mesh.axis_names if mesh.axis_size(a) > 1]
  labels = sorted(sizes)
  out = []
  for where in itertools.product([None] + labels, repeat=len(axes)):
    axes_of = {}
    for a, l in zip(axes, where):
      if l is not None:
        axes_of[l] = axes_of.get(l, ()) + (a,)
    if all(sizes[l] % math.prod(mesh.axis_size(a) for a in ax) == 0 for l, ax in axes_of.items()):
      out.append(axes_of)
  return out


@pytest.mark.parametrize("fn,shapes,op,megatron", [
    # x @ w1 (column-parallel: n over "model") and h @ w2 (row-parallel: the contracted k over "model").
    (lambda x, w: x @ w, ((64, 256), (256, 1024)), "MatMul",
     [{"m": ("data",), "n": ("model",)}, {"m": ("data",), "k": ("model",)}]),
    # A batch of 6 divides over "data" (2) but not over "model" (4): no strategy splits b over "model".
    (lambda x, w: tf.einsum("bsd,dh->bsh", x, w), ((6, 128, 512), (512, 1024)), "Einsum",
     [{"b": ("data",), "h": ("model",)}, {"b": ("data",), "d": ("model",)}]),
])
def test_strategies_are_every_even_split_megatron_included(fn, shapes, op, megatron):
  """`Rule.strategies`: every assignment of the mesh's axes to the op's factors that divides them evenly, the
  Megatron splits among them, nothing that splits a factor unevenly or uses an axis twice; the auto pass plans
  each such op with one of them."""
  node = first_node(ir_of(fn, *shapes), op)
  rule = ops.lookup(op)
  assert isinstance(rule, FactorRule)
  f = rule.cached_factors(node)
  sizes = rule.factor_sizes(node)
  assert set(sizes) == set(f.labels)
  got = rule.strategies(node, M24)
  assert got[-1] == {}                                      # the unsplit strategy last
  assert len({tuple(sorted(a.items())) for a in got}) == len(got)
  assert sorted(map(str, got)) == sorted(map(str, _every_even_split(M24, sizes)))
  for axes_of in megatron:
    assert axes_of in got
  for axes_of in got:
    used = [a for ax in axes_of.values() for a in ax]
    assert len(used) == len(set(used))
    for labels, shape in zip(f.operands + f.outputs, shapes + (node.outputs[0].shape,)):
      layout = gs.Sharding(M24, dims_from(labels, axes_of))
      assert all(n % layout.tiles(d) == 0 for d, n in enumerate(shape))
  if op == "Einsum":
    assert not any("model" in a.get("b", ()) for a in got)
  assert f.partial({"m": ("data",), "k": ("model",)} if op == "MatMul" else {"d": ("model",)}) == (("model",), "Add")
  assert ops.lookup("Reshape").strategies(first_node(ir_of(lambda x: tf.reshape(x, [-1]), (4, 8)), "Reshape"),
                                          M24) is None   # described by forward/backward only

  low = gs.function(fn, mesh=M24, in_shardings="auto").lower(*[tf.TensorSpec(s) for s in shapes])
  planned = {name: axes_of for name, axes_of in low.auto_plan.planned.items() if low.program.ir.node(name).op == op}
  assert planned
  for name, axes_of in planned.items():
    assert axes_of in rule.strategies(low.program.ir.node(name), M24)
