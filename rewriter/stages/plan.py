"""Automatic stages and submeshes (Alpa's inter-operator level) over the intra-operator plans of `auto`.

`plan(program, ...)` takes a traced forward program (one microbatch) and:

1. clusters its ops into layers (`layers.cluster`);
2. enumerates the submeshes of the mesh and their logical shapes (`stage_dp.configs`);
3. prices every layer on every logical mesh by the intra-operator integer program (`auto.run` on the layer as a
   program of its own, `layers.subprogram`): its collective bytes per device, arithmetic per device, the layouts
   it chose and the memory they take. Layers that are the same computation (equal `Layer.signature`: a
   transformer's repeated blocks) are solved once per logical mesh. A stage's latency per microbatch
   (forward and backward) is then, from the calibrated constants (`calibrate`):
     4 x arithmetic x seconds_per_flop + 2 x collective bytes x seconds_per_byte
   summed over its layers (the runtime's backward reruns the forward under a tape and then does twice its
   arithmetic, with the transposes of its collectives), plus the reshards between consecutive layers whose
   plans lay a tensor out differently, plus its parameters' gradient all-reduce (over the mesh axes their
   layouts leave replicated) spread over the step's microbatches, plus what the pipeline's runtime adds per
   microbatch: two program calls (forward, backward) x seconds_per_call and, for every stage but the first, the
   move of its entering boundary across meshes and of its gradient back (`Pricer.boundary_seconds`: the bytes
   each destination device receives x seconds_per_transfer_byte, its tensors x its devices x seconds_per_move,
   and a call each way). Its memory per device is its parameters x (2 + optimizer slots) (weights, gradients,
   slots) plus one microbatch's activations (every tensor its ops make, at their layouts) per microbatch in
   flight;
4. solves Alpa's dynamic program (`stage_dp.solve`) for T* = sum t_i + (B - 1) max t_j under the memory budget.
   Where fewer devices compute at once than the mesh holds (`parallel_devices`: logical devices sharing cores),
   a stage's arithmetic takes size / parallel_devices times longer and its plans' steps are at least the
   microbatches' total work over the devices computing at once (`_on_shared_devices`), which re-ranks them.

The result, a `StagePlan`, names each stage's layers and ops, the tensors entering and leaving it with their
layouts on its logical mesh, its submesh (shape and device positions in the mesh), the layouts of its parameters,
its predicted latency and memory per device; with the runner-up plans. A runtime runs stage k as the program of
`StagePlan.stages[k].ops` on the devices `StagePlan.stages[k].devices`, laid out as `StagePlan.stages[k].mesh`.
"""

import dataclasses
import time
from typing import Any, Dict, Optional, Tuple

import numpy as np

from tf_gspmd._layout.mesh import Mesh
from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.errors import AutoShardingError
from tf_gspmd.rewriter.frontend import import_annotations
from tf_gspmd.rewriter.sharding import memory, reshard
from tf_gspmd.rewriter.stages import calibrate as calibration
from tf_gspmd.rewriter.stages import layers as clustering
from tf_gspmd.rewriter.stages import stage_dp
from tf_gspmd.rewriter.program import Options
from tf_gspmd.rewriter.sharding.auto.plan import AutoOptions, run as auto_run
from tf_gspmd.rewriter.graph.graph_view import ref

AXES = ("stage_x", "stage_y")   # the logical mesh axes of a stage's program


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """One layer on one logical mesh, from its intra-operator plan (quantities per device)."""

  flops: float                   # forward arithmetic (multiply-adds, elements of element-wise ops)
  collective_bytes: float        # forward collectives
  sync_bytes: float              # the gradient all-reduce of its parameters (once per step)
  state_bytes: float             # its parameters
  activation_bytes: float        # what one microbatch's forward makes (kept for the backward)
  arguments: Tuple[Any, ...]     # Sharding per `Layer.arguments`
  inputs: Tuple[Any, ...]        # Sharding per `Layer.inputs`
  outputs: Tuple[Any, ...]       # Sharding per `Layer.outputs`
  solve_seconds: float


