"""The memory budget's part of the model: `rewriter.sharding.memory`'s count at the layouts the solver considers.

`Simulation` is the global program under the memory rules, unpartitioned. Which activation buffers are live at an
op does not depend on their bytes, so the live bytes at one op are linear in the choices: a `MemoryRow`. The
builder (`Pricing`, mixed into `model.Builder`) states rows at the ops where the unpartitioned program peaks and
where it peaks split as far as it goes; `plan.run` adds the row of the op a chosen plan peaks at when that is over
the budget. A tensor is priced at its group's layout; a loop body and a list a loop keeps for the backward (whose
layouts completion decides after this pass) at the share of the loop's carried operands one device holds, scaled up
by `calibrate` to what completion gives the chosen plan where the share priced them lower.
"""

import numpy as np

from tf_gspmd.rewriter.sharding import device_memory, memory
from tf_gspmd.rewriter.graph.graph_view import ref, split_ref


class Simulation:
  """The global program's buffers under the rules, for a model that prices them at layouts of its choosing.

  Liveness does not depend on sizes: `live_at(step)` is the set of activation buffers live at an op whatever
  their bytes; `peak_step(size, inner)` finds the op at which given bytes peak. `whole` holds each activation
  buffer's unpartitioned bytes, `lists` the While node whose kept list a buffer is, `calls` each control-flow
  node's bodies' unpartitioned bytes above their parameters, `carried` its operands that shape what its bodies
  compute (a loop's: those its body changes, not the loop-invariant weights; all, where that leaves none),
  `constant_bytes` the constants (whole).
  """

  def __init__(self, program):
    ir = program.ir
    variables, handles = {}, {}
    for name in program.variable_names:
      info = ir.info(ref(name))
      if info.value_shape is not None:
        variables[name] = memory.shard_bytes(info.value_shape, info.value_dtype)
        handles[ref(name)] = (tuple(info.value_shape), info.value_dtype)
    lists = memory.kept_lists(ir, lambda r: None)   # the program unpartitioned: every tensor whole
    self.prog = memory.Buffers(ir.graph_def, memory.ir_outputs(ir), program.input_names, variables,
                               program.output_refs, lists, fills=memory.fills(ir, lambda r: None))
    self.prog.handles = handles
    cache = {}
    self.calls = {nd.name: device_memory.body_bytes(self.prog, nd, cache, None)[0] for nd in self.prog.order
                  if nd.op in memory.CALL_OPS}
    self.whole = {b: s for b, s in self.prog.size.items() if self.prog.kind[b] == "activation"}
    self.lists = {r: split_ref(r)[0] for r in lists}
    self.carried = {}
    for name in self.calls:
      node = ir.node(name)
      operands = [r for r in node.inputs if ir.info(r).partitionable and ir.info(r).shape]
      if node.op in memory.WHILE_OPS:
        kept = memory.loop_results(ir.graph_def.library, node)
        changed = [r for k, r in enumerate(node.inputs) if r in operands and (k >= len(kept) or kept[k] != "kept")]
        operands = changed or operands
      self.carried[name] = operands
    self.constant_bytes = self.prog.persistent("constant")

  def live_at(self, step):
    """(activation buffers live at op `step`, the control-flow node running there or None)."""
    nd = self.prog.order[step]
    return set(self.prog.walk({}, stop=step)), (nd.name if nd.op in memory.CALL_OPS else None)

  def peak_step(self, size, inner):
    """The op at which activations of bytes `size` ({buffer: bytes}) and bodies of `inner` peak."""
    return self.prog.walk(inner, size)


class MemoryRow:
  """The bytes per device live at one op of the program beyond its arguments and variables (`rewriter.sharding.memory`'s
  rules): per block an array of bytes per choice, plus bytes no choice changes (constants, what is not priced)."""

  def __init__(self, step, terms=None, fixed=0.0):
    self.step = step
    self.terms = terms if terms is not None else {}
    self.fixed = float(fixed)

  def add(self, b, nbytes):
    self.terms[b] = self.terms.get(b, 0) + nbytes

  def total(self, state, b):
    """State and live bytes of block b per choice (0 when neither)."""
    return state.get(b, 0) + self.terms.get(b, 0)

  def value(self, state, choice):
    blocks = set(state) | set(self.terms)
    return self.fixed + sum(float(np.asarray(self.total(state, b))[choice[b]]) for b in blocks)

  def folded(self, of):
    out = MemoryRow(self.step, fixed=self.fixed)
    for b, arr in self.terms.items():
      out.add(of[b], arr)
    return out


