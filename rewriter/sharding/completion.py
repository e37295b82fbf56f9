"""The completion pass: a sharding for every tensor, GSPMD's way.

A worklist fixed point in both directions (forward: operands -> results, backward: results -> operands;
a node is looked at again only when a neighbouring tensor changed) run in priority rounds: round 0 lets only
pass-through ops (element-wise, identity, parameters) propagate, round 1 adds contractions and reductions,
round 3 everything, so shardings flow along cheap paths first.
Annotations are pinned and never overwritten; conflicts are left for the partitioner, which reshards at
the annotated boundary. An annotation that leaves dims open (XLA's unspecified dims, `P.UNCONSTRAINED`) is a
partial pin: proposals may split its open dims (over mesh axes its pinned dims do not use), never change the
pinned ones. All conflict resolution is in `merge`. Tensors nothing decides are replicated.
"""

import tensorflow as tf

from tf_gspmd import ops as op_rules
from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.tensor_list import ListShape
from tf_gspmd.rewriter.graph import functions
from tf_gspmd.rewriter.frontend import import_annotations

ROUNDS = 4
MAX_ITERATIONS = 64


def merge(old, new):
  """The sharding a tensor takes when `new` is proposed and it has `old`: never less specific.

  Compatible proposals combine (one splits dim 0, the other dim 1 -> both); otherwise the proposal with
  strictly more tiles wins, and a tie keeps the existing sharding (no needless resharding).
  """
  if old is None:
    return new
  if new is None or new.is_maximal or old.is_maximal or new.rank != old.rank:
    return old
  combined = []
  used = set()
  compatible = True
  for a, b in zip(old.dims, new.dims):
    if a[:len(b)] == b or b[:len(a)] == a:
      d = a if len(a) >= len(b) else b
      if used & set(d):
        compatible = False
        break
      used.update(d)
      combined.append(d)
    else:
      compatible = False
      break
  if compatible:
    return Sharding(old.mesh, tuple(combined))
  return new if new.num_tiles > old.num_tiles else old


class CompletionContext:
  """What a rule's `forward`/`backward` sees besides the node: the program being completed.

  Control-flow rules ask it for the completed program of a function body (`complete_function`), which
  completes the body as a program of its own, cached per program tree.
  """

  def __init__(self, program):
    self.program = program
    self.mesh = program.mesh

  def complete_function(self, fname, arg_shapes, param_shardings, out_shardings=None):
    """The completed Program of function `fname` for these parameter shapes and layouts (None = free),
    with its results pinned to `out_shardings` when given."""
    return body_program(self.program, fname, arg_shapes, param_shardings, out_shardings)


def body_program(parent, fname, arg_shapes, param_shardings, out_shardings):
  """The completed Program of function `fname` of `parent`'s library (see CompletionContext.complete_function)."""
  key = (fname, tuple(arg_shapes), tuple(param_shardings), tuple(out_shardings) if out_shardings else None)
  cache = parent.function_cache
  if key not in cache:
    plain = [() if isinstance(s, ListShape) else s for s in arg_shapes]
    gd, inputs, outputs = functions.body_graph_def(parent.graph_def.library, fname, plain)
    for node in gd.node:   # a TensorList parameter keeps its elements' shape (rewriter/graph_ir reads it)
      if node.name in inputs and isinstance(arg_shapes[inputs.index(node.name)], ListShape):
        for k, v in arg_shapes[inputs.index(node.name)].attrs().items():
          node.attr[k].CopyFrom(v)
    program = type(parent).body(parent, gd, inputs, outputs, param_shardings, out_shardings)
    cache[key] = run(import_annotations.run(program))
  return cache[key]


def within(annotation, open_dims, cand):
  """The part of proposal `cand` an annotation with `open_dims` takes: its pinned dims as annotated; an open dim
  keeps the split the annotation starts it with (normally none), extended by the proposal's further axes as far
  as they are axes the annotation does not use."""
  if cand is None or cand.is_maximal or annotation.is_maximal:
    return None
  taken = set(annotation.used_axes)
  dims = []
  for d, axes in enumerate(annotation.dims):
    if d in open_dims and cand.dims[d][:len(axes)] == axes:
      for a in cand.dims[d][len(axes):]:
        if a in taken:
          break
        axes += (a,)
    dims.append(axes)
  return Sharding(annotation.mesh, tuple(dims))


