"""The model of the integer program: groups of tensors that share a layout, op strategies, and their costs.

`Builder` walks the IR once and states a `Model`: blocks of one-hot choices (a group's candidate layouts, an op's
strategies from its rule's `strategies`) with linear costs per choice (arithmetic, reshards inside a group,
memory) and pair costs between blocks (the reshards an edge implies). See the package docstring for the
formulation; `solver` solves a model, `plan` turns the solution into pinned layouts.
"""

import math

import numpy as np

from tf_gspmd import ops as op_rules
from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.factors import FactorRule, assignments, dims_from
from tf_gspmd.rewriter.sharding import memory, reshard
from tf_gspmd.rewriter.sharding.auto.budget import Pricing
from tf_gspmd.rewriter.sharding.completion import CompletionContext
from tf_gspmd.rewriter.graph.graph_view import public_key, ref

_FREE_OPS = ("Const", "NoOp")   # ops whose outputs are never priced (constants) or that have none


# ----------------------------------------------------------------------------------------------------------
# Candidates and costs


def candidates(mesh, shape):
  """Every layout of a tensor of `shape`: each mesh axis (size > 1) on one dim or none, dims divided evenly.
  The replicated layout comes first."""
  dims = list(range(len(shape)))
  out = [Sharding(mesh, tuple(axes_of.get(d, ()) for d in dims))
         for axes_of in assignments(mesh, dims, dict(enumerate(shape)))]
  return sorted(out, key=lambda s: s.num_tiles)


class Costs:
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


def local_elements(shape, sharding):
  """Elements of one device's shard of a tensor of `shape` laid out as `sharding` (padding included)."""
  return memory.shard_elements(shape, sharding)


# ----------------------------------------------------------------------------------------------------------
# The model: groups, strategies, edges


class Group:
  """Tensors that share one layout at no cost, and the one-hot block of their candidate layouts (`id`)."""

  __slots__ = ("id", "shape", "itemsize", "cands", "work", "state", "members", "nbytes")

  def __init__(self, gid, shape, itemsize):
    self.id = gid
    self.shape = shape
    self.itemsize = itemsize
    self.cands = None
    self.work = 0            # elements computed by the group's element-wise ops
    self.state = []          # (name, kind, ref) of the arguments and variables in the group
    self.members = []
    self.nbytes = None       # elements per device of one member at each candidate (`Builder._bytes`)


class Model:
  """Blocks of one-hot variables (groups and op strategies) and cost terms between them."""

  def __init__(self):
    self.sizes = []          # block -> number of choices
    self.linear = []         # block -> np.array of costs (weighted) per choice
    self.linear_bytes = []   # block -> np.array of bytes per choice
    self.pairs = {}          # (block u, block v) -> (cost matrix, bytes matrix)
    self.state = {}          # block -> np.array of bytes per device per choice (arguments and variables)
    self.rows = []           # MemoryRow per op whose live bytes are bounded (each adds to `state`)
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


class Builder(Pricing):
  """Walks the IR once and states the program (see the package docstring): `build()` returns the `Model`;
  `groups`, `strategies` and `unary` then say which block stands for which tensors and ops."""

  def __init__(self, program, options):
    self.program = program
    self.ir = program.ir
    self.mesh = program.mesh
    self.options = options
    self.costs = Costs(self.mesh, options.axis_cost)
    self.ctx = CompletionContext(program)
    self.model = Model()
    self.parent = {}
    self.groups = {}
    self.strategies = []     # (node, rows, block, outputs): ops with a block of their own, rows as `_op_terms`
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
    self._memory()
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
      g = Group(len(self.groups), shape, self.itemsize(root))
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
      self.model.state[g.id] = self.model.state.get(g.id, 0) + self._bytes(g, r)
      if name in self.options.gradient_sync:   # (a ring all-reduce of the gradient's shard over the rest)
        rest = np.array([self.mesh.size / c.num_tiles for c in g.cands])
        sync = 2 * (rest - 1) / rest * self._bytes(g, r)
        self.model.add_linear(g.id, self.options.gradient_weight * sync)

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
    """Operand i to result o: for each result layout, the operand layout `backward` asks for and the layout
    `forward` then makes from it (replicated both when the two disagree on the elements per device)."""
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