class Pricing:
  """The builder's memory rows (a mixin of `model.Builder`: its groups, `find`, `usable`, `itemsize`, `model`)."""

  def _bytes(self, g, r=None):
    """Bytes per device of tensor r of group g (default: its root) at each of the group's candidate layouts."""
    if g.nbytes is None:
      g.nbytes = np.array([memory.shard_elements(g.shape, c) for c in g.cands], dtype=float)
    return g.nbytes * (g.itemsize if r is None else self.itemsize(r))

  def _memory(self):
    """The live bytes at the ops where the unpartitioned program peaks and where it peaks with every tensor split
    as far as it can be: one MemoryRow each (`plan.run` adds more where a chosen plan peaks elsewhere)."""
    self.sim = Simulation(self.program)
    self.scale, self.margin = {}, 0.0
    for operands in self.sim.carried.values():   # a loop's operands: their layouts price its body and lists
      for r in operands:
        if self.usable(r) and self.find(r) not in self.groups:
          self._group(r)
    steps = [self.sim.peak_step(self.sim.whole, self.sim.calls)]
    self._groups_at(steps[0])
    split = {b: min(self._price(b)[1] + sum(float(a.min()) for _, a in self._price(b)[0]), w)
             for b, w in self.sim.whole.items()}
    steps.append(self.sim.peak_step(split, {n: min(v, self._share_floor(n, v)) for n, v in self.sim.calls.items()}))
    self._groups_at(steps[1])
    for step in dict.fromkeys(steps):
      self.model.rows.append(self.row(step))

  def _groups_at(self, step):
    """A group (a layout of its own to choose) for each tensor live at op `step` that no op gave one."""
    for b in self.sim.live_at(step)[0]:
      if self.usable(b) and self.find(b) not in self.groups:
        self._group(b)
    self._priced = {}

  def _group_of(self, r):
    return self.groups.get(self.find(r)) if self.usable(r) else None

  def _share(self, node_name, amount, key=None):
    """[(block, bytes per choice)], fixed bytes: `amount` bytes of a control-flow node's body or kept list, priced
    at the share one device holds of the operands that shape them (`Simulation.carried`: their layouts' bytes over
    their whole bytes), times the scale `calibrate` found for `key` (the node, or the list's buffer)."""
    amount *= self.scale.get(node_name if key is None else key, 1.0)
    operands = self.sim.carried.get(node_name, ())
    whole = sum(memory.shard_bytes(self.ir.info(r).shape, self.ir.info(r).dtype) for r in operands)
    if not amount or not whole:
      return [], float(amount)
    terms, fixed = [], 0.0
    for r in operands:
      g = self._group_of(r)
      if g is None:
        fixed += amount * memory.shard_bytes(self.ir.info(r).shape, self.ir.info(r).dtype) / whole
      else:
        terms.append((g.id, amount * self._bytes(g, r) / whole))
    return terms, fixed

  def _share_floor(self, node_name, amount):
    terms, fixed = self._share(node_name, amount)
    return fixed + sum(float(a.min()) for _, a in terms)

  def _price(self, b):
    """[(block, bytes per choice)], fixed bytes of activation buffer b of the simulation (memoised)."""
    hit = self._priced.get(b)
    if hit is None:
      g = self._group_of(b)
      if b in self.sim.lists:
        hit = self._share(self.sim.lists[b], self.sim.whole[b], b)
      elif g is not None:
        hit = ([(g.id, self._bytes(g, b))], 0.0)
      else:   # not priced: whole
        hit = ([], float(self.sim.whole[b]))
      self._priced[b] = hit
    return hit

  def row(self, step):
    """The MemoryRow of op `step` of the simulation: constants, live activations, the bodies of a call there."""
    live, call = self.sim.live_at(step)
    row = MemoryRow(step, fixed=self.sim.constant_bytes + self.margin)
    for b in live:
      terms, fixed = self._price(b)
      row.fixed += fixed
      for block, arr in terms:
        row.add(block, arr)
    if call is not None:
      terms, fixed = self._share(call, self.sim.calls[call])
      row.fixed += fixed
      for block, arr in terms:
        row.add(block, arr)
    return row

  def peak(self, choice):
    """(the op at which the plan `choice` (per block) peaks, its MemoryRow): the simulation at its layouts."""
    def at(terms, fixed):
      return fixed + sum(float(a[choice[block]]) for block, a in terms)

    size = {b: at(*self._price(b)) for b in self.sim.whole}
    inner = {n: at(*self._share(n, v)) for n, v in self.sim.calls.items()}
    step = self.sim.peak_step(size, inner)
    return step, self.row(step)

  def calibrate(self, layouts, choice):
    """Scale the loop bodies and kept lists up to what they take in `layouts` (`memory.Layouts` of the plan
    `choice` completed) where the share of their operands priced them lower; whether any scale changed."""
    def at(terms, fixed):
      return fixed + sum(float(a[choice[block]]) for block, a in terms)

    changed = False
    pairs = [(n, n, layouts.inner(n), self._share(n, v)) for n, v in self.sim.calls.items()]
    pairs += [(b, self.sim.lists[b], layouts.lists.get(b, 0), self._price(b)) for b in self.sim.lists]
    for key, _, actual, priced in pairs:
      priced = at(*priced)
      if priced > 0 and actual > priced * (1 + 1e-9):
        self.scale[key] = self.scale.get(key, 1.0) * actual / priced
        changed = True
    self._priced = {}
    return changed
