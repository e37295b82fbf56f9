"""The auto_shard pass and what it reports: the options, the plan chosen (`AutoPlan`), a plan's memory.

`run` builds the model (`model.Builder`), folds repeated layers and solves (`solver`), then pins the chosen
layouts in the program's annotations and records each op's chosen strategy in `AutoPlan.planned`, which the
partitioner hands to the op's rule (`PartitionContext.planned_axes`).

Memory is `rewriter.sharding.memory`'s count of the program at the plan's layouts (`plan_memory`): arguments, variables,
constants and the activations live at the peak, loop bodies and the lists loops keep for the backward
included. The model bounds the live bytes of a few ops (`budget`); `_solve` adds the row of the op a chosen plan
peaks at when that is over the budget, then completes the plan and counts it as `plan_memory` does, and solves
again while that count is over (the per-device program's estimate adds what partitioning adds to it).
"""

import dataclasses
import time
import warnings
from typing import Any, Optional, Tuple

import numpy as np

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.errors import AutoShardingError
from tf_gspmd.rewriter.sharding import completion, memory
from tf_gspmd.rewriter.sharding.auto.budget import MemoryRow
from tf_gspmd.rewriter.sharding.auto.model import Builder, local_elements
from tf_gspmd.rewriter.sharding.auto.solver import TIMED_OUT, evaluate, fold, local_delta, solve

AUTO = "auto"   # the in_shardings entry that leaves an argument's layout to this pass


@dataclasses.dataclass(frozen=True)
class AutoOptions:
  """What `in_shardings="auto"` asks for (see `gs.function`)."""

  arguments: Tuple[bool, ...] = ()                 # per argument: its layout is chosen here
  memory_budget: Optional[int] = None              # bytes per device of the plan's count (`plan_memory`)
  axis_cost: Tuple[Tuple[str, float], ...] = ()    # time per byte over a mesh axis, relative (default 1.0)
  flops_per_byte: float = 1000.0                   # device arithmetic per link byte
  time_limit: float = 60.0                         # seconds the solver may take (then the deterministic
                                                   # fallback, `solver.local_search`)
  pin_intermediates: bool = True                   # pin every modelled tensor and op strategy, not only the
                                                   # arguments and variables (the partitioner then does what the
                                                   # program priced)
  gradient_sync: Tuple[str, ...] = ()              # inputs (Placeholder names) whose gradients a training step
                                                   # all-reduces over the mesh axes their layout leaves replicated
  gradient_weight: float = 1.0                     # ... priced at this many times those all-reduces' bytes


@dataclasses.dataclass(frozen=True)
class Choice:
  """The layout chosen for one argument or variable, with the best alternative (everything else as chosen)."""

  name: str
  kind: str                       # "argument" or "variable"
  shape: Tuple[int, ...]
  sharding: Sharding
  bytes_per_device: int
  runner_up: Optional[Sharding]
  runner_up_extra: float          # objective increase of the runner-up (byte-equivalents per step)
  runner_up_bytes_per_device: Optional[int]

  def __str__(self):
    alt = (f"{str(self.runner_up):28s} +{self.runner_up_extra:,.0f}" if self.runner_up is not None
           else "(no other layout)")
    return (f"{self.kind:8s} {self.name:40s} {str(list(self.shape)):16s} {str(self.sharding):28s} "
            f"{self.bytes_per_device:>12,} B  runner-up {alt}")


@dataclasses.dataclass(frozen=True)
class AutoPlan:
  """What the solver chose and why (`Lowered.auto_plan`)."""

  choices: Tuple[Choice, ...]
  predicted_bytes: int             # bytes per device of the reshards and partial sums the plan implies
  predicted_cost: float            # the objective: weighted bytes + arithmetic / flops_per_byte
  state_bytes_per_device: int      # arguments and variables per device
  activation_bytes_per_device: int  # activations live at the peak, per device (see memory_bytes_per_device)
  memory_budget: Optional[int]
  groups: int
  strategies: int
  blocks: int                      # one-hot blocks (groups and op strategies) before repeated layers are folded
  folded_blocks: int               # ... and after
  variables: int                   # columns of the program
  constraints: int                 # rows of the program
  build_seconds: float
  solve_seconds: float
  status: str
  constant_bytes_per_device: int = 0
  memory_rounds: int = 1            # programs solved (more where a plan the model chose was over the budget)
  timed_out: bool = False           # the solver ran out of time: the plan is `solver.local_search`'s
  planned: Any = dataclasses.field(default=None, repr=False, compare=False)  # node name -> {factor: axes}

  @property
  def memory_bytes_per_device(self):
    """The plan's count: under a budget, counted as `plan_memory` counts it (the plan completed); without one, as
    the model prices it (loop bodies and kept lists at the share of their loop's operands)."""
    return self.state_bytes_per_device + self.constant_bytes_per_device + self.activation_bytes_per_device

  def __str__(self):
    budget = f" (budget {self.memory_budget:,} B, {self.memory_rounds} round(s))" if self.memory_budget else ""
    lines = [f"auto sharding: predicted {self.predicted_bytes:,} B/device per step; memory per device "
             f"{self.memory_bytes_per_device:,} B: arguments and variables {self.state_bytes_per_device:,} + "
             f"constants {self.constant_bytes_per_device:,} + activations live at the peak "
             f"{self.activation_bytes_per_device:,}{budget}; {self.groups} groups, {self.strategies} op "
             f"strategies ({self.blocks} blocks, {self.folded_blocks} after folding repeated layers), program "
             f"{self.variables} columns x {self.constraints} rows, built in "
             f"{self.build_seconds:.1f} s, solved in {self.solve_seconds:.1f} s ({self.status})"]
    lines += [f"  {c}" for c in self.choices]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Memory of a plan and the pass