@dataclasses.dataclass(frozen=True)
class Stage:
  layers: Tuple[int, int]                    # first and last layer
  ops: Tuple[str, ...]
  submesh: Tuple[int, int]                   # (rows, devices per row) of the mesh
  devices: Tuple[int, ...]                   # row-major positions in the mesh
  mesh: Mesh                                 # the logical mesh its program runs on (over `devices`, in order)
  inputs: Tuple[Tuple[str, Sharding], ...]   # tensors entering (from earlier stages or the program's data)
  outputs: Tuple[Tuple[str, Sharding], ...]  # tensors later stages read or the program returns
  parameters: Tuple[Tuple[str, Sharding], ...]
  seconds: float                             # predicted latency of one microbatch (forward + backward)
  memory_bytes: float                        # per device, with `in_flight` microbatches' activations
  in_flight: int
  model_seconds: Optional[float] = None      # the cost model's latency (differs from `seconds` when measured)
  measured: bool = False                     # `seconds` is a measured run of this stage on this submesh

  @property
  def key(self):
    """(first layer, last layer, submesh shape, logical shape): how `plan(measured=...)` names this stage."""
    return (self.layers[0], self.layers[1], tuple(self.submesh), tuple(self.mesh.shape))


@dataclasses.dataclass(frozen=True)
class Candidate:
  stages: Tuple[Stage, ...]
  predicted_seconds: float       # T* = sum t_i + (B - 1) max t_j

  @property
  def t_max(self):
    return max(s.seconds for s in self.stages)


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """What `plan` chose (`stages`, `predicted_seconds`) and the runner-up plans, with how it was found."""

  layers: Tuple[clustering.Layer, ...]
  mesh_shape: Tuple[int, int]
  microbatches: int
  memory_budget: Optional[float]
  best: Candidate
  runners_up: Tuple[Candidate, ...]
  calibration: calibration.Calibration
  timings: Dict[str, float]
  intra_solves: int              # intra-operator programs solved
  t_max_tried: int
  program: Any = dataclasses.field(default=None, repr=False, compare=False)   # the traced forward program
  names: Any = dataclasses.field(default=None, repr=False, compare=False)     # Placeholder -> readable name

  def stage_function(self, k):
    """Stage k as a callable fn(arguments, activations) -> activations (`stage_fn.stage_function`)."""
    from tf_gspmd.rewriter.stages.stage_fn import stage_function  # pylint: disable=g-import-not-at-top
    return stage_function(self, k)

  @property
  def stages(self):
    return self.best.stages

  @property
  def predicted_seconds(self):
    return self.best.predicted_seconds

  def __str__(self):
    budget = f", memory budget {self.memory_budget:,.0f} B/device" if self.memory_budget else ""
    lines = [f"stage plan: {len(self.layers)} layers on a {self.mesh_shape} mesh, {self.microbatches} microbatches"
             f"{budget}: {len(self.stages)} stage(s), predicted T* = {self.predicted_seconds * 1e3:.3f} ms "
             f"(sum t_i + (B-1) max t_j); {self.intra_solves} intra-operator programs solved, "
             f"{self.t_max_tried} t_max tried; " +
             ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items()),
             _table(self.stages, self.layers)]
    for k, c in enumerate(self.runners_up):
      desc = "; ".join(f"layers {s.layers[0]}-{s.layers[1]} on {s.submesh} as {s.mesh.shape}" for s in c.stages)
      lines.append(f"runner-up {k + 1}: T* = {c.predicted_seconds * 1e3:.3f} ms: {desc}")
    return "\n".join(lines)


def _table(stages, layers):
  head = (f"  {'stage':>5} {'layers':>9} {'ops':>5} {'submesh':>9} {'logical':>9} {'devices':>14} "
          f"{'t (ms)':>9} {'memory/device':>15} {'in flight':>9}")
  rows = [head]
  for k, s in enumerate(stages):
    devs = f"{s.devices[0]}..{s.devices[-1]}"
    rows.append(f"  {k:>5} {s.layers[0]:>4}-{s.layers[1]:<4} {len(s.ops):>5} {str(s.submesh):>9} "
                f"{str(s.mesh.shape):>9} {devs:>14} {s.seconds * 1e3:>9.3f} {s.memory_bytes:>15,.0f} {s.in_flight:>9}"
                + (f"   measured (model {s.model_seconds * 1e3:.3f})" if s.measured else ""))
    for name, sh in s.parameters[:6]:
      rows.append(f"        param {name}: {sh}")
    if len(s.parameters) > 6:
      rows.append(f"        ... {len(s.parameters) - 6} more parameters")
    for name, sh in s.inputs:
      rows.append(f"        in  {name}: {sh}")
    for name, sh in s.outputs:
      rows.append(f"        out {name}: {sh}")
  return "\n".join(rows)


