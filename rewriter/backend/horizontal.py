"""Horizontal fusion: like element-wise computations of the per-device program that do not depend on one another run
as one.

A training step updates every weight with the same chain of element-wise ops -- an optimizer's moments, their
corrections, the step -- once per weight. In a per-device program of small shards these chains are most of its
ops, and every device pays TF's executor its per-op cost (a few microseconds) for each. Here:

  * a *chain* is a connected set of element-wise ops (those whose rule in ops/ says so and that broadcast or take
    operands of the result's shape: AddN and the gradients of unary ops) on non-scalar tensors of at most
    FUSE_LIMIT elements, none with a control input; what it reads from outside are its operands (a scalar, such
    as an optimizer's learning rate, is always an operand);
  * chains that compute the same function -- the same ops and attributes wired alike, operands of the same shapes
    and dtypes -- and do not depend on one another are a group. Groups are formed in graph order, one at a time,
    from the chains that none of the group reaches through the graph as fused so far, so the graph stays acyclic;
  * a group runs each op once on a leading member dimension: an operand the members read from different tensors
    is packed along it (differing constants become one constant, up to CONST_LIMIT bytes), one they all read
    broadcasts (where the ops reading it broadcast), a tensor of lower rank than the chain's highest gets unit
    dimensions after the member dimension (so broadcasting pairs the dimensions it paired before), and each result
    read outside the chain is unpacked for its readers.

A group is fused only where that saves ops (each pack, unpack and reshape is one). Every element goes through the
same ops in the same order, so the results are exactly the members' own. The pass also drops reshapes whose
operand already has their static shape in the program itself, so every tensor keeps its static shape. What is
fused is judged with a read of a variable given its shard's shape (TF's import leaves it unknown): an optimizer's
updates of variables fuse as those of arguments do.
"""

import collections
import hashlib

import numpy as np
import tensorflow as tf

from tf_gspmd.rewriter.program import variable_shard
from tf_gspmd.rewriter.graph import graph_view
from tf_gspmd.rewriter.collectives import shapes as collective_shapes
from tf_gspmd.rewriter.graph.graph_view import is_control, node_of, normalize, split_ref
from tf_gspmd.ops import registry

FUSE_LIMIT = 1 << 14   # elements of a chain's largest tensor: above it, the copies cost more than the ops they save
CONST_LIMIT = 1 << 16   # bytes of the one constant the members' differing constants become (else they are packed)


def _elementwise_form(op_type):
  """"broadcasting" or "same_shape" for an element-wise op that broadcasts or takes operands of the result's shape
  (the forms of ops/registry.STACKED_FORMS), else None."""
  form = registry.stacked_form(op_type) if registry.is_elementwise(op_type) else None
  return form if form in ("broadcasting", "same_shape") else None


# A chain's template entries: what it reads from outside (`const`: a Const), and its ops (`inputs`: positions of
# the entries they read).
_Operand = collections.namedtuple("_Operand", "dtype shape const")
_Op = collections.namedtuple("_Op", "op attrs dtype shape inputs")


def run(program):
  """Pass (the collectives path): the per-device program with its like element-wise chains fused, where each
  device runs it through TF's collectives. Not with XLA, which fuses them itself. (Not in plan mode, where nothing
  runs; nor where the devices run as one in-process graph, whose stacking already runs each op once for all
  devices: fusing there measured slower, the fused tensors pass stacking's size limit.)"""
  if program.jit is not None:
    return program
  keep = set(program.local_inputs) | set(program.local_variables) | set(program.local_outputs) | set(
      program.side_effects) | {program.partition_id} | set(program.report.emitted())
  variables = {name: variable_shard(program, name) for name in program.local_variables}
  fused = fuse(program.local_graph_def, keep, variables)
  return program if fused is None else program.replace(local_graph_def=fused)