def plan_memory(program):
  """(arguments and variables, constants and the activations live at the peak) in bytes per device of a lowered
  program at its layouts; their sum is the plan's count, what `memory_budget` bounds (`rewriter.sharding.memory`'s rules
  on the global graph, every tensor at its layout: `memory.plan_estimate` has the breakdown). The per-device
  program holds this plus what partitioning adds (`report.memory`, an Account, states both)."""
  count = memory.plan_estimate(program)
  state = count.argument_bytes + count.state_bytes
  return state, count.peak_bytes - state


_ROUNDS = 6   # programs solved at most: each round bounds the op a chosen plan peaks at


def _fits(row, state, choice, b, i, budget):
  """Whether `row` stays within `budget` with block b taking choice i instead (every other block as chosen)."""
  used = row.value(state, choice)
  mem = np.asarray(row.total(state, b), dtype=float)
  return not mem.ndim or used - mem[choice[b]] + mem[i] <= budget


def _keeps(annotation, open_dims, cand):
  """Whether layout `cand` keeps what an annotation leaving `open_dims` open pins (and only adds to its open dims)."""
  if annotation.is_maximal or cand.is_maximal or annotation.rank != cand.rank:
    return False
  return all(c[:len(a)] == a if d in open_dims else c == a
             for d, (a, c) in enumerate(zip(annotation.dims, cand.dims)))


def _pins(program, builder, choice):
  """(annotations, open dims, {auto-laid argument or variable ref}) of the plan `choice`: the program's own, the
  chosen layouts of the arguments marked "auto" and of the variables not stored sharded, and with
  `pin_intermediates` those of every tensor the model priced -- an annotation that leaves dims open too, where the
  chosen layout keeps what it pins (its dims then closed), so completion lays out what the model priced."""
  options = program.options.auto
  auto_args = {name for k, name in enumerate(program.input_names)
               if k < len(options.arguments) and options.arguments[k]}
  free_vars = {name for name, pin in zip(program.variable_names, program.variable_pins or ()) if pin is None}
  annotations, open_dims, chosen = dict(program.annotations), dict(program.open_dims or {}), set()
  for g in builder.groups.values():
    for _, kind, r in g.state:
      name = r.split(":")[0]
      if (kind == "argument" and name in auto_args) or (kind == "variable" and name in free_vars):
        annotations[r] = g.cands[choice[g.id]]
        chosen.add(r)
  if options.pin_intermediates:
    for g in builder.groups.values():
      cand = g.cands[choice[g.id]]
      for r in g.members:
        if r not in annotations:
          annotations[r] = cand
        elif r in open_dims and _keeps(annotations[r], open_dims[r], cand):
          annotations[r] = cand
          del open_dims[r]
  return annotations, open_dims, chosen


def _solve(program, builder, model, folded, of):
  """(choice per block, status, columns, rows, seconds, rounds, the plan's count or None) under the budget: solved
  again with the row of the op the chosen plan peaks at while that op's live bytes exceed the budget. The plan the
  model finds within it is then completed and counted as `plan_memory` counts it (`memory.Layouts`); over the
  budget, the model's loop bodies and kept lists (priced at the share of their operands) are scaled to what they
  take at the layouts completion gives them -- or, where they are not what the model missed, every row is raised
  by what it missed -- and it is solved again."""
  budget, time_limit = program.options.auto.memory_budget, program.options.auto.time_limit
  start, count, status = time.perf_counter(), None, ""
  for rounds in range(1, _ROUNDS + 1):
    # Once out of time, every later round takes the fallback too (a fresh second for the solver would make the
    # plan depend on the machine's speed again).
    left = 0.0 if status.startswith(TIMED_OUT) else max(0.0, time_limit - (time.perf_counter() - start))
    choice, status, ncol, nrow, _ = solve(folded, budget, left)
    if choice is None:
      break
    choice = [choice[of[b]] for b in range(len(model.sizes))]
    if budget is None or not model.rows:
      break
    step, row = builder.peak(choice)
    if row.value(model.state, choice) > budget and all(r.step != step for r in model.rows) and rounds < _ROUNDS:
      model.rows.append(row)
      folded.rows.append(row.folded(of))
      continue
    annotations, open_dims, _ = _pins(program, builder, choice)
    layouts = memory.Layouts(completion.run(program.replace(annotations=annotations, open_dims=open_dims)))
    count = layouts.count()
    if count.peak_bytes <= budget or rounds == _ROUNDS:
      break
    if not builder.calibrate(layouts, choice):
      builder.margin += count.peak_bytes - row.value(model.state, choice)
    model.rows[:] = [builder.row(r.step) for r in model.rows]
    folded.rows[:] = [r.folded(of) for r in model.rows]
  return choice, status, ncol, nrow, time.perf_counter() - start, rounds, count


