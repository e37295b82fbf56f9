"""Automatic stages and submeshes (gs.plan_stages): clustering, Alpa's stage program, tiling, memory budget."""

import dataclasses
import os
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd.errors import AutoShardingError, InputError
from tf_gspmd.rewriter.stages import calibrate, layers as clustering, stage_dp, plan as stages
from tf_gspmd._parallel import stages as gs_stages
from tf_gspmd._parallel.stages import trace_forward

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

# A transformer whose parts differ: an embedding, decoder blocks and a vocabulary head larger than a block.
CFG = tm.Config(layers=4, d_model=64, heads=4, d_ff=256, vocab=4096, seq=16, batch=8)
# Devices that compute side by side (an accelerator mesh; this machine's logical CPUs share 2 cores).
CAL = dataclasses.replace(calibrate.DEFAULT, parallel_devices=float("inf"))
# Call and move costs of an accelerator cluster: the small test models' stages pipeline under them (at this
# machine's 2 ms a call they do not pay; see test_transfers_and_calls_are_priced).
PIPE = dataclasses.replace(CAL, seconds_per_call=2e-5, seconds_per_transfer_byte=1e-11, seconds_per_move=1e-7)


def _specs(cfg):
  return ({k: tf.TensorSpec(s, tf.float32) for k, s in tm.param_shapes(cfg).items()},
          tf.TensorSpec((cfg.batch, cfg.seq), tf.int32), tf.TensorSpec((cfg.batch, cfg.seq), tf.int32))


def _loss(cfg):
  def loss(params, tokens, targets):
    return tm.loss_fn(params, tokens, targets, cfg)
  return loss


@pytest.fixture(scope="module")
def traced():
  program, _, _ = trace_forward(_loss(CFG), _specs(CFG), gs.Mesh((2, 4), ("host", "device")))
  return program


def test_clustering_balances_flops_and_never_splits_an_op(traced):
  order = clustering.program_order(traced.ir)
  flops = np.array([clustering.op_flops(n) for n in order])
  head = max(order, key=clustering.op_flops)
  assert head.op == "Einsum" and clustering.op_flops(head) > flops.sum() / 8   # the vocabulary head dominates
  for count in (4, 6, 8):
    layers = clustering.cluster(traced, count)
    assert len(layers) == count
    names = [o for l in layers for o in l.ops]
    assert names == [n.name for n in order]              # every op once, whole, layers contiguous in order
    assert sum(l.flops for l in layers) == pytest.approx(flops.sum())
    cap = max(1.1 * flops.sum() / count, flops.max())
    assert max(l.flops for l in layers) <= cap * (1 + 1e-9)
    # No worse balanced than cutting the same order into runs of equal op counts.
    bounds = np.linspace(0, len(order), count + 1).astype(int)
    naive = max(flops[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:]))
    assert max(l.flops for l in layers) <= naive
    # Boundary tensors: what a layer reads from another layer is made by an earlier one and named there.
    made = {}
    for l in layers:
      for r in l.inputs:
        assert made[r] < l.index and r in layers[made[r]].outputs
      for r in l.outputs:
        made[r] = l.index


def test_repeated_blocks_share_a_signature():
  cfg = tm.Config(layers=8, d_model=64, heads=4, d_ff=256, vocab=128, seq=16, batch=8)
  program, _, _ = trace_forward(_loss(cfg), _specs(cfg), gs.Mesh((2, 4), ("host", "device")))
  layers = clustering.cluster(program, 8)
  counts, shapes = {}, {}
  for l in layers:
    counts[l.signature] = counts.get(l.signature, 0) + 1
    key = tuple((program.ir.node(o).op, tuple(t.shape for t in program.ir.node(o).outputs)) for o in l.ops)
    assert shapes.setdefault(l.signature, key) == key   # one signature: the same computation
  assert max(counts.values()) >= 4      # repeated decoder blocks cut alike share one
  pricer = stages.Pricer(program, layers, program.input_names[:-2], 4, CAL, 2, 10.0)
  for k in range(len(layers)):
    pricer.cost(k, (2, 4))
  assert pricer.solves == len(counts)   # ... and are priced once per logical mesh


def test_clustering_rejects_more_layers_than_ops(traced):
  with pytest.raises(InputError, match="layers=100000"):
    clustering.cluster(traced, 100000)