def fuse(gd, keep=(), variables=None):
  """`gd` with its groups of like element-wise chains fused (see the module docstring), or None where none is.
  `keep`: nodes that stay as they are; `variables`: handle -> (shape, dtype) of a device's shard of the variable
  it reads (what a read of it computes on has that shape)."""
  return _Fusion(gd, set(keep), variables or {}).result()


class _Fusion:

  def __init__(self, gd, keep, variables):
    # Static shapes by node name, as TF infers them in the program itself: a reshape is removed only where it keeps
    # its operand's static shape there, so every tensor keeps its static shape.
    self.graph = _imported(gd)
    self.gd, self.reshapes = self._without_shape_preserving_reshapes(gd, keep)
    gd = self.gd
    # What is fused: shapes where a read of a variable has its shard's shape and a collective its result's, which
    # TF's import leaves unknown (an optimizer's update of a variable).
    if collective_shapes.adds_shapes(gd, variables):
      self.graph = _imported(collective_shapes.for_shapes(gd, variables))
    self.nodes = {x.name: x for x in gd.node}
    self.order = [x.name for x in graph_view.GraphView(gd).order()]
    self.position = {n: k for k, n in enumerate(self.order)}
    self.readers = {}
    for x in gd.node:
      for i in x.input:
        self.readers.setdefault(node_of(i), set()).add(x.name)
    fusible = {x.name for x in gd.node if self._fusible(x, keep)}
    self.chains = self._chains(fusible)
    self.chain_of = {n: root for root, members in self.chains.items() for n in members}

  # ---- shapes ----------------------------------------------------------------------------------------------------

  def _tensor(self, r):
    name, k = split_ref(r)
    return self.graph.get_operation_by_name(name).outputs[k]

  def _shape(self, r):
    shape = self._tensor(r).shape
    return tuple(shape.as_list()) if shape.is_fully_defined() else None

  def _without_shape_preserving_reshapes(self, gd, keep):
    """(`gd` without the Reshapes whose operand already has their static shape, their readers reading the operand;
    how many were removed). The partitioner and the gradients of broadcasting ops leave such reshapes behind, and
    TF's graph optimizer, which does not see the arguments' shapes, keeps them."""
    replaced = {}
    for x in gd.node:
      if x.op == "Reshape" and x.name not in keep and not any(is_control(i) for i in x.input):
        before, after = self._shape(x.input[0]), self._shape(x.name + ":0")
        if before is not None and before == after:
          replaced[x.name] = normalize(x.input[0])
    if not replaced:
      return gd, 0

    def source(i):   # through a run of removed reshapes
      control = is_control(i)
      name = node_of(i)
      while name in replaced:
        i = replaced[name]
        name = node_of(i)
      return "^" + name if control else i

    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(gd.versions)
    out.library.CopyFrom(gd.library)
    for x in gd.node:
      if x.name in replaced:
        continue
      node = out.node.add()
      node.CopyFrom(x)
      if any(node_of(i) in replaced for i in x.input):
        del node.input[:]
        node.input.extend(graph_view.dedupe_controls([source(i) for i in x.input]))
    return out, len(replaced)

  def _fusible(self, x, keep):
    if _elementwise_form(x.op) is None or x.name in keep or any(is_control(i) for i in x.input):
      return False
    if len(self.graph.get_operation_by_name(x.name).outputs) != 1:
      return False
    shapes = [self._shape(r) for r in [x.name + ":0"] + list(x.input)]
    if not shapes[0]:   # unknown or scalar
      return False
    return all(shape is not None and np.prod(shape) <= FUSE_LIMIT for shape in shapes)

  # ---- chains and their signatures ----------------------------------------------------------------------------------

  def _chains(self, fusible):
    """root -> the chain's nodes in graph order (connected components of `fusible` over data edges)."""
    parent = {n: n for n in fusible}

    def find(a):
      while parent[a] != a:
        parent[a] = parent[parent[a]]
        a = parent[a]
      return a

    for n in fusible:
      for i in self.nodes[n].input:
        if node_of(i) in fusible:
          parent[find(n)] = find(node_of(i))
    chains = {}
    for n in self.order:
      if n in fusible:
        chains.setdefault(find(n), []).append(n)
    return chains

  def _leaf(self, r):
    t = self._tensor(r)
    return _Operand(t.dtype.as_datatype_enum, tuple(t.shape.as_list()), self.nodes[node_of(r)].op == "Const")

  def _entry(self, x):
    t = self._tensor(x.name + ":0")
    attrs = tuple((k, x.attr[k].SerializeToString(deterministic=True)) for k in sorted(x.attr)
                  if not k.startswith("_"))
    return (x.op, attrs, t.dtype.as_datatype_enum, tuple(t.shape.as_list()))

  def template(self, root):
    """(signature, refs) of chain `root`: the signature lists its operands and ops in a canonical order (the
    results read outside it, ordered by a digest of what they compute, each preceded by its inputs, first
    visited first), every op with its inputs' positions, then the results' positions; refs[k] is the operand
    (a tensor reference) or the op (a node name) at position k. Chains of one signature compute one function."""
    members = self.chains[root]
    inside = set(members)
    digest = {}
    for n in members:   # graph order: inputs first
      x = self.nodes[n]
      parts = [repr(self._entry(x))] + [digest[node_of(i)] if node_of(i) in inside else repr(self._leaf(i))
                                        for i in x.input]
      digest[n] = hashlib.sha1("|".join(parts).encode()).hexdigest()
    results = sorted((n for n in members if not self.readers.get(n) or self.readers[n] - inside),
                     key=lambda n: digest[n])
    index, entries, refs = {}, [], []
    for result in results:
      stack = [result]
      while stack:
        n = stack[-1]
        if n in index:
          stack.pop()
          continue
        pending = None
        for i in self.nodes[n].input:
          m = node_of(i)
          if m in inside:
            if m not in index:
              pending = m
              break
          elif normalize(i) not in index:
            index[normalize(i)] = len(entries)
            entries.append(self._leaf(i))
            refs.append(normalize(i))
        if pending is not None:
          stack.append(pending)
          continue
        stack.pop()
        x = self.nodes[n]
        inputs = tuple(index[node_of(i) if node_of(i) in inside else normalize(i)] for i in x.input)
        index[n] = len(entries)
        entries.append(_Op(*self._entry(x), inputs))
        refs.append(n)
    return (tuple(entries), tuple(index[n] for n in results)), refs

  def result(self):
    groups = {}
    templates = {}
    for root in self.chains:
      signature, refs = self.template(root)
      templates[root] = (signature, refs)
      groups.setdefault(signature, []).append(root)
    # A chain whose result reaches one of its own ops through other ops cannot run as one node.
    nodes = _Dependencies(self, set())
    groups = {s: [r for r in roots if nodes.convex(self.chains[r])] for s, roots in groups.items()}
    groups = {s: roots for s, roots in groups.items() if len(roots) > 1}
    if not groups:
      return self.gd if self.reshapes else None
    deps = _Dependencies(self, {root for roots in groups.values() for root in roots})
    fused = []
    for signature, roots in groups.items():
      remaining = sorted(roots, key=lambda r: self.position[self.chains[r][0]])
      while len(remaining) > 1:
        chosen = deps.independent(remaining)
        remaining = [r for r in remaining if r not in chosen]
        if len(chosen) > 1:
          plan = _Plan(self, signature, [templates[r][1] for r in chosen])
          if plan.saves():
            deps.merge(chosen)
            fused.append(plan)
    if not fused:
      return self.gd if self.reshapes else None
    return _rewrite(self.gd, fused)


