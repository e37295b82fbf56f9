"""The auto_shard pass: shardings chosen by an integer program instead of written by hand.

Alpa's intra-operator formulation, on the TF graph and with this library's own rules and byte model:

- **Groups.** Tensors that must share one layout at no cost (an element-wise op and the operand of its shape,
  a variable and its reads, an identity) are merged into one group; each group has one binary variable per
  candidate sharding (every assignment of mesh axes to its dims that divides them evenly).
- **Strategies.** An op whose operands differ in their factors (a contraction: MatMul, BatchMatMul, Einsum,
  an element-wise op of two broadcast operands) gets its own variables, one per strategy its rule enumerates
  (`Rule.strategies(node, mesh)`: every assignment of mesh axes to its factors that divides them, `ops.factors`):
  that fixes the layout each operand must arrive in, the layout the result is made in and the partial sums left
  over split reduced factors.
- **Edges.** Between a group and a strategy (or two groups, through a one-operand op such as a reduction, a
  transpose or a reshape, whose best strategy per pair is taken) the cost is the reshard the partitioner would
  emit, in bytes per device from `reshard.plan_bytes`, weighted per mesh axis (`axis_cost`: a cross-host axis
  costs more). Pairs are linearised with continuous variables whose row and column sums are the two one-hot
  choices (exact for integral choices).
- **Compute.** Each strategy and group also costs its arithmetic per device divided by `flops_per_byte` (how
  many operations a device does in the time a link moves a byte), so splitting work pays against the bytes
  it costs; replicating everything is what a tiny model on fast devices should do, and does.
- **Memory.** `memory_budget` bounds the plan's count of `rewriter.sharding.memory` (`plan_memory` measures any lowered
  plan so; the memory pass's Account shows it next to the per-device program's estimate, which adds what
  partitioning adds): arguments and captured variables (weights, optimizer state) at their layouts, constants,
  and the activations live at the peak at their layouts. One row per op bounds what is live there: where the
  unpartitioned program peaks, where it peaks split as far as it goes, and, solved again, where a chosen plan
  peaks over the budget. Loop bodies and the lists loops keep for the backward are priced at the share of the
  loop's operands one device holds (completion lays the bodies out after this pass).

HiGHS (`highspy`) solves the program: an open-source MILP solver, a 3 MiB wheel with only numpy as a
dependency, fast on these sparse assignment-style programs (SciPy's `milp` wraps the same solver but brings
SciPy; OR-Tools brings a second protobuf runtime next to TensorFlow's). Repeated layers are folded first (`fold`).
The chosen layouts are pinned -- those of the arguments marked "auto", of the captured variables not yet stored
sharded and of every tensor the program priced -- and each op's chosen strategy is handed to its rule
(`PartitionContext.planned_axes`); completion and partitioning then run as for hand-written annotations, so the
plan is what the partitioner emits and the report counts it (predicted and measured bytes agree).

Modules: `model` (the walk over the graph that states groups, strategies, edges and their costs), `solver`
(the integer program for HiGHS, its solution, folding repeated layers) and `plan` (the pass `run`, the
`AutoPlan` it records and `plan_memory`). The inter-operator level (`gs.plan_stages`, Alpa's pipeline stages and
submeshes over these plans): `layers` (ops clustered into layers), `stage_dp` (submeshes and the stage program),
`stages` (layer costs from this pass on each logical mesh, the `StagePlan`), `stage_fn` (a stage as a callable)
and `calibrate` (seconds per FLOP and per collective byte on this machine).
"""

from tf_gspmd.rewriter.sharding.auto.model import candidates
from tf_gspmd.rewriter.sharding.auto.plan import AUTO, AutoOptions, AutoPlan, Choice, plan_memory, run
from tf_gspmd.rewriter.sharding.auto.solver import fold

__all__ = ["AUTO", "AutoOptions", "AutoPlan", "Choice", "candidates", "fold", "plan_memory", "run"]