def run(program):
  """Pass: choose the layouts left to it (AutoOptions in program.options.auto) and pin them."""
  options = program.options.auto
  if options is None:
    return program
  t0 = time.perf_counter()
  builder = Builder(program, options)
  model = builder.build()
  built = time.perf_counter() - t0
  budget = options.memory_budget
  folded, of = fold(model)
  choice, status, ncol, nrow, took, rounds, count = _solve(program, builder, model, folded, of)
  timed_out = status.startswith(TIMED_OUT)
  if choice is None and timed_out:
    raise AutoShardingError(
        f"the sharding solver ran out of time (solver_time_limit={options.time_limit:g} s) before it found a plan "
        f"within memory_budget={budget:,} B per device, and the deterministic fallback (every layout split as far "
        f"as it divides, then improved) does not fit it either: raise solver_time_limit, or the budget")
  if timed_out:
    warnings.warn(f"tf_gspmd: the sharding solver ran out of time (solver_time_limit={options.time_limit:g} s) "
                  f"before it proved a plan optimal; the layouts are the deterministic fallback's (the same for the "
                  f"same call), which may move more bytes: raise solver_time_limit for the solver's plan",
                  stacklevel=2)
  if choice is None:
    need = max(sum(float(np.asarray(row.total(model.state, b)).min()) for b in set(model.state) | set(row.terms))
               + row.fixed for row in model.rows or [MemoryRow(None)])
    raise AutoShardingError(
        f"no layout fits memory_budget={budget:,} B per device (arguments, variables, constants and the activations "
        f"live at the peak: the smallest possible is {need:,.0f} B, each split over the whole mesh as far as it "
        f"divides; solver status: {status}): raise the budget, use a larger mesh, or pin some layouts by hand"
        if budget is not None else
        f"the sharding program could not be solved (solver status: {status})")
  predicted_cost, predicted_bytes = evaluate(model, choice)
  annotations, open_dims, chosen_refs = _pins(program, builder, choice)
  choices = []
  state_bytes = 0
  for g in builder.groups.values():
    chosen = g.cands[choice[g.id]]
    for label, kind, r in g.state:
      state_bytes += local_elements(g.shape, chosen) * builder.itemsize(r)
      if r in chosen_refs:
        delta = local_delta(model, choice, g.id)
        order = [i for i in np.argsort(delta, kind="stable") if i != choice[g.id]]
        if budget is not None:
          order = [i for i in order if all(_fits(row, model.state, choice, g.id, i, budget) for row in model.rows)]
        alt = order[0] if order else None
        choices.append(Choice(
            name=label, kind=kind, shape=g.shape, sharding=chosen,
            bytes_per_device=local_elements(g.shape, chosen) * builder.itemsize(r),
            runner_up=g.cands[alt] if alt is not None else None,
            runner_up_extra=float(delta[alt] - delta[choice[g.id]]) if alt is not None else 0.0,
            runner_up_bytes_per_device=(local_elements(g.shape, g.cands[alt]) * builder.itemsize(r)
                                        if alt is not None else None)))
  strategies = {}
  if options.pin_intermediates:
    for node, rows, b, _ in builder.strategies:
      strategies[node.name] = rows[choice[b]][0]
    for node, rows, u, v, best in builder.unary:
      strategies[node.name] = rows[int(best[choice[u], choice[v]])][0]
  choices.sort(key=lambda c: (c.kind != "argument", c.name))
  if count is not None:   # (the plan counted as plan_memory counts it)
    constants, activations = count.constant_bytes, count.activation_bytes
    state_bytes = count.argument_bytes + count.state_bytes
  else:   # the model's price of it
    constants = builder.sim.constant_bytes + builder.margin
    peak_row = builder.peak(choice)[1] if model.rows else MemoryRow(None)
    activations = peak_row.value(model.state, choice) - state_bytes - constants
  plan = AutoPlan(choices=tuple(choices), predicted_bytes=int(round(predicted_bytes)),
                  predicted_cost=predicted_cost, state_bytes_per_device=int(state_bytes),
                  activation_bytes_per_device=int(round(activations)), constant_bytes_per_device=int(constants),
                  memory_rounds=rounds,
                  memory_budget=budget, groups=len(builder.groups), strategies=len(builder.strategies),
                  blocks=len(model.sizes), folded_blocks=len(folded.sizes),
                  variables=ncol, constraints=nrow, build_seconds=built, solve_seconds=took, status=status,
                  planned=strategies, timed_out=timed_out)
  return program.replace(annotations=annotations, open_dims=open_dims, auto_plan=plan)