def _random_tables(rng, layers, cfgs):
  sizes = np.array([c.size for c in cfgs], dtype=float)
  i, j = np.meshgrid(range(layers), range(layers), indexing="ij")
  span = (j - i + 1)[:, :, None]
  t = rng.uniform(0.5, 1.5, (layers, layers, len(cfgs))) * span / sizes ** rng.uniform(0.5, 1.0)
  t[j < i] = np.inf
  state = span * rng.uniform(1, 2, t.shape) / sizes
  act = span * rng.uniform(0.1, 1, t.shape) / sizes
  return t, state, act


@pytest.mark.parametrize("seed", range(8))
def test_stage_program_matches_brute_force(seed):
  rng = np.random.default_rng(seed)
  cfgs = stage_dp.configs(2, 4)     # 4 layers on 8 devices: (1,1), (1,2), (1,4) as (1,4)/(2,2), (2,4) as ...
  sizes = [c.size for c in cfgs]
  t, state, act = _random_tables(rng, 4, cfgs)
  b = int(rng.integers(1, 9))
  budget = None if seed % 2 else float(np.quantile((state + act)[np.isfinite(t)], 0.3))
  while budget is not None and stage_dp.brute_force(t, state, act, sizes, 8, b, budget=budget) is None:
    assert not stage_dp.solve(t, state, act, sizes, 8, b, budget=budget)[0]   # none fits: none found
    budget *= 1.25
  sols, _ = stage_dp.solve(t, state, act, sizes, 8, b, budget=budget)
  want = stage_dp.brute_force(t, state, act, sizes, 8, b, budget=budget)
  assert want is not None and sols
  assert sols[0].total == pytest.approx(want, rel=1e-12)
  assert all(s.total >= sols[0].total for s in sols)
  assert sum(cfgs[c].size for _, _, c in sols[0].stages) == 8


@pytest.mark.parametrize("seed", range(4))
def test_max_stages_binds_without_a_memory_budget(seed):
  rng = np.random.default_rng(100 + seed)
  cfgs = stage_dp.configs(2, 4)
  sizes = [c.size for c in cfgs]
  t, state, act = _random_tables(rng, 4, cfgs)
  b = int(rng.integers(2, 9))
  for limit in (1, 2):
    sols, _ = stage_dp.solve(t, state, act, sizes, 8, b, max_stages=limit)
    want = stage_dp.brute_force(t, state, act, sizes, 8, b, max_stages=limit)
    assert sols and all(len(s.stages) <= limit for s in sols)
    assert sols[0].total == pytest.approx(want, rel=1e-12)


def test_stage_program_matches_brute_force_on_measured_costs(traced):
  layers = clustering.cluster(traced, 4)
  pricer = stages.Pricer(traced, layers, traced.input_names[:-2], 4, CAL, 2, 10.0)
  cfgs = stage_dp.configs(2, 4)
  t, state, act = pricer.tables(cfgs)
  assert np.isfinite(t[np.triu_indices(4)]).all()
  sizes = [c.size for c in cfgs]
  free, _ = stage_dp.solve(t, state, act, sizes, 8, 4)
  assert free[0].total == pytest.approx(stage_dp.brute_force(t, state, act, sizes, 8, 4), rel=1e-12)
  n = len(free[0].stages)
  peak = max(state[i, j, c] + (n - q) * act[i, j, c] for q, (i, j, c) in enumerate(free[0].stages))
  budget, bound, fits_below = 0.5 * peak, False, False
  while True:   # budgets under the free plan's peak: the same optimum as brute force, or none for both
    sols, _ = stage_dp.solve(t, state, act, sizes, 8, 4, budget=budget)
    want = stage_dp.brute_force(t, state, act, sizes, 8, 4, budget=budget)
    if want is None:
      assert not sols
    else:
      assert sols[0].total == pytest.approx(want, rel=1e-12)
      bound |= want > free[0].total
      fits_below |= budget < peak
    budget *= 1.1
    if budget > peak:
      break
  # A plan that fits under the free plan's peak is another plan, no faster: some budget forced a slower one --
  # unless the free plan is already the leanest (the solver's layouts, and so the tables, can differ by load).
  assert bound or not fits_below