def _sharding(annotations, r, mesh, rank):
  s = (annotations or {}).get(r)
  if s is None or s.is_maximal:
    return Sharding.replicated(mesh, rank)
  return s


class Pricer:
  """Layer costs on logical meshes (memoised by layer signature) and the tables the program solves."""

  def __init__(self, program, layers, params, microbatches, calib, slots, time_limit):
    self.program = program
    self.ir = program.ir
    self.layers = layers
    self.params = set(params)
    self.microbatches = microbatches
    self.calib = calib
    self.slots = slots
    self.time_limit = time_limit
    self.meshes = {}
    self.memo = {}
    self.solves = 0
    self.layer_of = {}
    for l in layers:
      for r in l.outputs:
        self.layer_of[r] = l.index
    self.entering = []   # per layer i: what layers >= i read that layers < i made (a stage's entering boundary)
    for i in range(len(layers)):
      read = {r for l in layers[i:] for r in l.inputs}
      self.entering.append(tuple(sorted(r for r in read if self.layer_of.get(r, i) < i)))

  def mesh(self, logical):
    if logical not in self.meshes:
      self.meshes[logical] = Mesh(logical, AXES)
    return self.meshes[logical]

  def _rank(self, r):
    info = self.ir.info(r)
    if info.partitionable:
      return len(info.shape)
    return len(info.value_shape) if info.value_shape is not None else 0

  def _bytes(self, r, sharding):
    info = self.ir.info(r)
    if info.partitionable:
      return memory.shard_bytes(info.shape, info.dtype, sharding)
    if info.value_shape is not None:   # a variable's handle: its value
      return memory.shard_bytes(info.value_shape, info.value_dtype, sharding)
    return 0

  def cost(self, k, logical):
    """The `LayerCost` of layer k on a logical mesh of shape `logical`."""
    layer = self.layers[k]
    key = (layer.signature, logical)
    hit = self.memo.get(key)
    if hit is not None:
      return hit
    mesh = self.mesh(logical)
    start = time.perf_counter()
    sub, renamed = clustering.subprogram(self.program, self.layers, k, k, mesh, None)
    params = tuple(n for n in sub.input_names + sub.variable_names if n in self.params)
    options = AutoOptions(arguments=(True,) * len(sub.input_names), flops_per_byte=self.calib.flops_per_byte,
                          time_limit=self.time_limit, gradient_sync=params,
                          gradient_weight=1.0 / self.microbatches)
    sub = sub.replace(options=Options(auto=options))
    sub = auto_run(import_annotations.run(sub))
    self.solves += 1
    ann = sub.annotations
    args = tuple(_sharding(ann, r, mesh, self._rank(r)) for r in layer.arguments)
    ins = tuple(_sharding(ann, ref(renamed[r].split(":")[0]), mesh, self._rank(r)) for r in layer.inputs)
    outs = tuple(_sharding(ann, r, mesh, self._rank(r)) for r in layer.outputs)
    sync = state = 0.0
    act = sum(self._bytes(r, s) for r, s in zip(layer.inputs, ins))
    for r, s in zip(layer.arguments, args):
      b = self._bytes(r, s)
      if r.split(":")[0] in self.params:
        state += b
        rest = mesh.size / s.num_tiles
        sync += 2 * (rest - 1) / rest * b
      else:
        act += b   # (data arguments arrive with each microbatch)
    for name in layer.ops:
      node = self.ir.node(name)
      for o in range(len(node.outputs)):
        r = node.ref(o)
        act += self._bytes(r, _sharding(ann, r, mesh, self._rank(r)))
    plan = sub.auto_plan
    other = plan.predicted_cost - plan.predicted_bytes - sync / self.microbatches
    hit = LayerCost(flops=max(other, 0.0) * self.calib.flops_per_byte, collective_bytes=float(plan.predicted_bytes),
                    sync_bytes=sync, state_bytes=state, activation_bytes=act, arguments=args, inputs=ins,
                    outputs=outs, solve_seconds=time.perf_counter() - start)
    self.memo[key] = hit
    return hit

  def seconds(self, c, size=1):
    """Latency of one layer's forward + backward for one microbatch (its sync spread over the microbatches) on
    `size` devices, of which `parallel_devices` compute at once."""
    cal = self.calib
    return (4 * c.flops * cal.seconds_per_flop * max(1.0, size / cal.parallel_devices) + 2 * c.collective_bytes * cal.seconds_per_byte
            + c.sync_bytes * cal.seconds_per_byte / self.microbatches)

  def boundary_seconds(self, i, j, logical):
    """The cross-mesh moves a stage of layers i..j (i > 0) adds per microbatch: its entering boundary arrives
    (forward) and the gradients of its floating-point tensors return (backward), each destination device
    receiving `boundary_bytes` and paying `seconds_per_move` per tensor, with a call each way."""
    if i == 0:
      return 0.0
    cal = self.calib
    moved = self.boundary_bytes(i, j, logical) + self.boundary_bytes(i, j, logical, floating_only=True)
    tensors = len(self.entering[i]) + sum(self.ir.info(r).dtype.is_floating for r in self.entering[i])
    return (moved * cal.seconds_per_transfer_byte + tensors * logical[0] * logical[1] * cal.seconds_per_move
            + 2 * cal.seconds_per_call)

  def boundary_bytes(self, i, j, logical, floating_only=False):
    """Bytes each device of a stage of layers i..j receives per microbatch of what layers >= i read that layers
    < i made (`floating_only`: of its floating-point tensors, whose gradients return). Each tensor travels in its
    own dtype, in the layout of the stage's first layer reading it (replicated when the stage only passes it
    on)."""
    if i == 0:
      return 0.0
    total = 0
    for r in self.entering[i]:
      if floating_only and not self.ir.info(r).dtype.is_floating:
        continue
      reader = next((k for k in range(i, j + 1) if r in self.layers[k].inputs), None)
      if reader is None:
        total += self._bytes(r, Sharding.replicated(self.mesh(logical), self._rank(r)))
      else:
        total += self._bytes(r, self.cost(reader, logical).inputs[self.layers[reader].inputs.index(r)])
    return float(total)

  def edge_seconds(self, j, q, logical):
    """The reshard of layer j's entering tensor q from its producer's layout to the one layer j's plan takes."""
    layer = self.layers[j]
    r = layer.inputs[q]
    p = self.layer_of[r]
    src = self.cost(p, logical).outputs[self.layers[p].outputs.index(r)]
    dst = self.cost(j, logical).inputs[q]
    if src == dst:
      return p, 0.0
    info = self.ir.info(r)
    nbytes = reshard.plan_cost(tuple(info.shape), info.dtype.size, src, dst)[0]
    return p, 2 * nbytes * self.calib.seconds_per_byte

  def tables(self, cfgs):
    """(t, state, act) over [first layer, last layer, configuration] (inf where j < i)."""
    L, C = len(self.layers), len(cfgs)
    t = np.full((L, L, C), np.inf)
    state = np.zeros((L, L, C))
    act = np.zeros((L, L, C))
    logicals = sorted(set(c.logical for c in cfgs))
    col = {g: [k for k, c in enumerate(cfgs) if c.logical == g] for g in logicals}
    for g in logicals:
      costs = [self.cost(k, g) for k in range(L)]
      lat = np.array([self.seconds(c, g[0] * g[1]) for c in costs])
      st = np.array([c.state_bytes * (2 + self.slots) for c in costs])
      ac = np.array([c.activation_bytes for c in costs])
      edges = [[self.edge_seconds(j, q, g) for q in range(len(self.layers[j].inputs))] for j in range(L)]
      calls = 2 * self.calib.seconds_per_call   # (a forward and a backward call per microbatch)
      for i in range(L):
        total, s_sum, a_sum = calls, 0.0, 0.0
        for j in range(i, L):
          total += lat[j] + sum(e for p, e in edges[j] if p >= i)
          s_sum += st[j]
          a_sum += ac[j]
          t[i, j, col[g]] = total + self.boundary_seconds(i, j, g)
          state[i, j, col[g]] = s_sum
          act[i, j, col[g]] = a_sum
    return t, state, act


