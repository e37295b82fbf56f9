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
- **Memory.** Arguments and captured variables (weights, optimizer state) cost their bytes per device, and so
  do the activations live where the unpartitioned program peaks (the memory pass's simulation of the global
  graph), at their layouts; the sum is kept under `memory_budget` (`plan_memory` measures any lowered plan the
  same way, so a hand plan and an automatic one compare at the same memory).

HiGHS (`highspy`) solves the program: an open-source MILP solver, a 3 MiB wheel with only numpy as a
dependency, fast on these sparse assignment-style programs (SciPy's `milp` wraps the same solver but brings
SciPy; OR-Tools brings a second protobuf runtime next to TensorFlow's). Repeated layers are folded first (`fold`).
The chosen layouts are pinned -- those of the arguments marked "auto", of the captured variables not yet stored
sharded and of every tensor the program priced -- and each op's chosen strategy is handed to its rule
(`PartitionContext.planned_axes`); completion and partitioning then run as for hand-written annotations, so the
plan is what the partitioner emits and the report counts it (predicted and measured bytes agree).
"""

import dataclasses
import math
import os
import sys
import time
from typing import Any, Optional, Tuple

import numpy as np

from tf_gspmd import ops as op_rules
from tf_gspmd._sharding import Sharding
from tf_gspmd.errors import AutoShardingError
from tf_gspmd.ops.factors import FactorRule, assignments, dims_from
from tf_gspmd.rewriter import memory, reshard
from tf_gspmd.rewriter.completion import CompletionContext
from tf_gspmd.rewriter.graph_view import public_key, ref

AUTO = "auto"
_FREE_OPS = ("Const", "NoOp")


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
# Candidates and costs


def candidates(mesh, shape):
  """Every layout of a tensor of `shape`: each mesh axis (size > 1) on one dim or none, dims divided evenly.
  The replicated layout comes first."""
  dims = list(range(len(shape)))
  out = [Sharding(mesh, tuple(axes_of.get(d, ()) for d in dims))
         for axes_of in assignments(mesh, dims, dict(enumerate(shape)))]
  return sorted(out, key=lambda s: s.num_tiles)


class _Costs:
  """Reshard costs (bytes and axis-weighted bytes), memoised: repeated layers ask the same questions."""

  def __init__(self, mesh, axis_cost):
    self.mesh = mesh
    self.weight = dict(axis_cost)
    self._memo = {}

  def reshard(self, shape, itemsize, src, dst, partial=None):
    """(bytes per device, weighted bytes) of turning `src` (+ pending `partial`) into `dst`."""
    key = (shape, itemsize, src, dst, partial)
    hit = self._memo.get(key)
    if hit is None:
      hit = reshard.plan_cost(shape, itemsize, src, dst, partial, self.weight)
      self._memo[key] = hit
    return hit


def _local_elements(shape, sharding):
  return math.prod(sharding.shard_shape(shape)) if shape else 1


# ----------------------------------------------------------------------------------------------------------
# The model: groups, strategies, edges


class _Group:
  __slots__ = ("id", "shape", "itemsize", "cands", "work", "state", "members")

  def __init__(self, gid, shape, itemsize):
    self.id = gid
    self.shape = shape
    self.itemsize = itemsize
    self.cands = None
    self.work = 0            # elements computed by the group's element-wise ops
    self.state = []          # (name, kind, ref) of the arguments and variables in the group
    self.members = []


class _Model:
  """Blocks of one-hot variables (groups and op strategies) and cost terms between them."""

  def __init__(self):
    self.sizes = []          # block -> number of choices
    self.linear = []         # block -> np.array of costs (weighted) per choice
    self.linear_bytes = []   # block -> np.array of bytes per choice
    self.pairs = {}          # (block u, block v) -> (cost matrix, bytes matrix)
    self.memory = {}         # block -> np.array of bytes per device per choice (state and live activations)
    self.activations = {}    # block -> np.array of the live-activation part of it
    self.fixed_memory = 0    # bytes per device no choice changes (what is live and not priced: replicated)
    self.labels = []         # block -> description
    self.signatures = []     # block -> what it is, without names (repeated layers share signatures)

  def block(self, n, label, signature=None):
    self.signatures.append(signature)
    self.sizes.append(n)
    self.linear.append(np.zeros(n))
    self.linear_bytes.append(np.zeros(n))
    self.labels.append(label)
    return len(self.sizes) - 1

  def add_linear(self, b, cost, nbytes=None):
    self.linear[b] = self.linear[b] + cost
    if nbytes is not None:
      self.linear_bytes[b] = self.linear_bytes[b] + nbytes

  def add_pair(self, u, v, cost, nbytes):
    """Cost[i, j] when block u takes choice i and block v choice j."""
    if u == v:
      self.add_linear(u, np.diag(cost).copy(), np.diag(nbytes).copy())
      return
    if u > v:
      u, v, cost, nbytes = v, u, cost.T, nbytes.T
    if self.sizes[u] == 1 or np.all(cost == cost[:1, :]) and np.all(nbytes == nbytes[:1, :]):
      self.add_linear(v, cost[0].copy(), nbytes[0].copy())
      return
    if self.sizes[v] == 1 or np.all(cost == cost[:, :1]) and np.all(nbytes == nbytes[:, :1]):
      self.add_linear(u, cost[:, 0].copy(), nbytes[:, 0].copy())
      return
    old = self.pairs.get((u, v))
    self.pairs[(u, v)] = (cost, nbytes) if old is None else (old[0] + cost, old[1] + nbytes)


def fold(model, rounds=4):
  """Blocks of repeated layers merged: (folded model, block -> folded block).

  Blocks whose neighbourhoods look the same `rounds` edges deep (Weisfeiler-Lehman colours over what each
  block is, its costs and the cost matrices of its edges) take one shared choice; their costs are summed, and an
  edge between two blocks of one class becomes its diagonal. Twelve identical layers then cost one layer's
  program (Alpa reuses the solution of repeated layers the same way); a shared choice is always feasible.
  """
  n = len(model.sizes)

  def digest(a):
    return hash(np.round(np.asarray(a, dtype=float), 3).tobytes())

  color = [hash((model.signatures[b], model.sizes[b], digest(model.linear[b]), digest(model.linear_bytes[b]),
                 digest(model.memory[b]) if b in model.memory else 0)) for b in range(n)]
  nbrs = [[] for _ in range(n)]
  for (u, v), (c, nb) in model.pairs.items():
    h = hash((digest(c), digest(nb)))
    nbrs[u].append((0, v, h))
    nbrs[v].append((1, u, h))
  for _ in range(rounds):
    color = [hash((color[b], tuple(sorted((d, color[o], h) for d, o, h in nbrs[b])))) for b in range(n)]
  index = {}
  of = [index.setdefault(c, len(index)) for c in color]
  folded = _Model()
  for k in range(len(index)):
    b = of.index(k)
    folded.block(model.sizes[b], model.labels[b], model.signatures[b])
  folded.fixed_memory = model.fixed_memory
  for b in range(n):
    folded.add_linear(of[b], model.linear[b], model.linear_bytes[b])
    if b in model.memory:
      folded.memory[of[b]] = folded.memory.get(of[b], 0) + model.memory[b]
  for (u, v), (c, nb) in model.pairs.items():
    folded.add_pair(of[u], of[v], c, nb)
  return folded, of


class _Builder:
  """Walks the IR once and states the program (see the module docstring)."""

  def __init__(self, program, options):
    self.program = program
    self.ir = program.ir
    self.mesh = program.mesh
    self.options = options
    self.costs = _Costs(self.mesh, options.axis_cost)
    self.ctx = CompletionContext(program)
    self.model = _Model()
    self.parent = {}
    self.groups = {}
    self.strategies = []     # (node, assignments, block, outputs)
    self.unary = []          # (node, rows, operand block, result block, best strategy per pair)
    self.pinned = {r: s for r, s in (program.annotations or {}).items() if r not in (program.open_dims or {})}
    self.const = set()
    for n in self.ir.nodes:
      if n.op in _FREE_OPS:
        self.const.update(n.ref(o) for o in range(len(n.outputs)))

  # -- tensors
  def shape(self, r):
    info = self.ir.info(r)
    if info.partitionable:
      return tuple(int(d) for d in info.shape)
    if info.value_shape is not None and not info.is_list:
      return tuple(int(d) for d in info.value_shape)
    return None

  def itemsize(self, r):
    info = self.ir.info(r)
    dtype = info.dtype if info.partitionable else (info.value_dtype or info.dtype)
    try:
      return max(1, dtype.size)
    except Exception:  # pylint: disable=broad-except
      return 4

  def find(self, r):
    p = self.parent.setdefault(r, r)
    while p != self.parent[p]:
      self.parent[p] = self.parent[self.parent[p]]
      p = self.parent[p]
    return p

  def union(self, a, b):
    """Merge b's group into a's when neither is pinned to another layout; False when they stay apart."""
    ra, rb = self.find(a), self.find(b)
    if ra == rb:
      return True
    if ra in self.pinned or rb in self.pinned:
      return False
    self.parent[rb] = ra
    return True

  def usable(self, r):
    return r not in self.const and self.shape(r) is not None

  # -- the walk
  def build(self):
    ir = self.ir
    # Pass 1: union-find over same-layout ops.
    plans = []
    for node in ir.nodes:
      if node.op in _FREE_OPS or node.op == "Placeholder":
        continue
      rule = op_rules.lookup(node.op)
      if isinstance(rule, FactorRule):
        plans.append(self._plan_factor(node, rule))
      elif rule is not None and node.outputs:
        plans.append(self._plan_other(node, rule))
    # Groups: one block each.
    for r in list(self.parent) + [ref(n) for n in ir.inputs + tuple(self.program.variable_names)]:
      if self.usable(r):
        self._group(r)
    self._state()
    self._activations()
    for p in plans:
      if p is not None:
        p()
    fpb = self.options.flops_per_byte
    for g in self.groups.values():   # element-wise arithmetic, divided among the devices a layout splits it over
      if g.work:
        self.model.add_linear(g.id, np.array([g.work / c.num_tiles / fpb for c in g.cands]))
    return self.model

  def _group(self, r):
    root = self.find(r)
    g = self.groups.get(root)
    if g is None:
      shape = self.shape(root)
      g = _Group(len(self.groups), shape, self.itemsize(root))
      pin = self.pinned.get(root)
      if pin is not None:   # (a maximal layout is priced as replicated)
        g.cands = [pin.tiled(len(shape))]
      else:
        g.cands = candidates(self.mesh, shape)
      g.id = self.model.block(len(g.cands), f"group {public_key(root)}", ("group", shape, g.itemsize,
                                                                             tuple(g.cands)))
      self.groups[root] = g
    if r not in g.members:
      g.members.append(r)
    return g

  def _state(self):
    """Arguments and captured variables: memory per choice."""
    program = self.program
    variables = set(program.variable_names)
    names = list(self.ir.inputs) + [n for n in program.variable_names if n not in self.ir.inputs]
    for k, name in enumerate(names):
      r = ref(name)
      if self.shape(r) is None:
        continue
      g = self._group(r)
      kind = "variable" if name in variables else "argument"
      label = name
      if kind == "variable":
        v = program.variables[program.variable_names.index(name)]
        label = getattr(v, "name", name).split(":")[0]
      elif program.fn is not None and k < len(program.arg_specs):
        label = f"argument {k}"
      g.state.append((label, kind, r))
      nbytes = np.array([_local_elements(g.shape, c) * g.itemsize for c in g.cands], dtype=float)
      self.model.memory[g.id] = self.model.memory.get(g.id, 0) + nbytes

  def _activations(self):
    """The activations live where the unpartitioned program peaks (the memory pass's simulation of the global
    graph), priced at each candidate layout of their groups; what no group holds counts whole."""
    live, extra = _live_at_peak(self.program, self.ir)
    self.model.fixed_memory += extra
    for r, nbytes in live.items():
      g = self.groups.get(self.find(r)) if self.usable(r) else None
      if g is None:
        g = self._group(r) if self.usable(r) else None
      if g is None:
        self.model.fixed_memory += nbytes
        continue
      per = np.array([_local_elements(g.shape, c) * g.itemsize for c in g.cands], dtype=float)
      self.model.memory[g.id] = self.model.memory.get(g.id, 0) + per
      self.model.activations[g.id] = self.model.activations.get(g.id, 0) + per

  # -- factor ops
  def _plan_factor(self, node, rule):
    f = rule.cached_factors(node)
    data = rule.data_inputs(node)
    ops = [(j, node.inputs[i]) for j, i in enumerate(data) if j < len(f.operands) and self.usable(node.inputs[i])]
    outs = [(o, node.ref(o)) for o in range(len(node.outputs)) if o < len(f.outputs) and self.usable(node.ref(o))]
    if not ops:
      return None
    if not outs:
      if node.outputs:
        return None
      # A write (AssignVariableOp, ResourceApply*): every operand to operand 0's layout.
      (j0, r0), rest = ops[0], ops[1:]
      return lambda: [self._edge_mapped(r, f.operands[j], r0, f.operands[j0], node) for j, r in rest]
    if len(outs) > 1 and not f.reduced and len(outs) == len(node.outputs):
      # One result per operand, each with that operand's own factors (IdentityN): pairs share a layout.
      pairs = []
      for o, out in outs:
        match = [r for j, r in ops if f.operands[j] == f.outputs[o] and self.shape(r) == self.shape(out)]
        pairs.append((o, match[0], out) if match else None)
      label_sets = [set(l for l in labels if l) for labels in f.outputs]
      disjoint = sum(len(x) for x in label_sets) == len(set().union(*label_sets))
      if all(pairs) and disjoint and len(pairs) == len(ops):
        apart = [(o, r, out) for o, r, out in pairs if not self.union(out, r)]

        def plan_pairs():
          for o, r, out in apart:   # (a pinned result stays apart: its operand arrives in its layout)
            self._edge_mapped(r, f.outputs[o], out, f.outputs[o], node)
        return plan_pairs
    o0, out = outs[0]
    out_labels = f.outputs[o0]
    if len(outs) == 1 and not f.reduced:
      same = [(j, r) for j, r in ops if f.operands[j] == out_labels and self.shape(r) == self.shape(out)]
      if same:
        # The result and every operand of its shape share one layout (Alpa's "follow"); operands of other
        # shapes (broadcast) arrive in it.
        rest = [(j, r) for j, r in ops if (j, r) not in same or not self.union(out, r)]

        def plan():
          g = self._group(out)
          g.work += math.prod(g.shape) if g.shape else 1
          for j, r in rest:
            self._edge_mapped(r, f.operands[j], out, out_labels, node)
        return plan
    if len(ops) == 1:
      return lambda: self._edge_unary(node, f, ops[0], outs)
    return lambda: self._strategy(node, f, ops, outs)

  def _edge_mapped(self, src, src_labels, dst, dst_labels, node):  # pylint: disable=unused-argument
    """src must arrive in dst's layout carried over by factor labels (an operand of an element-wise op)."""
    gs_, gd = self._group(src), self._group(dst)
    cost = np.zeros((len(gs_.cands), len(gd.cands)))
    nbytes = np.zeros_like(cost)
    for t, c in enumerate(gd.cands):
      axes_of = {l: c.dims[d] for d, l in enumerate(dst_labels) if l and d < c.rank and c.dims[d]}
      want = Sharding(self.mesh, dims_from(src_labels, axes_of))
      for i, s in enumerate(gs_.cands):
        b, w = self.costs.reshard(gs_.shape, gs_.itemsize, s, want)
        nbytes[i, t], cost[i, t] = b, w
    self.model.add_pair(gs_.id, gd.id, cost, nbytes)

  def _op_terms(self, node, f, ops, outs):
    """Per strategy: required layout per operand, made layout (and partial sums) per output, arithmetic."""
    rule = op_rules.lookup(node.op)
    sizes = rule.factor_sizes(node)
    labels = f.labels
    total = math.prod(sizes[l] for l in labels) if labels else 1
    rows = []
    for axes_of in rule.strategies(node, self.mesh):
      req = [Sharding(self.mesh, dims_from(f.operands[j], axes_of)) for j, _ in ops]
      made = [Sharding(self.mesh, dims_from(f.outputs[o], axes_of)) for o, _ in outs]
      split = math.prod(self.mesh.axis_size(a) for ax in axes_of.values() for a in ax)
      inside = rule.internal_bytes(node, axes_of, self.mesh)  # pylint: disable=assignment-from-no-return
      rows.append((axes_of, req, made, f.partial(axes_of), total / split, inside))
    return rows

  def _edge_unary(self, node, f, op, outs):
    """One operand: the best strategy per (operand layout, result layout) pair is the edge's cost."""
    rows = self._op_terms(node, f, [op], outs)
    gi = self._group(op[1])
    fpb = self.options.flops_per_byte
    p = np.array([[self.costs.reshard(gi.shape, gi.itemsize, s, req[0])[1] for (_, req, _, _, _, _) in rows]
                  for s in gi.cands])
    pb = np.array([[self.costs.reshard(gi.shape, gi.itemsize, s, req[0])[0] for (_, req, _, _, _, _) in rows]
                   for s in gi.cands])
    for k, (o, out) in enumerate(outs):
      go = self._group(out)
      inner = np.array([(inside if k == 0 else 0) for (*_, inside) in rows], dtype=float)[:, None]
      q = np.array([[self.costs.reshard(go.shape, go.itemsize, made[k], c, partial)[1] + work / fpb
                     for c in go.cands] for (_, _, made, partial, work, _) in rows]) + inner
      qb = np.array([[self.costs.reshard(go.shape, go.itemsize, made[k], c, partial)[0] for c in go.cands]
                     for (_, _, made, partial, _, _) in rows]) + inner
      # (the operand's reshard is counted with the first result only)
      tot = (p if k == 0 else 0 * p)[:, :, None] + q[None, :, :]
      totb = (pb if k == 0 else 0 * pb)[:, :, None] + qb[None, :, :]
      best = tot.argmin(axis=1)[:, None, :]
      if k == 0:
        self.unary.append((node, rows, gi.id, go.id, best[:, 0, :]))
      cost = np.take_along_axis(tot, best, axis=1)[:, 0, :]
      nbytes = np.take_along_axis(totb, best, axis=1)[:, 0, :]
      self.model.add_pair(gi.id, go.id, cost, nbytes)

  def _strategy(self, node, f, ops, outs):
    """Several operands of different factors: a block of its own, one choice per axis assignment."""
    rows = self._op_terms(node, f, ops, outs)
    b = self.model.block(len(rows), f"op {node.name} ({node.op})", ("op", node.op, len(rows)))
    self.strategies.append((node, rows, b, outs))
    inside = np.array([inside for (*_, inside) in rows], dtype=float)
    self.model.add_linear(b, np.array([work / self.options.flops_per_byte for (*_, work, _) in rows]) + inside,
                          inside)
    for k, (j, r) in enumerate(ops):
      g = self._group(r)
      cost = np.zeros((len(g.cands), len(rows)))
      nbytes = np.zeros_like(cost)
      for a, (_, req, *_) in enumerate(rows):
        for i, s in enumerate(g.cands):
          nbytes[i, a], cost[i, a] = self.costs.reshard(g.shape, g.itemsize, s, req[k])
      self.model.add_pair(g.id, b, cost, nbytes)
    for k, (o, r) in enumerate(outs):
      g = self._group(r)
      cost = np.zeros((len(rows), len(g.cands)))
      nbytes = np.zeros_like(cost)
      for a, (_, _, made, partial, *_) in enumerate(rows):
        for t, c in enumerate(g.cands):
          nbytes[a, t], cost[a, t] = self.costs.reshard(g.shape, g.itemsize, made[k], c, partial)
      self.model.add_pair(b, g.id, cost, nbytes)

  # -- ops described by forward/backward only (Reshape, ...)
  def _plan_other(self, node, rule):
    data = [i for i in rule.data_inputs(node) if self.usable(node.inputs[i])]
    outs = [o for o in range(len(node.outputs)) if self.usable(node.ref(o))]
    if len(data) != 1 or len(outs) != 1 or node.op in memory.CALL_OPS:
      return None
    i, o = data[0], outs[0]
    return lambda: self._edge_rule(node, rule, i, o)

  def _edge_rule(self, node, rule, i, o):
    gi, go = self._group(node.inputs[i]), self._group(node.ref(o))
    repl_in = Sharding(self.mesh, ((),) * len(gi.shape))
    cost = np.zeros((len(gi.cands), len(go.cands)))
    nbytes = np.zeros_like(cost)
    for t, c in enumerate(go.cands):
      back = rule.backward(self.ctx, node, [c if k == o else None for k in range(len(node.outputs))],
                           [None] * len(node.inputs))
      need = next(iter(back[i]), None) if i < len(back) else None
      need = repl_in if need is None else need.tiled(len(gi.shape))
      fwd = rule.forward(self.ctx, node, [need if k == i else None for k in range(len(node.inputs))])
      made = next(iter(fwd[o]), None) if o < len(fwd) else None
      if made is None or made.is_maximal or (math.prod(made.with_rank(len(go.shape)).shard_shape(go.shape))
                                             != math.prod(need.shard_shape(gi.shape))):
        need, made = repl_in, Sharding(self.mesh, ((),) * len(go.shape))
      made = made.with_rank(len(go.shape))
      after = self.costs.reshard(go.shape, go.itemsize, made, c)
      for k, s in enumerate(gi.cands):
        before = self.costs.reshard(gi.shape, gi.itemsize, s, need)
        nbytes[k, t], cost[k, t] = before[0] + after[0], before[1] + after[1]
    self.model.add_pair(gi.id, go.id, cost, nbytes)


# ----------------------------------------------------------------------------------------------------------
# The program and its solution


def _highs():
  """A HiGHS instance, its start-up banner (printed by the C++ library on stdout) kept off the program's output."""
  try:
    import highspy  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise AutoShardingError("in_shardings=\"auto\" needs the HiGHS solver, which is not installed: pip install "
                            "highspy (a dependency of tf_gspmd)") from e
  sys.stdout.flush()
  saved = os.dup(1)
  try:
    with open(os.devnull, "w") as null:
      os.dup2(null.fileno(), 1)
      h = highspy.Highs()
  finally:
    os.dup2(saved, 1)
    os.close(saved)
  return h


def _solve(model, budget, time_limit):
  """Minimise the model's cost with HiGHS; returns (choice per block, status, columns, rows, seconds)."""
  h = _highs()
  import highspy  # pylint: disable=g-import-not-at-top
  start_col = np.zeros(len(model.sizes) + 1, dtype=np.int64)
  start_col[1:] = np.cumsum(model.sizes)
  ny = int(start_col[-1])
  pair_keys = sorted(model.pairs)
  pair_start = [ny]
  for key in pair_keys:
    pair_start.append(pair_start[-1] + model.sizes[key[0]] * model.sizes[key[1]])
  ncol = pair_start[-1]
  cost = np.zeros(ncol)
  for b, lin in enumerate(model.linear):
    cost[start_col[b]:start_col[b + 1]] = lin
  rows, cols, vals, lo, hi = [], [], [], [], []
  r = 0
  for b, n in enumerate(model.sizes):   # one choice per block
    rows.append(np.full(n, r))
    cols.append(np.arange(start_col[b], start_col[b + 1]))
    vals.append(np.ones(n))
    lo.append(1.0)
    hi.append(1.0)
    r += 1
  for key, s in zip(pair_keys, pair_start[:-1]):
    u, v = key
    nu, nv = model.sizes[u], model.sizes[v]
    c = model.pairs[key][0]
    cost[s:s + nu * nv] = c.reshape(-1)
    z = s + np.arange(nu * nv).reshape(nu, nv)
    for block, n, members in ((u, nu, z), (v, nv, z.T)):   # sum_j z[i, j] = y_u[i]; sum_i z[i, j] = y_v[j]
      rows.append(np.repeat(np.arange(r, r + n), members.shape[1]))
      cols.append(members.reshape(-1))
      vals.append(np.ones(members.size))
      rows.append(np.arange(r, r + n))
      cols.append(start_col[block] + np.arange(n))
      vals.append(-np.ones(n))
      lo += [0.0] * n
      hi += [0.0] * n
      r += n
  if budget is not None and model.memory:
    for b, mem in model.memory.items():
      rows.append(np.full(len(mem), r))
      cols.append(np.arange(start_col[b], start_col[b + 1]))
      vals.append(np.asarray(mem, dtype=float))
    lo.append(-highspy.kHighsInf)
    hi.append(float(budget) - model.fixed_memory)
    r += 1
  rows = np.concatenate(rows)
  cols = np.concatenate(cols)
  vals = np.concatenate(vals)
  order = np.lexsort((rows, cols))
  rows, cols, vals = rows[order], cols[order], vals[order]
  starts = np.searchsorted(cols, np.arange(ncol + 1))
  # Scale: bytes can be large; HiGHS prefers costs near 1.
  scale = max(1.0, float(np.abs(cost).max()))
  lp = highspy.HighsLp()
  lp.num_col_ = ncol
  lp.num_row_ = r
  lp.col_cost_ = cost / scale
  lp.col_lower_ = np.zeros(ncol)
  lp.col_upper_ = np.ones(ncol)
  lp.row_lower_ = np.array(lo)
  lp.row_upper_ = np.array(hi)
  lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
  lp.a_matrix_.start_ = starts.astype(np.int32)
  lp.a_matrix_.index_ = rows.astype(np.int32)
  lp.a_matrix_.value_ = vals
  lp.integrality_ = [highspy.HighsVarType.kInteger] * ny + [highspy.HighsVarType.kContinuous] * (ncol - ny)
  h.setOptionValue("output_flag", False)
  h.setOptionValue("time_limit", float(time_limit))
  h.setOptionValue("mip_rel_gap", 1e-3)
  h.setOptionValue("threads", 1)
  t0 = time.perf_counter()
  h.passModel(lp)
  h.run()
  took = time.perf_counter() - t0
  status = h.modelStatusToString(h.getModelStatus())
  sol = h.getSolution()
  if not sol.value_valid:
    return None, status, ncol, r, took
  x = np.asarray(sol.col_value)
  choice = [int(np.argmax(x[start_col[b]:start_col[b + 1]])) for b in range(len(model.sizes))]
  return choice, status, ncol, r, took


def _evaluate(model, choice):
  """(weighted cost, bytes) of a full assignment."""
  cost = sum(float(model.linear[b][c]) for b, c in enumerate(choice))
  nbytes = sum(float(model.linear_bytes[b][c]) for b, c in enumerate(choice))
  for (u, v), (c, nb) in model.pairs.items():
    cost += float(c[choice[u], choice[v]])
    nbytes += float(nb[choice[u], choice[v]])
  return cost, nbytes


def _local_delta(model, choice, b):
  """Objective per choice of block b with every other block as chosen."""
  out = model.linear[b].copy()
  for (u, v), (c, _) in model.pairs.items():
    if u == b:
      out = out + c[:, choice[v]]
    elif v == b:
      out = out + c[choice[u], :]
  return out


def _live_at_peak(program, ir):
  """({ref: bytes} of the tensors live where the unpartitioned program peaks, bytes live there that no tensor of
  the graph holds), the captured variables counted at their value shapes."""
  variables = {}
  for name in program.variable_names:
    info = ir.info(ref(name))
    if info.value_shape is not None:
      variables[name] = (tuple(info.value_shape), info.value_dtype)
  return memory.live_at_peak(program.graph_def, program.input_names, variables, program.output_refs)


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
    state += _local_elements(tuple(shape), program.shardings[ref(name)].tiled(len(shape))) * dtype.size
  live, activations = _live_at_peak(program, ir)
  for r, nbytes in live.items():
    info = ir.info(r)
    s = program.shardings.get(r)
    activations += nbytes if s is None or not info.partitionable else (
        _local_elements(tuple(info.shape), s.tiled(len(info.shape))) * info.dtype.size)
  return int(state), int(activations)


def run(program):
  """Pass: choose the layouts left to it (AutoOptions in program.options.auto) and pin them."""
  options = program.options.auto
  if options is None:
    return program
  t0 = time.perf_counter()
  builder = _Builder(program, options)
  model = builder.build()
  built = time.perf_counter() - t0
  budget = options.memory_budget
  folded, of = fold(model)
  choice, status, ncol, nrow, took = _solve(folded, budget, options.time_limit)
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
  predicted_cost, predicted_bytes = _evaluate(model, choice)
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
      state_bytes += _local_elements(g.shape, chosen) * g.itemsize
      if (kind == "argument" and name in auto_args) or (kind == "variable" and name in free_vars):
        annotations[r] = chosen
        delta = _local_delta(model, choice, g.id)
        order = [i for i in np.argsort(delta, kind="stable") if i != choice[g.id]]
        if budget is not None:
          used = sum(float(m[choice[b]]) for b, m in mem_of.items()) + model.fixed_memory
          order = [i for i in order if used - mem_of[g.id][choice[g.id]] + mem_of[g.id][i] <= budget]
        alt = order[0] if order else None
        choices.append(Choice(
            name=label, kind=kind, shape=g.shape, sharding=chosen,
            bytes_per_device=_local_elements(g.shape, chosen) * g.itemsize,
            runner_up=g.cands[alt] if alt is not None else None,
            runner_up_extra=float(delta[alt] - delta[choice[g.id]]) if alt is not None else 0.0,
            runner_up_bytes_per_device=_local_elements(g.shape, g.cands[alt]) * g.itemsize if alt is not None
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