def _check_tiling(rows, cols, shapes):
  positions = stage_dp.tile(rows, cols, shapes)
  flat = sorted(p for ps in positions for p in ps)
  assert flat == list(range(rows * cols))                 # every device exactly once
  for (r, c), ps in zip(shapes, positions):
    assert len(ps) == r * c
    grid = sorted((p // cols, p % cols) for p in ps)
    rws = sorted(set(g[0] for g in grid))
    assert rws == list(range(rws[0], rws[0] + r))        # contiguous rows
    cs = sorted(set(g[1] for g in grid))
    assert cs == list(range(cs[0], cs[0] + c))            # a contiguous part of each row


def test_submeshes_tile_the_mesh():
  rng = np.random.default_rng(0)
  for rows, cols in ((2, 4), (4, 8), (8, 8), (32, 8)):
    shapes = stage_dp.submesh_shapes(rows, cols)
    assert all(c == cols or (r == 1 and cols % c == 0 and c & (c - 1) == 0) for r, c in shapes)
    for _ in range(30):
      left, pick = rows * cols, []
      while left:
        options = [s for s in shapes if s[0] * s[1] <= left]
        s = options[rng.integers(len(options))]
        pick.append(s)
        left -= s[0] * s[1]
      _check_tiling(rows, cols, pick)
  with pytest.raises(ValueError):
    stage_dp.tile(2, 4, [(1, 4), (1, 2)])
  assert stage_dp.logical_shapes(8) == [(1, 8), (2, 4)]


def _plan(cfg, mesh, layers, budget=None, microbatches=4):
  return gs.plan_stages(_loss(cfg), *_specs(cfg), mesh=mesh, layers=layers, microbatches=microbatches,
                        memory_budget=budget, calibration=PIPE)


def _check_plan(plan, mesh, layers):
  rows, cols = stage_dp.mesh_rows(mesh.shape)
  stages_ = plan.stages
  assert stages_[0].layers[0] == 0 and stages_[-1].layers[1] == layers - 1
  for a, b in zip(stages_, stages_[1:]):
    assert b.layers[0] == a.layers[1] + 1
  _check_tiling(rows, cols, [s.submesh for s in stages_])
  assert [p for s in stages_ for p in s.devices] != []
  for s in stages_:
    assert s.mesh.size == s.submesh[0] * s.submesh[1] == len(s.devices)
  lat = [s.seconds for s in stages_]
  assert plan.predicted_seconds == pytest.approx(sum(lat) + (plan.microbatches - 1) * max(lat))
  assert all(c.predicted_seconds >= plan.predicted_seconds for c in plan.runners_up)
  assert [s.in_flight for s in stages_] == list(range(len(stages_), 0, -1))


def test_plan_stages_small(traced):  # pylint: disable=unused-argument
  mesh = gs.Mesh((2, 4), ("host", "device"))
  plan = _plan(CFG, mesh, 6)
  _check_plan(plan, mesh, 6)
  text = str(plan)
  assert "stage plan: 6 layers" in text and "T* =" in text
  # The stages hand on what later stages read, laid out on their logical meshes.
  for a, b in zip(plan.stages, plan.stages[1:]):
    assert {r for r, _ in a.outputs} & {r for r, _ in b.inputs}
    for _, s in a.outputs + a.inputs + a.parameters:
      assert s.mesh == a.mesh
  params = [name for s in plan.stages for name, _ in s.parameters]
  assert "0/l0/wq" in params and "0/embed" in params


def test_memory_budget_forces_stages_or_names_the_smallest_feasible():
  mesh = gs.Mesh((2, 4), ("host", "device"))
  free = _plan(CFG, mesh, 6)
  peak = max(s.memory_bytes for s in free.stages)
  with pytest.raises(AutoShardingError, match="smallest feasible budget is") as e:
    _plan(CFG, mesh, 6, budget=1000)
  smallest = float(str(e.value).split("smallest feasible budget is ")[1].split(" B")[0].replace(",", ""))
  assert 1000 < smallest <= peak
  tight = _plan(CFG, mesh, 6, budget=int(smallest * 1.001) + 1)
  assert max(s.memory_bytes for s in tight.stages) <= smallest * 1.001 + 1
  with pytest.raises(AutoShardingError):
    _plan(CFG, mesh, 6, budget=int(smallest * 0.99))
  assert peak > smallest * 1.2   # a budget under the free plan's peak changes the plan
  mid = _plan(CFG, mesh, 6, budget=int((peak + smallest) / 2))
  assert max(s.memory_bytes for s in mid.stages) <= (peak + smallest) / 2
  assert [(s.layers, s.submesh) for s in mid.stages] != [(s.layers, s.submesh) for s in free.stages]
  assert mid.predicted_seconds >= free.predicted_seconds


def test_plan_mode_16_layers_on_64_devices_is_fast():
  cfg = tm.Config(layers=14, d_model=128, heads=4, d_ff=512, vocab=8192, seq=32, batch=16)
  mesh = gs.Mesh((8, 8), ("host", "device"))   # no such devices here: planned only
  start = time.perf_counter()
  plan = _plan(cfg, mesh, 16, microbatches=16)
  took = time.perf_counter() - start
  _check_plan(plan, mesh, 16)
  assert len(plan.stages) > 1
  assert plan.intra_solves < 16 * len({c.logical for c in stage_dp.configs(8, 8)})   # repeated blocks memoised
  assert took < 240, took


def test_calibration_is_measured_once_and_cached(tmp_path, monkeypatch):
  monkeypatch.setenv("TF_GSPMD_CALIBRATION", str(tmp_path / "c.json"))
  monkeypatch.setattr(calibrate, "_CACHE", {})
  c = calibrate.calibrate(timers=gs_stages.TIMERS)
  assert c.source == "measured" and 1e-14 < c.seconds_per_flop < 1e-8 and 1e-13 < c.seconds_per_byte < 1e-6
  assert 1e-6 < c.seconds_per_call < 1.0 and 1e-13 < c.seconds_per_transfer_byte < 1e-6
  assert c.parallel_devices == float("inf") or 1.0 <= c.parallel_devices <= 8
  assert (tmp_path / "c.json").exists()
  monkeypatch.setattr(calibrate, "_CACHE", {})
  assert calibrate.calibrate(timers=gs_stages.TIMERS) == c     # read back, not timed again


def test_plan_stages_checks_its_arguments():
  mesh = gs.Mesh((2, 4), ("host", "device"))
  with pytest.raises(InputError, match="microbatches"):
    gs.plan_stages(_loss(CFG), *_specs(CFG), mesh=mesh, layers=4, microbatches=0)
  with pytest.raises(InputError, match="params"):
    gs.plan_stages(_loss(CFG), *_specs(CFG), mesh=mesh, layers=4, params=(5,), calibration=CAL)


def test_stage_functions_compose_to_the_whole_forward(rng):
  cfg = CFG
  mesh = gs.Mesh((2, 4), ("host", "device"))
  plan = _plan(cfg, mesh, 6, microbatches=8)
  assert len(plan.stages) > 1
  params = {k: v for k, v in tm.init_params(cfg, seed=1).items()}
  tokens = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32)
  targets = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32)
  want = tf.function(_loss(cfg))(params, tf.constant(tokens), tf.constant(targets)).numpy()
  arguments = {f"0/{k}": tf.constant(v) for k, v in params.items()}
  arguments.update({"1": tf.constant(tokens), "2": tf.constant(targets)})
  acts = {}
  for k, stage in enumerate(plan.stages):
    fn = plan.stage_function(k)
    assert set(fn.outputs) == {r for r, _ in stage.outputs}
    out = fn(arguments, acts)
    for r, t in out.items():
      shape = plan.program.ir.info(r).shape
      assert tuple(t.shape) == shape
    acts.update(out)
  got = acts[plan.program.output_refs[0]].numpy()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  with pytest.raises(InputError, match="needs the activation"):
    plan.stage_function(len(plan.stages) - 1)(arguments, {})