def _names(program, names):
  return lambda r: names.get(r.split(":")[0], r.split(":")[0]) if names else r


def _describe(pricer, cfgs, rows, cols, sol, names, model_t=None, measured=frozenset()):
  """A Solution of the program as a Candidate: the stages, their tensors, layouts and devices (`model_t`: the
  model's latency table, where `measured` {(i, j, c)} replaced some of its figures)."""
  shapes = [cfgs[c].shape for _, _, c in sol.stages]
  positions = stage_dp.tile(rows, cols, shapes)
  layers = pricer.layers
  ir = pricer.ir
  out = []
  n = len(sol.stages)
  for q, ((i, j, c), lat, devs) in enumerate(zip(sol.stages, sol.latencies, positions)):
    cfg = cfgs[c]
    costs = [pricer.cost(k, cfg.logical) for k in range(i, j + 1)]
    ops = tuple(o for k in range(i, j + 1) for o in layers[k].ops)
    inside = set(ops)
    entering, params, leaving = {}, {}, {}
    for k, cost in zip(range(i, j + 1), costs):
      layer = layers[k]
      for r, s in zip(layer.inputs, cost.inputs):
        if r.split(":")[0] not in inside:
          entering.setdefault(r, s)
      for r, s in zip(layer.arguments, cost.arguments):
        if r.split(":")[0] in pricer.params:
          params.setdefault(names(r), s)
        else:
          entering.setdefault(names(r), s)
      later = set()
      for l in layers[j + 1:]:
        later.update(l.inputs)
      for r, s in zip(layer.outputs, cost.outputs):
        if r in later or r in ir.outputs:
          leaving.setdefault(r, s)
    mem = sum(x.state_bytes for x in costs) * (2 + pricer.slots) + (n - q) * sum(x.activation_bytes for x in costs)
    mesh = Mesh(cfg.logical, AXES)
    out.append(Stage(layers=(i, j), ops=ops, submesh=cfg.shape, devices=tuple(devs), mesh=mesh,
                     inputs=tuple(entering.items()), outputs=tuple(leaving.items()), parameters=tuple(params.items()),
                     seconds=lat, memory_bytes=mem, in_flight=n - q,
                     model_seconds=float(model_t[i, j, c]) if model_t is not None else lat,
                     measured=(i, j, c) in measured))
  return Candidate(stages=tuple(out), predicted_seconds=sol.total)