class _Dependencies:
  """Reachability between the candidate chains in the graph where each fused group is one node."""

  def __init__(self, fusion, candidates):
    self.fusion = fusion
    self.unit = {n: fusion.chain_of[n] if fusion.chain_of.get(n) in candidates else n for n in fusion.order}
    self.preds = {}
    for n in fusion.order:
      u = self.unit[n]
      self.preds.setdefault(u, set()).update(self.unit[node_of(i)] for i in fusion.nodes[n].input)
      self.preds[u].discard(u)
    self.bit = {u: 1 << k for k, u in enumerate(self.preds)}
    self._ancestors()

  def _ancestors(self):
    succs = {u: [] for u in self.preds}
    waiting = {}
    for u, ps in self.preds.items():
      waiting[u] = len(ps)
      for p in ps:
        succs[p].append(u)
    ready = [u for u, k in waiting.items() if k == 0]
    self.anc = {}
    while ready:
      u = ready.pop()
      a = 0
      for p in self.preds[u]:
        a |= self.anc[p] | self.bit[p]
      self.anc[u] = a
      for s in succs[u]:
        waiting[s] -= 1
        if not waiting[s]:
          ready.append(s)
    if len(self.anc) != len(self.preds):
      raise AssertionError("horizontal fusion: the graph has a cycle")

  def convex(self, members):
    """Whether no path leaves the set of nodes `members` and comes back to it."""
    mask = 0
    for n in members:
      mask |= self.bit[self.unit[n]]
    return not any(self.anc[self.unit[node_of(i)]] & mask for n in members for i in self.fusion.nodes[n].input
                   if node_of(i) not in members)

  def independent(self, roots):
    """The first of `roots` and each later one that no one chosen before it reaches or is reached by."""
    chosen, mask, below = [], 0, 0
    for r in roots:
      u = self.unit[r]
      if not self.anc[u] & mask and not below & self.bit[u]:
        chosen.append(r)
        mask |= self.bit[u]
        below |= self.anc[u]
    return chosen

  def merge(self, roots):
    head = self.unit[roots[0]]
    units = {self.unit[r] for r in roots}
    for n, u in self.unit.items():
      if u in units:
        self.unit[n] = head
    merged = set().union(*(self.preds.pop(u) for u in units)) - units
    for u in units - {head}:
      del self.bit[u]
    for ps in self.preds.values():
      if ps & units:
        ps -= units
        ps.add(head)
    self.preds[head] = merged
    self._ancestors()


