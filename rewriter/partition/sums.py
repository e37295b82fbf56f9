"""Partial sums added before they are reduced (XLA's all-reduce reassociation).

A rule that reduces a factor over mesh axes (a matmul contracting a split dim) leaves each device one term of its
result's sum. When the only reader of that result is an element-wise linear op (`loops.sum_inputs`: AddN, AddV2,
Add, Sub, Neg, Identity, Snapshot) the sum stays pending (*held*), in the layout the rule produced it in: if every
operand of that op is held over the same mesh axes in the same layout, the op runs on the terms and its result
is one sum of all of them, reduced once (or held again, up a chain of adds). Megatron's backward then reduces the
q, k and v input gradients as one, and a tied embedding's two gradients as one. Any other reader (an op that
needs the value, an add whose operands do not all agree) reduces the held sum first, just as it would have been
reduced where it was produced: holding never costs a collective, and a sum op passes its terms on only when
reducing its result moves no more bytes than reducing them one by one.

`PartialSums` is a part of `partition.PartitionContext`: it uses the context's `values`, `ir`, `program`,
`report`, `tree_nodes` and emission helpers. Loop bodies' accumulators (`accumulation.PendingSums`) are a
separate mechanism: a node of an accumulation tree is left to it.
"""

import dataclasses
from typing import Tuple

import tensorflow as tf

from tf_gspmd import ops as op_rules
from tf_gspmd._layout.mesh import axes_text
from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.rewriter.graph import loops
from tf_gspmd.rewriter.sharding import reshard
from tf_gspmd.rewriter.graph.graph_view import public_key


@dataclasses.dataclass(frozen=True)
class Held:
  """A sum held pending in a tensor: its partial (mesh axes, "Add"), its completed sharding, how many terms of
  the graph's it adds up, and where its reduction is named from: the node that produced the sum, the tensor and
  the reason's text (a single term passed through copies or negations keeps its producer's, so its reduction
  reads as it did where it was produced)."""

  partial: Tuple
  target: Sharding
  terms: int
  node: str
  key: str
  what: str