def test_gradient_sync_priced_in_the_layer_plan():
  """A parameter left replicated costs its gradient's all-reduce: with it priced, a large weight read by a small
  batch is split instead (and its sync bytes are what the layout leaves replicated)."""
  def step(w, x):
    return tf.reduce_sum(tf.tanh(x @ w))

  specs = (tf.TensorSpec((1024, 1024), tf.float32), tf.TensorSpec((8, 1024), tf.float32))
  program, _, per_arg = trace_forward(step, specs, gs.Mesh((1, 8), ("host", "device")))
  layers = clustering.cluster(program, 1)
  for trained, split in ((per_arg[0], True), ((), False)):
    pricer = stages.Pricer(program, layers, trained, 1, CAL, 2, 10.0)
    cost = pricer.cost(0, (1, 8))
    w = cost.arguments[layers[0].arguments.index(per_arg[0][0] + ":0")]
    assert (w.num_tiles == 8) == split, w
    if trained:
      assert cost.sync_bytes == 0 and cost.state_bytes == 1024 * 1024 * 4 / 8
    else:
      assert cost.state_bytes == 0


def test_transfers_and_calls_are_priced(traced):
  """A stage's latency carries its entering boundary's cross-mesh moves (both ways), at the bytes each of its
  devices receives and a fixed cost per tensor and device, and two calls per microbatch; the cut after the
  vocabulary head (the logits cross) costs most, and pricing moves makes the planner cut where less crosses."""
  layers = clustering.cluster(traced, 6)
  cfgs = stage_dp.configs(2, 4)
  free = dataclasses.replace(CAL, seconds_per_call=0.0, seconds_per_transfer_byte=0.0, seconds_per_move=0.0)
  dear = dataclasses.replace(CAL, seconds_per_call=1e-3, seconds_per_transfer_byte=1e-8, seconds_per_move=1e-4)
  p_free = stages.Pricer(traced, layers, traced.input_names[:-2], 4, free, 2, 10.0)
  p_dear = stages.Pricer(traced, layers, traced.input_names[:-2], 4, dear, 2, 10.0)
  t_free, _, _ = p_free.tables(cfgs)
  t_dear, _, _ = p_dear.tables(cfgs)
  L = len(layers)
  crossing = {}
  for c, cfg in enumerate(cfgs):
    for i in range(L):
      for j in range(i, L):
        nbytes = p_dear.boundary_bytes(i, j, cfg.logical)
        entering = p_dear.entering[i]   # forward: every tensor; backward: the floating-point ones' gradients
        tensors = len(entering) + sum(traced.ir.info(r).dtype.is_floating for r in entering)
        moves = (2 * (nbytes * 1e-8 + 1e-3) + tensors * cfg.size * 1e-4) if i else 0.0
        assert t_dear[i, j, c] - t_free[i, j, c] == pytest.approx(2e-3 + moves, rel=1e-9, abs=1e-12)
        crossing[i] = max(crossing.get(i, 0.0), nbytes)
  # The logits [batch, seq, vocab] float32 cross (replicated or split) into the stage of the softmax.
  logits = CFG.batch * CFG.seq * CFG.vocab * 4
  cut = max(crossing, key=crossing.get)
  assert crossing[cut] >= logits / 8 and crossing[cut] > 4 * min(crossing[i] for i in range(1, L))

  def crossed(plan):
    first = {s.layers[0] for s in plan.stages[1:]}
    return sum(max(p_dear.boundary_bytes(i, j, s.mesh.shape) for s in plan.stages if s.layers[0] == i
                   for j in [s.layers[1]]) for i in first)

  cheap = gs.plan_stages(_loss(CFG), *_specs(CFG), mesh=gs.Mesh((2, 4), ("host", "device")), layers=6,
                         microbatches=4, calibration=free)
  priced = gs.plan_stages(_loss(CFG), *_specs(CFG), mesh=gs.Mesh((2, 4), ("host", "device")), layers=6,
                          microbatches=4, calibration=dear)
  assert crossed(cheap) >= crossing[cut]   # unpriced, the plan cuts where the logits cross
  assert crossed(priced) < crossed(cheap)
  # Each plan's price holds its own moves: the move-free plan priced with moves costs at least the chosen one.
  assert priced.predicted_seconds <= _repriced(p_dear, cfgs, cheap) * (1 + 1e-9)