def plan(program, *, layers, microbatches=1, memory_budget=None, params=(), calib=None, timers=None,
         optimizer_slots=2, max_stages=None, t_max_step=0.005, solver_time_limit=10.0, names=None, whole_mesh=False,
         measured=None, measured_only=False, max_stage_rows=None):
  """The StagePlan of `program` (traced, imported: `program.ir`) on `program.mesh` (see the module docstring).

  calib: a `calibrate.Calibration`, else this machine's, timed with `timers` (`calibrate.Timers`).
  whole_mesh: price only configurations of the whole mesh (with max_stages=1: the intra-operator plan alone).
  max_stage_rows: submeshes of at most this many rows (1: every stage within one row, e.g. one process's devices).
  layers: how many layers to cluster the ops into. params: Placeholder names of the parameters (trained: their
  gradients are all-reduced, their optimizer state kept). names: {Placeholder name: readable name}.
  measured: {(first layer, last layer, submesh shape, logical shape): seconds per microbatch} of stages timed on
  this machine (`with_measured`), used in place of the model's latencies; `measured_only`: plans of those
  stages alone.
  """
  timings = {}
  start = time.perf_counter()
  calib = calib or calibration.calibrate(timers=timers)
  timings["calibration"] = time.perf_counter() - start
  rows, cols = stage_dp.mesh_rows(program.mesh.shape)
  start = time.perf_counter()
  found = clustering.cluster(program, layers)
  timings["clustering"] = time.perf_counter() - start
  start = time.perf_counter()
  pricer = Pricer(program, found, params, microbatches, calib, optimizer_slots, solver_time_limit)
  cfgs = [c for c in stage_dp.configs(rows, cols) if (not whole_mesh or c.size == rows * cols) and
          (max_stage_rows is None or c.shape[0] <= max_stage_rows)]
  if not cfgs:
    raise AutoShardingError(f"no submesh of the {program.mesh.shape} mesh is both the whole mesh (whole_mesh) and at "
                            f"most {max_stage_rows} row(s) (max_stage_rows)", node=getattr(program.fn, "__name__",
                                                                                             "the step"))
  model_t, state, act = pricer.tables(cfgs)
  t, hits = with_measured(model_t, cfgs, measured, measured_only)
  timings["intra-operator costs"] = time.perf_counter() - start
  start = time.perf_counter()
  sols, tried = stage_dp.solve(t, state, act, [c.size for c in cfgs], rows * cols, microbatches,
                               budget=memory_budget, max_stages=max_stages, step=t_max_step)
  timings["stage program"] = time.perf_counter() - start
  sols = _on_shared_devices(sols, cfgs, calib, rows * cols, microbatches)
  if not sols:
    smallest = _smallest_budget(t, state, act, cfgs, rows * cols, max_stages)
    raise AutoShardingError(
        f"no stages fit memory_budget={memory_budget:,.0f} B per device on the {program.mesh.shape} mesh "
        f"({len(found)} layers, {microbatches} microbatches, parameters x {2 + optimizer_slots} plus the activations "
        f"of the microbatches in flight): the smallest feasible budget is {smallest:,.0f} B; raise the budget, "
        f"use more devices or fewer optimizer slots", node=getattr(program.fn, "__name__", "the step"))
  namer = _names(program, names)
  cands = [_describe(pricer, cfgs, rows, cols, s, namer, model_t, hits) for s in sols]
  return StagePlan(layers=found, mesh_shape=(rows, cols), microbatches=microbatches, memory_budget=memory_budget,
                   best=cands[0], runners_up=tuple(cands[1:]), calibration=calib, timings=timings,
                   intra_solves=pricer.solves, t_max_tried=tried, program=program, names=names)


