"""The auto_shard pass and what it reports: the options, the plan chosen (`AutoPlan`), a plan's memory.

`run` builds the model (`model.Builder`), folds repeated layers and solves (`solver`), then pins the chosen
layouts in the program's annotations and records each op's chosen strategy in `AutoPlan.planned`, which the
partitioner hands to the op's rule (`PartitionContext.planned_axes`).
"""

import dataclasses
import time
from typing import Any, Optional, Tuple

import numpy as np

from tf_gspmd._sharding import Sharding
from tf_gspmd.errors import AutoShardingError
from tf_gspmd.rewriter.auto.model import Builder, live_at_peak, local_elements
from tf_gspmd.rewriter.auto.solver import evaluate, fold, local_delta, solve
from tf_gspmd.rewriter.graph_view import ref

AUTO = "auto"   # the in_shardings entry that leaves an argument's layout to this pass


@dataclasses.dataclass(frozen=True)
class AutoOptions:
  """What `in_shardings="auto"` asks for (see `gs.function`)."""

  arguments: Tuple[bool, ...] = ()                 # per argument: its layout is chosen here
  memory_budget: Optional[int] = None              # bytes per device: arguments, variables, live activations
  axis_cost: Tuple[Tuple[str, float], ...] = ()    # time per byte over a mesh axis, relative (default 1.0)
  flops_per_byte: float = 1000.0                   # device arithmetic per link byte
  time_limit: float = 60.0                         # seconds the solver may take (then its best plan so far)
  pin_intermediates: bool = True                   # pin every modelled tensor and op strategy, not only the
                                                   # arguments and variables (the partitioner then does what the
                                                   # program priced)


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
  activation_bytes_per_device: int  # activations live at the peak (estimated), per device
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
  planned: Any = dataclasses.field(default=None, repr=False, compare=False)  # node name -> {factor: axes}

  def __str__(self):
    budget = f" (budget {self.memory_budget:,} B)" if self.memory_budget else ""
    lines = [f"auto sharding: predicted {self.predicted_bytes:,} B/device per step; memory per device: arguments "
             f"and variables {self.state_bytes_per_device:,} B + activations live at the peak (estimated) "
             f"{self.activation_bytes_per_device:,} B{budget}; {self.groups} groups, {self.strategies} op "
             f"strategies ({self.blocks} blocks, {self.folded_blocks} after folding repeated layers), program "
             f"{self.variables} columns x {self.constraints} rows, built in "
             f"{self.build_seconds:.1f} s, solved in {self.solve_seconds:.1f} s ({self.status})"]
    lines += [f"  {c}" for c in self.choices]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Memory of a plan and the pass


def plan_memory(program):
  """(arguments and variables, live activations) in bytes per device of a lowered program's layouts, measured as
  the memory_budget is: what the unpartitioned program holds at its peak, each tensor at its layout."""
  ir = program.ir
  state = 0
  for name in list(program.input_names) + [n for n in program.variable_names if n not in program.input_names]:
    info = ir.info(ref(name))
    shape = info.shape if info.partitionable else info.value_shape
    if shape is None:
      continue
    dtype = info.dtype if info.partitionable else info.value_dtype
    state += local_elements(tuple(shape), program.shardings[ref(name)].tiled(len(shape))) * dtype.size
  live, activations = live_at_peak(program, ir)
  for r, nbytes in live.items():
    info = ir.info(r)
    s = program.shardings.get(r)
    activations += nbytes if s is None or not info.partitionable else (
        local_elements(tuple(info.shape), s.tiled(len(info.shape))) * info.dtype.size)
  return int(state), int(activations)


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
  choice, status, ncol, nrow, took = solve(folded, budget, options.time_limit)
  if choice is not None:
    choice = [choice[of[b]] for b in range(len(model.sizes))]
  if choice is None:
    need = sum(float(m.min()) for m in model.memory.values()) + model.fixed_memory
    raise AutoShardingError(
        f"no layout fits memory_budget={budget:,} B per device (arguments, variables and the activations live at "
        f"the peak: the smallest possible is {need:,.0f} B, each split over the whole mesh as far as it divides; "
        f"solver status: {status}): raise the budget, use a larger mesh, or pin some layouts by hand"
        if budget is not None else
        f"the sharding program could not be solved (solver status: {status})")
  predicted_cost, predicted_bytes = evaluate(model, choice)
  annotations = dict(program.annotations)
  auto_args = set()
  for k, name in enumerate(program.input_names):
    if k < len(options.arguments) and options.arguments[k]:
      auto_args.add(name)
  free_vars = {name for name, pin in zip(program.variable_names, program.variable_pins or ()) if pin is None}
  choices = []
  state_bytes = 0
  mem_of = model.memory
  for root, g in builder.groups.items():
    chosen = g.cands[choice[g.id]]
    for label, kind, r in g.state:
      name = r.split(":")[0]
      state_bytes += local_elements(g.shape, chosen) * g.itemsize
      if (kind == "argument" and name in auto_args) or (kind == "variable" and name in free_vars):
        annotations[r] = chosen
        delta = local_delta(model, choice, g.id)
        order = [i for i in np.argsort(delta, kind="stable") if i != choice[g.id]]
        if budget is not None:
          used = sum(float(m[choice[b]]) for b, m in mem_of.items()) + model.fixed_memory
          order = [i for i in order if used - mem_of[g.id][choice[g.id]] + mem_of[g.id][i] <= budget]
        alt = order[0] if order else None
        choices.append(Choice(
            name=label, kind=kind, shape=g.shape, sharding=chosen,
            bytes_per_device=local_elements(g.shape, chosen) * g.itemsize,
            runner_up=g.cands[alt] if alt is not None else None,
            runner_up_extra=float(delta[alt] - delta[choice[g.id]]) if alt is not None else 0.0,
            runner_up_bytes_per_device=local_elements(g.shape, g.cands[alt]) * g.itemsize if alt is not None
            else None))
  strategies = {}
  if options.pin_intermediates:
    for root, g in builder.groups.items():
      for r in g.members:
        if r not in annotations:
          annotations[r] = g.cands[choice[g.id]]
    for node, rows, b, _ in builder.strategies:
      strategies[node.name] = rows[choice[b]][0]
    for node, rows, u, v, best in builder.unary:
      strategies[node.name] = rows[int(best[choice[u], choice[v]])][0]
  choices.sort(key=lambda c: (c.kind != "argument", c.name))
  activations = sum(float(a[choice[b]]) for b, a in model.activations.items()) + model.fixed_memory
  plan = AutoPlan(choices=tuple(choices), predicted_bytes=int(round(predicted_bytes)),
                  predicted_cost=predicted_cost, state_bytes_per_device=int(state_bytes),
                  activation_bytes_per_device=int(round(activations)),
                  memory_budget=budget, groups=len(builder.groups), strategies=len(builder.strategies),
                  blocks=len(model.sizes), folded_blocks=len(folded.sizes),
                  variables=ncol, constraints=nrow, build_seconds=built, solve_seconds=took, status=status,
                  planned=strategies)
  return program.replace(annotations=annotations, auto_plan=plan)