class PartialSums:
  """Sums held pending until their first reader that needs the value (mixed into PartitionContext)."""

  held = None      # ref -> Held; its value in `values` is laid out as the rule produced it
  summed = 1       # how many terms the current node's output adds up (set by `reassociate`)
  _passed = None   # the Held of the one term the current node passes on, if it passes just one
  _summed_by = None

  def _readers_of_sums(self):
    if self._summed_by is None:
      self._summed_by = loops.summed_by(self.ir)
    return self._summed_by

  def hold_sum(self, r, value, natural, partial):
    """Keep output `r` of the current node (local `value` laid out as `natural`, + `partial`) with its sum
    pending when its one reader may add it to other terms; returns whether it did."""
    info = self.ir.info(r)
    if (not partial or partial[1] != "Add" or not info.partitionable or info.shape is None or
        r not in self._readers_of_sums()):
      return False
    natural = natural.with_rank(len(info.shape))
    if set(partial[0]) & set(natural.used_axes):
      return False
    one = self._passed
    self.held[r] = Held(tuple(partial), self.program.shardings[r], self.summed,
                        *((one.node, one.key, one.what) if one else
                          (self.node.name, public_key(r), self._produces(natural, partial))))
    self._store(r, value, natural)
    return True

  def _produces(self, natural, partial):
    """The reduction's reason text: what the current node produces."""
    return f"{self.node.name} ({self.node.op}) produces {natural} as partial {partial[1]} over {axes_text(partial[0])}"

  def summed_text(self):
    """The reason's tail for a reduction of several terms added first (empty for one)."""
    return f"; sum of {self.summed} partial terms reduced once" if self.summed > 1 else ""

  def reassociate(self, node):
    """Partition `node` here when it is an element-wise linear op (`loops.sum_inputs`) whose operands all hold
    sums pending over the same axes in the same layout, and reducing its result moves no more bytes than
    reducing them apart: the op runs on the terms, and its result is their sum, held or reduced (`set_output`).
    Returns whether it did."""
    self.summed, self._passed = 1, None
    which = loops.sum_inputs(node) if node.name not in self.tree_nodes else None
    if not which:
      return False
    refs = list(dict.fromkeys(node.inputs[i] for i in which))
    if any(r not in self.held for r in refs):
      return self._reassociate_mixed(node, which)
    agreed = self._agreed_terms(refs)
    if agreed is None:
      return False
    sums, partial, natural = agreed
    terms = sum(s.terms for s in sums)
    if terms == 1 and node.ref(0) not in self._readers_of_sums():   # one term, no more to meet: reduced as it was
      return False
    self._take_terms(refs, natural)
    self.summed, self._passed = terms, (sums[0] if terms == 1 else None)
    rule = op_rules.lookup(node.op)   # the op's own local computation (an annotation's is a copy)
    outs = rule.emit(self, node, [self.values[node.inputs[i]][0] for i in rule.data_inputs(node)], None)
    self.set_output(0, outs[0], natural, partial)
    return True

  def _reassociate_mixed(self, node, which):
    """`node` adds held sums to complete values (a residual's gradient plus the partial gradients of the layers
    reading it): being linear, it is its held terms alone (the others zero), reduced once, plus its complete
    terms alone (the held ones zero). Done when at least two terms are held alike and reducing their sum moves no
    more bytes than reducing them apart."""
    held_refs = list(dict.fromkeys(node.inputs[i] for i in which if node.inputs[i] in self.held))
    agreed = self._agreed_terms(held_refs) if len(held_refs) > 1 else None
    if agreed is None:
      return False
    sums, partial, natural = agreed
    out = node.ref(0)
    info = self.ir.info(out)
    target = self.program.shardings[out].with_rank(len(info.shape))
    rule = op_rules.lookup(node.op)
    data = rule.data_inputs(node)
    complete = {i: self.operand(i, target) for i in data if node.inputs[i] not in self.held}
    self._take_terms(held_refs, natural)
    held_part = [self.values[node.inputs[i]][0] if i not in complete else
                 tf.zeros(natural.shard_shape(info.shape), info.dtype) for i in data]
    complete_part = [complete[i] if i in complete else tf.zeros(target.shard_shape(info.shape), info.dtype)
                     for i in data]
    self.summed = sum(h.terms for h in sums)
    with tf.name_scope(self._scope()), self.report.resharding_of(public_key(out), natural, target, False):
      (summed,) = rule.emit(self, node, held_part, None)[:1]
      reduced = reshard.emit_reshard(self, summed, info.shape, natural, target, partial, node.name,
                                     f"{self._produces(natural, partial)}; {public_key(out)} is completed as "
                                     f"{target}{self.summed_text()}")
    (rest,) = rule.emit(self, node, complete_part, None)[:1]
    self._store(out, tf.add(reduced, rest), target)
    return True

  def _agreed_terms(self, refs):
    """(their Held sums, the partial, the layout they are added in) of the sums held in `refs` when they are pending
    over the same axes, meet in one layout (`_common_layout`), and reducing their sum once moves no more bytes than
    reducing them apart; else None."""
    sums = [self.held[r] for r in refs]
    if len({s.partial for s in sums}) != 1:
      return None
    out, partial = self.node.ref(0), sums[0].partial
    info = self.ir.info(out)
    natural = self._common_layout(refs, info.shape, partial)
    if natural is None:
      return None

    def cost(src, target):
      return reshard.plan_bytes(info.shape, info.dtype.size, src, target.with_rank(len(info.shape)), partial)
    if cost(natural, self.program.shardings[out]) > sum(cost(self.values[r][1], s.target) for r, s in zip(refs, sums)):
      return None
    return sums, partial, natural

  def _take_terms(self, refs, natural):
    """The held sums of `refs` leave `held`, each laid out as `natural` (a partial term sliced locally where it is
    not: the devices its sum does not span hold it alike)."""
    info = self.ir.info(self.node.ref(0))
    for r in refs:
      value, own = self.values[r]
      if own != natural:
        self._store(r, reshard.emit_reshard(self, value, info.shape, own, natural, None, self.node.name, ""), natural)
      del self.held[r]

  def _common_layout(self, refs, shape, partial):
    """The layout the terms `refs` are added in: theirs when they agree; else, when each reaches the sum's
    completed layout by local slices alone (by axes the pending reduction does not span), that layout."""
    layouts = {self.values[r][1].with_rank(len(shape)) for r in refs}
    if len(layouts) == 1:
      return layouts.pop()
    target = self.program.shardings[self.node.ref(0)].with_rank(len(shape))
    if target.is_maximal or set(partial[0]) & set(target.used_axes):
      return None
    for layout in layouts:
      steps = reshard.plan_reshard(shape, layout, target)
      if not all(isinstance(st, reshard.LocalSlice) for st in steps):
        return None
    return target

  def settle_sum(self, r):
    """Reduce the sum held in `r` to its completed sharding (it is read by an op that needs its value): the
    reduction it would have had where it was produced, emitted as that node's."""
    held = self.held.pop(r)
    value, natural = self.values[r]
    info = self.ir.info(r)
    requested = (self.program.annotations or {}).get(r) is not None
    with self._as_node(self.ir.node(held.node)), self.graph.name_scope(None), self.graph.control_dependencies(None):
      with tf.name_scope(self._scope()), self.report.resharding_of(held.key, natural, held.target, requested):
        tail = f"; sum of {held.terms} partial terms reduced once" if held.terms > 1 else ""
        value = reshard.emit_reshard(self, value, info.shape, natural, held.target, held.partial, held.node,
                                     f"{held.what}; {held.key} is completed as {held.target}{tail}")
    self._store(r, value, held.target)