def with_measured(t, cfgs, measured, only=False):
  """(t', hits): the latency table with measured stage runs in place of the model's figures, and the (i, j, c)
  entries replaced. `measured`: {(first layer, last layer, submesh shape, logical shape): seconds per microbatch}
  (Alpa times its candidate stages; here the stages of the plans chosen so far are timed, see gs.auto_parallel).
  The model's figures of the stages not timed are scaled by the median measured / model ratio of the stages
  timed on a submesh of their size (of all timed stages where none was), so what the model misses on small
  submeshes (per-op costs that arithmetic does not count, one core per device) steers the choice among the
  untimed ones too. `only`: the stages not timed are left out (infinite latency)."""
  if not measured:
    return t, frozenset()
  t = t.copy()
  index = {(c.shape, c.logical): k for k, c in enumerate(cfgs)}
  ratios, hits = {}, {}
  for (i, j, shape, logical), seconds in measured.items():
    c = index.get((tuple(shape), tuple(logical)))
    if c is None or not (0 <= i <= j < t.shape[0]) or not np.isfinite(t[i, j, c]) or t[i, j, c] <= 0:
      continue
    ratios.setdefault(cfgs[c].size, []).append(seconds / t[i, j, c])
    hits[(i, j, c)] = seconds
  everywhere = float(np.median([r for rs in ratios.values() for r in rs])) if ratios else 1.0
  for c, cfg in enumerate(cfgs):
    t[:, :, c] = np.inf if only else t[:, :, c] * (float(np.median(ratios[cfg.size])) if cfg.size in ratios
                                                     else everywhere)
  for (i, j, c), seconds in hits.items():
    t[i, j, c] = seconds
  return t, frozenset(hits)


def _on_shared_devices(sols, cfgs, calib, devices, microbatches):
  """Each plan's step where fewer than all devices compute at once (`parallel_devices`): stages on a submesh of
  s devices keep min(s, P) of the P computing at a time busy for their latency, so the step is at least the
  microbatches' total of that work over P (stages that share the cores overlap only as far as they leave some
  free); plans re-ranked by it."""
  par = calib.parallel_devices
  if not np.isfinite(par) or par >= devices:
    return sols
  out = []
  for sol in sols:
    work = sum(lat * min(cfgs[c].size, par) for (_, _, c), lat in zip(sol.stages, sol.latencies))
    out.append(dataclasses.replace(sol, total=max(sol.total, microbatches * work / par)))
  return sorted(out, key=lambda p: (p.total, len(p.stages)))


def _smallest_budget(t, state, act, cfgs, devices, max_stages):
  """The least memory budget under which some plan exists (bisection over the program's feasibility)."""
  finite = np.isfinite(t)
  hi = float((state + act * t.shape[0])[finite].max()) * 2 + 1
  lo = 0.0
  t = np.where(finite, 1.0, np.inf)   # (only whether a plan exists matters)
  sizes = [c.size for c in cfgs]
  for _ in range(60):
    mid = (lo + hi) / 2
    sols, _ = stage_dp.solve(t, state, act, sizes, devices, 1, budget=mid, max_stages=max_stages, keep=1)
    if sols:
      hi = mid
    else:
      lo = mid
    if hi - lo <= max(1.0, hi * 1e-3):
      break
  return hi
