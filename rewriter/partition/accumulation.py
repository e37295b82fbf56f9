"""Accumulators of a loop body kept with their sum pending across iterations (a gradient loop's weight gradients):
the partition pass's part that decides, node by node, whether a partial sum is passed on or reduced as it is read.

`PendingSums` is a part of `partition.PartitionContext`: it uses the context's `pending` ({tensor: (partial,
loop variables)}), `passing`, `carried`, `deferrable`, `tree_nodes`, `values`, `ir`, `program`, `mesh`, `report`
and emission scope. Which loop variables are accumulators is found by `loops.accumulators`.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.mesh import axes_text
from tf_gspmd.rewriter.graph import loops
from tf_gspmd.rewriter.sharding import reshard
from tf_gspmd.rewriter.graph.graph_view import public_key


class NotAccumulated(Exception):
  """A loop variable taken for an accumulator turned out to need its pending sum inside the body (its
  accumulation reshards, or meets a value pending over other axes): the body is partitioned again with every
  loop variable reduced in each iteration."""


class PendingSums:
  """Sums pending over mesh axes in a loop body (mixed into the partition pass's PartitionContext)."""

  def one_term(self, x, axes):
    """`x` (the same on the devices of each group over mesh `axes`) as a sum pending over `axes`: x on the first
    device of each group, zeros on the others (an exact split: the sum is x). Zeros are such a sum already."""
    static = tf.get_static_value(x)
    if static is not None and not np.any(static):
      return x
    where = [self.mesh.axis_index(a) for a in axes]
    first = np.array([not any(self.mesh.coords(p)[k] for k in where) for p in range(self.mesh.size)])
    with tf.name_scope(self._scope()):
      return tf.where(self.lookup(first, f"first_over_{'_'.join(axes)}"), x, tf.zeros_like(x))

  # ---- which sums stay pending --------------------------------------------------------------------------------
  def begin_node(self, node):
    """Before `node`'s rule runs: whether its output keeps a sum pending (`passing`). A node of an accumulation
    tree passes one when all its linear inputs are pending over the same axes (or carry only unreduced
    parameters); otherwise they are reduced as they are read."""
    self.passing = None
    which = loops.linear_inputs(node) if node.name in self.tree_nodes else None
    if not which:
      return
    states = [self.pending.get(node.inputs[i], (None, frozenset()) if self._zero(node.inputs[i]) else None)
              for i in which]
    axes = {p for p, _ in states if p is not None} if None not in states else None
    if axes is None or len(axes) > 1:
      return
    self.passing = (next(iter(axes), None), frozenset().union(*(ks for _, ks in states)))

  def _zero(self, r):
    """Whether tensor `r` is zeros (a sum pending over any axes, each device's term zero)."""
    if self.ir.producer(r).op in ("ZerosLike", "Zeros"):
      return True
    value = self.ir.const_value(r)
    return value is not None and not np.any(value)

  def _hold(self, r, natural, partial):
    """(kept, partial): whether output `r` of the current node is kept with its sum pending instead of reduced
    now, and else the partial its reshard has to reduce."""
    if r not in self.deferrable:
      return False, partial
    target = self.program.shardings[r].with_rank(len(self.ir.info(r).shape))
    if self.passing is not None:
      held, ks = self.passing
      if partial or natural != target:
        if held is not None and (ks or partial):
          raise NotAccumulated(r)
        return False, held or partial
      for k in ks:   # the parameters inside are now known to carry `held`
        if held is not None and self.carried.setdefault(k, held) != held:
          raise NotAccumulated(r)
      self.pending[r] = (held, ks)
      return True, None
    if not partial or partial[1] != "Add" or natural != target or set(partial[0]) & set(target.used_axes):
      return False, partial
    self.pending[r] = (tuple(partial), frozenset())
    return True, None

  def _settle(self, r):
    """Reduce the sum pending in `r` (it is read by an op that needs its value)."""
    held, ks = self.pending.pop(r)
    if held is None:
      for k in ks:   # carried whole
        self.carried.setdefault(k, None)
      return
    if ks:
      raise NotAccumulated(r)
    value, have = self.values[r]
    info = self.ir.info(r)
    with tf.name_scope(self._scope()), self.report.resharding_of(public_key(r), have, have, False):
      value = reshard.emit_reshard(self, value, info.shape, have, have, held, self.node.name,
                                   f"{public_key(r)} is read by {self.node.name} ({self.node.op}) as a whole sum "
                                   f"(pending {held[1]} over {axes_text(held[0])})")
    self.values[r] = (value, have)

  def accumulated(self, trees):
    """Loop variable k -> the partial it is carried with, for the accumulators `trees` (k -> tensors) of this
    body, once all its nodes are partitioned; raises NotAccumulated when a result disagrees with its parameter."""
    out = {}
    for k, tree in trees.items():
      state = self.pending.get(self.ir.outputs[k])
      want = self.carried.get(k)
      if state is None or state[0] is None:
        if want is not None:
          raise NotAccumulated(self.ir.outputs[k])
        continue
      if k not in state[1] or state[0] != want:
        raise NotAccumulated(self.ir.outputs[k])
      out[k] = want
    return out