def run(program, seed=None):
  """Pass: complete `program.annotations` (pinned) to every tensor; `seed` gives unpinned starting values."""
  ir = program.ir
  mesh = program.mesh
  open_dims = program.open_dims or {}
  shard, why = _starting_shardings(program, open_dims, seed)
  pinned = set(program.annotations)
  rules = {n.name: (op_rules.lookup(n.op) or op_rules.FALLBACK) for n in ir.nodes}
  ctx = CompletionContext(program)

  def propose(r, cand, reason):
    if (r in pinned and r not in open_dims) or cand is None:
      return False
    info = ir.info(r)
    rank = info.sharding_rank
    if rank is None:
      return False
    if not cand.is_maximal:
      cand = cand.with_rank(rank)
    if r in pinned:   # a partial pin: only its open dims take the proposal
      cand = within(program.annotations[r], open_dims[r], cand)
      reason = f"{reason}, into the dims {list(open_dims[r])} the annotation leaves open"
    old = shard.get(r)
    new = merge(old, cand)
    if new != old:
      shard[r] = new
      why[r] = reason
      return True
    return False

  nodes = ir.nodes
  producer, users, priority = _dataflow(nodes, rules)

  def touched(r, fwd, bwd, level):
    """Tensor r changed: its users look again in both directions, its producer looks backward again."""
    for k in users.get(r, ()):
      if priority[k] <= level:
        fwd[k] = bwd[k] = True
    k = producer.get(r)
    if k is not None and priority[k] <= level:
      bwd[k] = True

  iterations = 0
  for level in range(ROUNDS):
    fwd = [p <= level for p in priority]
    bwd = list(fwd)
    while (any(fwd) or any(bwd)) and iterations < MAX_ITERATIONS:
      iterations += 1
      _forward_sweep(ctx, nodes, rules, shard, level, fwd, bwd, propose, touched)
      _backward_sweep(ctx, nodes, rules, shard, level, fwd, bwd, propose, touched)
  complete = _completed(ir, mesh, shard, why)
  params = tuple(complete[f"{name}:0"] for name in ir.inputs)
  return program.replace(shardings=complete, explanations=why, param_shardings=params,
                         completion_iterations=iterations)


def _starting_shardings(program, open_dims, seed):
  """The fixed point's starting values and why each tensor has its: (tensor -> sharding, tensor -> reason), the
  seed's overridden by the annotations (a partial pin keeps the seed's split of its open dims)."""
  shard = {}
  why = {}
  for r, s in (seed or {}).items():
    shard[r] = s
    why[r] = (program.explanations or {}).get(r, "seeded")
  for r, s in program.annotations.items():
    if r in open_dims and r in shard:   # a partial pin keeps a seed's split of its open dims
      s = merge(s, within(s, open_dims[r], shard[r].with_rank(s.rank) if not shard[r].is_maximal else None))
    shard[r] = s
    why[r] = "annotation" + (f" (dims {list(open_dims[r])} left open)" if r in open_dims else "")
  return shard, why


def _dataflow(nodes, rules):
  """(tensor -> index of its producer, tensor -> indices of its users, each node's round: the first it runs in)."""
  producer = {}
  users = {}
  for k, n in enumerate(nodes):
    for o in range(len(n.outputs)):
      producer[n.ref(o)] = k
    for r in n.inputs:
      users.setdefault(r, []).append(k)
  priority = [rules[n.name].priority for n in nodes]
  for k, n in enumerate(nodes):   # a node with a tensor of unknown rank runs replicated: its rule is not asked
    if rules[n.name].unknown_rank(n) is not None:
      priority[k] = ROUNDS
  return producer, users, priority


def _forward_sweep(ctx, nodes, rules, shard, level, fwd, bwd, propose, touched):
  """One pass over the nodes marked `fwd`, in order: their rules propose results' shardings from the operands'."""
  for k, node in enumerate(nodes):
    if not fwd[k]:
      continue
    fwd[k] = False
    if not node.outputs:
      continue
    ins = [shard.get(r) for r in node.inputs]
    if not any(s is not None for s in ins) and not rules[node.name].forward_without_operands:
      continue
    for o, cands in enumerate(rules[node.name].forward(ctx, node, ins)):
      for c in cands:
        if propose(node.ref(o), c, f"round {level}: forward from the operands of {node.name} ({node.op})"):
          touched(node.ref(o), fwd, bwd, level)


def _backward_sweep(ctx, nodes, rules, shard, level, fwd, bwd, propose, touched):
  """One pass over the nodes marked `bwd`, in reverse order: their rules propose operands' shardings from the
  results'."""
  for k in range(len(nodes) - 1, -1, -1):
    if not bwd[k]:
      continue
    bwd[k] = False
    node = nodes[k]
    outs = [shard.get(node.ref(o)) for o in range(len(node.outputs))]
    ins = [shard.get(r) for r in node.inputs]
    if not any(s is not None for s in outs) and (node.outputs or not any(s is not None for s in ins)):
      continue   # (an op without outputs, e.g. a variable write, relates its operands to each other)
    for i, cands in enumerate(rules[node.name].backward(ctx, node, outs, ins)):
      for c in cands:
        if propose(node.inputs[i], c, f"round {level}: backward from {node.name} ({node.op})"):
          touched(node.inputs[i], fwd, bwd, level)


def _completed(ir, mesh, shard, why):
  """Every tensor's sharding at its rank: what the fixed point reached, else replicated (noted in `why`)."""
  complete = {}
  for r in ir.tensors():
    info = ir.info(r)
    s = shard.get(r)
    rank = info.sharding_rank
    if s is None:
      s = Sharding(mesh, ((),) * (rank or 0))
      why[r] = "default: nothing decided it (replicated)"
    elif not s.is_maximal and rank is not None:
      s = s.with_rank(rank, what=r)
    complete[r] = s
  return complete