class _Plan:
  """How one group of like chains runs fused: its members' refs, position by position of their template."""

  def __init__(self, fusion, signature, members):
    self.fusion, self.members = fusion, members
    self.entries, self.results = signature
    self.k = len(members)
    self.rank = max(len(e.shape) for e in self.entries)
    readers = {}
    for t, e in enumerate(self.entries):
      if isinstance(e, _Op):
        for i in e.inputs:
          readers.setdefault(i, set()).add(e.op)
    # An operand slot broadcasts (every member reads one tensor, or equal constants) only into ops that broadcast.
    self.shared = set()
    for t, e in enumerate(self.entries):
      if isinstance(e, _Operand) and all(_elementwise_form(op) == "broadcasting" for op in readers.get(t, ())):
        refs = [m[t] for m in members]
        if len(set(refs)) == 1 or (e.const and len({self.value(r).tobytes() for r in refs}) == 1):
          self.shared.add(t)
    # Differing constants become one constant, up to CONST_LIMIT bytes; larger ones are packed as other operands.
    self.stacked = {t for t, e in enumerate(self.entries) if isinstance(e, _Operand) and e.const and
                    self.k * int(np.prod(e.shape)) * tf.as_dtype(e.dtype).size <= CONST_LIMIT}
    while True:   # every op needs an operand with the member dimension
      lane = {}
      for t, e in enumerate(self.entries):
        lane[t] = t not in self.shared if isinstance(e, _Operand) else any(lane[i] for i in e.inputs)
      flat = [t for t, e in enumerate(self.entries) if isinstance(e, _Op) and not lane[t]]
      if not flat:
        break
      for t in flat:
        self.shared -= set(self.entries[t].inputs)

  def value(self, r):
    return tf.make_ndarray(self.fusion.nodes[node_of(r)].attr["value"].tensor)

  def _padded(self, shape):
    return len(shape) < self.rank

  def saves(self):
    ops = sum(1 for e in self.entries if isinstance(e, _Op))
    cost = ops
    for t, e in enumerate(self.entries):
      if isinstance(e, _Operand) and t not in self.shared and t not in self.stacked:
        cost += 1 + self._padded(e.shape)   # a Pack, and a Reshape where the rank is lower
    cost += sum(1 + self._padded(self.entries[t].shape) for t in self.results)   # an Unpack (and a Reshape)
    return self.k * ops > cost