def _repriced(pricer, cfgs, plan):
  t, _, _ = pricer.tables(cfgs)
  lat = []
  for s in plan.stages:
    c = next(k for k, g in enumerate(cfgs) if g.shape == s.submesh and g.logical == s.mesh.shape)
    lat.append(t[s.layers[0], s.layers[1], c])
  return stage_dp.latency(lat, plan.microbatches)


def test_devices_sharing_cores_serialise_the_pipeline():
  """With one device computing at a time, a stage's arithmetic grows with its submesh and the step is at least
  the microbatches' total work: a pipeline's overlap is not counted."""
  mesh = gs.Mesh((2, 4), ("host", "device"))
  shared = dataclasses.replace(PIPE, parallel_devices=1.0)
  plan = gs.plan_stages(_loss(CFG), *_specs(CFG), mesh=mesh, layers=6, microbatches=4, calibration=shared)
  lat = [s.seconds for s in plan.stages]
  assert plan.predicted_seconds == pytest.approx(max(sum(lat) + 3 * max(lat), 4 * sum(lat)))
  side_by_side = _plan(CFG, mesh, 6)
  assert plan.predicted_seconds > side_by_side.predicted_seconds


def test_measured_stages_replace_and_rescale_the_model():
  """Measured stage latencies replace the model's entries; the untimed entries of a measured submesh size are
  scaled by that size's median measured / model ratio (of all timed stages where none of the size was timed);
  `only` keeps the timed stages alone."""
  cfgs = stage_dp.configs(2, 4)
  rng = np.random.default_rng(3)
  t = rng.uniform(1e-3, 5e-3, (4, 4, len(cfgs)))
  kept = t.copy()
  one = next(c for c, cfg in enumerate(cfgs) if cfg.size == 1)
  two = next(c for c, cfg in enumerate(cfgs) if cfg.size == 2)
  measured = {(0, 1, cfgs[one].shape, cfgs[one].logical): 3 * t[0, 1, one],
              (2, 2, cfgs[one].shape, cfgs[one].logical): 5 * t[2, 2, one],
              (1, 3, cfgs[two].shape, cfgs[two].logical): 2 * t[1, 3, two],
              (0, 9, cfgs[two].shape, cfgs[two].logical): 1.0}   # (no such layer: ignored)
  got, hits = stages.with_measured(t, cfgs, measured)
  assert hits == {(0, 1, one), (2, 2, one), (1, 3, two)}
  assert got[0, 1, one] == measured[(0, 1, cfgs[one].shape, cfgs[one].logical)]
  assert got[1, 3, two] == pytest.approx(2 * t[1, 3, two])
  np.testing.assert_allclose(got[3, 3, one], 4 * t[3, 3, one])   # median of 3 and 5
  np.testing.assert_allclose(got[0, 0, two], 2 * t[0, 0, two])
  for c, cfg in enumerate(cfgs):
    if cfg.size > 2:   # no stage of this size was timed: the median of every ratio (3, 5, 2)
      np.testing.assert_allclose(got[:, :, c], 3 * t[:, :, c])
  assert np.array_equal(t, kept), "the model's table is not changed"
  only, _ = stages.with_measured(t, cfgs, measured, only=True)
  assert np.isfinite(only).sum() == 3 and only[2, 2, one] == measured[(2, 2, cfgs[one].shape, cfgs[one].logical)]
  assert stages.with_measured(t, cfgs, None)[0] is t


def test_a_plan_priced_with_measured_stages_marks_and_uses_them(traced):  # pylint: disable=unused-argument
  cfg = tm.Config(layers=2, d_model=32, heads=2, d_ff=64, vocab=64, seq=8, batch=4)
  mesh = gs.Mesh((2, 4), ("host", "device"))
  first = _plan(cfg, mesh, 4)
  # every stage of the model's choice measured 10x slower than priced: the plan is re-priced with them
  measured = {s.key: 10 * s.seconds for s in first.stages}
  again = gs.plan_stages(_loss(cfg), *_specs(cfg), mesh=mesh, layers=4, microbatches=4, calibration=PIPE,
                         measured=measured, measured_only=True)
  assert all(s.measured and s.model_seconds > 0 for s in again.stages)
  assert [(s.layers, s.submesh) for s in again.stages] == [(s.layers, s.submesh) for s in first.stages]
  lat = [10 * f.seconds for f in first.stages]
  assert [s.seconds for s in again.stages] == pytest.approx(lat)
  assert again.predicted_seconds == pytest.approx(stage_dp.latency(lat, 4))
  assert "measured (model " in str(again)