def _imported(gd):
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(gd, name="")
  return graph


def _rewrite(gd, plans):
  """`gd` with each plan's group as one chain: new nodes added, readers rewired, the members' ops removed."""
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(gd)
  replaced, removed = {}, set()
  for g, plan in enumerate(plans):
    replaced.update(_emit(out, plan, f"fused_{g}"))
    removed.update(m[t] for m in plan.members for t, e in enumerate(plan.entries) if isinstance(e, _Op))
  kept = [x for x in out.node if x.name not in removed]
  del out.node[:]
  out.node.extend(kept)
  for x in out.node:
    inputs = [replaced.get(normalize(i), i) for i in x.input]
    del x.input[:]
    x.input.extend(graph_view.dedupe_controls(inputs))
  return out


def _emit(out, plan, scope):
  """Write `plan`'s fused chain into `out` under `scope`; returns {member's tensor or control ref: its new ref}."""
  k, rank, fusion = plan.k, plan.rank, plan.fusion
  first = plan.members[0]

  def const(name, value):
    graph_view.write_const(out.node.add(name=name), value)
    return name + ":0"

  def reshape(name, r, dims, dtype):
    graph_view.write(out.node.add(name=name), "Reshape", [r, const(name + "/shape", np.array(dims, np.int64))],
                     T=tf.as_dtype(dtype), Tshape=tf.int64)
    return name + ":0"

  refs = {}
  for t, e in enumerate(plan.entries):
    name = f"{scope}/{t}"
    if isinstance(e, _Operand):
      dtype, shape = e.dtype, e.shape
      padded = [k] + [1] * (rank - len(shape)) + list(shape)
      if t in plan.shared:
        refs[t] = first[t]
      elif t in plan.stacked:
        refs[t] = const(name, np.stack([plan.value(m[t]) for m in plan.members]).reshape(padded))
      else:
        graph_view.write(out.node.add(name=name), "Pack", [m[t] for m in plan.members], T=tf.as_dtype(dtype), N=k,
                         axis=0)
        refs[t] = reshape(name + "/ranked", name + ":0", padded, dtype) if len(shape) < rank else name + ":0"
      continue
    x = fusion.nodes[first[t]]
    node = out.node.add()
    node.CopyFrom(x)
    node.name = name
    del node.input[:]
    node.input.extend(refs[i] for i in e.inputs)
    refs[t] = name + ":0"
  replaced = {}
  for t in plan.results:
    dtype, shape = plan.entries[t].dtype, plan.entries[t].shape
    source = refs[t]
    if len(shape) < rank:
      source = reshape(f"{scope}/{t}/unranked", source, [k] + list(shape), dtype)
    node = graph_view.write(out.node.add(name=f"{scope}/{t}/each"), "Unpack", [source], T=tf.as_dtype(dtype), num=k,
                            axis=0)
    for j, m in enumerate(plan.members):
      replaced[f"{m[t]}:0"] = f"{node.name}:{j}"
  for t, e in enumerate(plan.entries):
    if isinstance(e, _Op):
      for m in plan.members:
        replaced["^" + m[t]] = f"^{scope}/{t}"
  return replaced
