"""Rules as data: an op described by named factors per dimension, like an einsum ("m k, k n -> m n").

A factor that appears in an output is carried through: its mesh axes pass from operands to the output and
back. A factor absent from every output is *reduced*: splitting it leaves each device with a partial
result, combined by one all-reduce with `reduce_op` (masking uneven padding with that op's identity).
`FactorRule` implements forward, backward and partition once for every op that declares its factors, and
enumerates the op's strategies (`FactorRule.strategies`: every assignment of mesh axes to its factors that
divides them evenly), the choices automatic sharding prices.
"""

import dataclasses
import itertools
import math
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.registry import Rule

Labels = Tuple[Optional[str], ...]


@dataclasses.dataclass(frozen=True)
class Factors:
  """An op's factors: one label per dim of each data operand and each output (like an einsum's subscripts)."""

  operands: Tuple[Labels, ...]      # one label tuple per data input (None = broadcast size-1 dim)
  outputs: Tuple[Labels, ...]       # one label tuple per output
  reduce_op: str = "Add"            # how partial results over reduced factors combine

  @property
  def reduced(self):
    """The labels of operands absent from every output, in order of first appearance."""
    out = {l for labels in self.outputs for l in labels if l}
    seen = []
    for labels in self.operands:
      for l in labels:
        if l and l not in out and l not in seen:
          seen.append(l)
    return seen

  @property
  def labels(self):
    """Every factor label of the operands and outputs, sorted."""
    return sorted({l for labels in self.operands + self.outputs for l in labels if l})

  def partial(self, axes_of):
    """The partial sums a split `axes_of` ({label: mesh axes}) leaves in the outputs: (mesh axes, reduce op), the
    axes of every split reduced factor in the order of `reduced`, or None when no reduced factor is split."""
    reduced_split = [l for l in self.reduced if axes_of.get(l)]
    if not reduced_split:
      return None
    return tuple(a for l in reduced_split for a in axes_of[l]), self.reduce_op


def identity_value(reduce_op, dtype):
  """The identity element of `reduce_op` for `dtype` (the value padding is masked with)."""
  np_dtype = np.dtype(dtype.as_numpy_dtype) if hasattr(dtype, "as_numpy_dtype") else np.dtype(dtype)
  if reduce_op == "Add":
    return np_dtype.type(0)
  if reduce_op == "Mul":
    return np_dtype.type(1)
  if np.issubdtype(np_dtype, np.floating):
    return np_dtype.type(-np.inf if reduce_op == "Max" else np.inf)
  if np_dtype == np.bool_:
    return np.bool_(reduce_op == "Min")
  info = np.iinfo(np_dtype)
  return np_dtype.type(info.min if reduce_op == "Max" else info.max)


def dims_from(labels, axes_of, prefer=None):
  """Dims of a sharding for a tensor with `labels`, taking each label's axes, skipping axes already used:
  `Sharding(mesh, dims_from(labels, axes_of))` is the layout a split `axes_of` ({label: mesh axes}) gives it.

  A label that repeats (an einsum diagonal, "ii->i") is split on one of its dims only, the others stay whole:
  the one that `prefer` (the operand's current layout) already splits by those axes, else the first.
  """
  place = {}
  if prefer is not None and not prefer.is_maximal:
    prefer = prefer.with_rank(len(labels))
    for d, l in enumerate(labels):
      if l and l not in place and labels.count(l) > 1 and axes_of.get(l) and prefer.dims[d] == tuple(axes_of[l]):
        place[l] = d
  used = set()
  dims = []
  for d, l in enumerate(labels):
    ax = axes_of.get(l, ()) if l and place.get(l, d) == d else ()
    if used & set(ax):
      ax = ()
    used.update(ax)
    dims.append(ax)
  return tuple(dims)


def assignments(mesh, labels, size_of):
  """Every map label -> mesh axes (each mesh axis of size > 1 on one label or none) that divides the labels'
  sizes (`size_of`: {label: size}) evenly, in one fixed order (the unsplit map last).

  The one enumeration of splits: a tensor's candidate layouts (its dims as labels) and an op's strategies
  (`FactorRule.strategies`, its factors as labels) are both drawn from it. A label of unknown size stays whole.
  """
  axes = [a for a in mesh.axis_names if mesh.axis_size(a) > 1]
  out = []
  for assign in itertools.product(range(len(labels) + 1), repeat=len(axes)):
    axes_of = {}
    for a, k in zip(axes, assign):
      if k < len(labels):
        axes_of[labels[k]] = axes_of.get(labels[k], ()) + (a,)
    if all(l in size_of and size_of[l] % math.prod(mesh.axis_size(a) for a in ax) == 0 for l, ax in axes_of.items()):
      out.append(axes_of)
  return out


def _layout_shape(info):
  """The shape a tensor's layout splits: its own, or a variable handle's value shape; None when opaque."""
  if info.partitionable:
    return tuple(int(d) for d in info.shape)
  if info.value_shape is not None and not info.is_list:
    return tuple(int(d) for d in info.value_shape)
  return None


def _diagonal_blocks(ctx, x, shape, layout, labels):
  """Operand `x` (laid out as `layout`) cut to each device's diagonal block along its repeated labels.

  An einsum reads an operand with a repeated label ("ii->i") only where those dims agree, so when one of them
  is split each device needs, of the others, just the rows its own shard covers: a local slice at the same
  offset (zero-padded past the end), no communication. Padding rows stay garbage like any shard's padding.
  """
  for l in dict.fromkeys(labels):
    dims = [d for d, m in enumerate(labels) if m == l]
    split = [d for d in dims if layout.dims[d]]
    if l is None or len(dims) < 2 or not split:
      continue
    d0 = split[0]
    n = layout.tiles(d0)
    c = -(-shape[d0] // n)
    with ctx.helper_scope():
      local = x.shape.as_list()
      pads = [[0, n * c - local[d] if d in dims and d != d0 else 0] for d in range(len(local))]
      if any(p[1] for p in pads):
        x = tf.pad(x, pads)
      begin = np.zeros((ctx.mesh.size, len(local)), np.int32)
      for p in range(ctx.mesh.size):
        begin[p, [d for d in dims if d != d0]] = layout.tile_index(p, d0) * c
      size = [c if d in dims else s for d, s in enumerate(local)]
      x = tf.slice(x, ctx.lookup(begin, f"diagonal_begin_{d0}_{c}"), size)
  return x


def _elements(info):
  """The number of elements of a tensor (a variable handle: of its value); 0 when unknown."""
  shape = _layout_shape(info)
  return math.prod(shape) if shape is not None else 0


def _axes_by_label(labels, sharding):
  if sharding is None or sharding.is_maximal:
    return None
  s = sharding.with_rank(len(labels))
  return {l: s.dims[d] for d, l in enumerate(labels) if l and s.dims[d]}


class FactorRule(Rule):
  """A rule fully described by `factors(node)`; subclasses may override `emit` for the local computation."""

  # Forward candidates from the operand with more elements first (XLA's sharding propagation for dots: when
  # both operands are split in ways that do not combine, the result follows the larger one).
  prefer_larger_operand = False

  def factors(self, node) -> Factors:
    raise NotImplementedError

  def cached_factors(self, node):
    """`factors(node)`, computed once per node (completion asks many times)."""
    f = node.memo.get("factors")
    if f is None:
      f = node.memo["factors"] = self.factors(node)
    return f

  def split_reduced(self, node):  # pylint: disable=unused-argument
    """Whether reduced factors may stay split (partial results + all-reduce)."""
    return True

  def exclusive_factors(self, node):  # pylint: disable=unused-argument
    """Groups of factor labels of which `partition` can keep at most one split (automatic sharding keeps to it)."""
    return ()

  def factor_sizes(self, node):
    """{label: size} of every factor, from the shapes of the data inputs and outputs that carry it (the largest,
    where a broadcast size-1 dim shares a label)."""
    f = self.cached_factors(node)
    sizes = {}
    shapes = [_layout_shape(node.input_info(i)) for i in self.data_inputs(node)][:len(f.operands)]
    shapes += [_layout_shape(node.outputs[o]) for o in range(min(len(node.outputs), len(f.outputs)))]
    for labels, shape in zip(tuple(f.operands[:len(shapes)]) + tuple(f.outputs), shapes):
      for l, n in zip(labels, shape or ()):
        if l:
          sizes[l] = max(sizes.get(l, 1), n)
    return sizes

  def strategies(self, node, mesh):
    """Every assignment {factor label: mesh axes} of the mesh's axes to the op's factors that divides each factor
    evenly (`assignments` over `factors(node).labels`), with at most one factor of each `exclusive_factors` group
    split; the unsplit assignment last.

    Each strategy fixes the layout every operand must arrive in and the layout every output is made in
    (`dims_from`), and the partial sums left by split reduced factors (`Factors.partial`). Automatic sharding
    prices exactly these and hands the chosen one to `partition` (`ctx.planned_axes()`), which takes it as one
    of its plans. `partition`'s own two plans (as the outputs are wanted, as the operands are) follow the layouts
    completion produced, which may split a factor unevenly (padded shards); they keep to the same rule, each mesh
    axis on at most one factor, but are not restricted to this even enumeration, so that hand-written uneven
    layouts stay as written. Reduced factors of a rule whose `split_reduced` is False are enumerated too: the
    rule's `partition` decides whether it keeps them split (Gather's split table) or whole.
    """
    f = self.cached_factors(node)
    out = assignments(mesh, f.labels, self.factor_sizes(node))
    for group in self.exclusive_factors(node):
      out = [a for a in out if sum(1 for l in group if a.get(l)) <= 1]
    return out

  def internal_bytes(self, node, axes_of, mesh):  # pylint: disable=unused-argument
    """Bytes per device of the collectives `partition` emits inside the op for the split `axes_of` (beyond the
    reshards of its operands and the partial sums of reduced factors): what automatic sharding prices."""
    return 0

  def local_shape_input(self, ctx, node, axes_of, index):
    """The per-device shape of output 0, as a constant for the op's shape input `index` (ops like
    Conv2DBackpropInput or ScatterNd take their output shape as an input, which must become local)."""
    layout = Sharding(ctx.mesh, dims_from(self.factors(node).outputs[0], axes_of))
    return tf.constant(layout.shard_shape(node.outputs[0].shape), node.input_info(index).dtype)

  def emit(self, ctx, node, local_inputs, axes_of):  # pylint: disable=unused-argument
    """Local computation: by default the same op on the local shards (data inputs in order)."""
    return ctx.clone(node, dict(zip(self.data_inputs(node), local_inputs)))

  def forward(self, ctx, node, operands):
    f = self.cached_factors(node)
    data = self.data_inputs(node)
    operands = [operands[i] for i in data]
    order = list(range(min(len(f.operands), len(operands))))
    if self.prefer_larger_operand:   # candidates are merged in order: a tie keeps the first
      order.sort(key=lambda j: -_elements(node.input_info(data[j])))
    result = []
    for out_labels in f.outputs:
      cands = []
      for labels, s in ((f.operands[j], operands[j]) for j in order):
        axes_of = _axes_by_label(labels, s)
        if axes_of is not None:
          cands.append(Sharding(s.mesh, dims_from(out_labels, axes_of)))
      result.append(cands)
    return result

  def backward(self, ctx, node, outputs, operands):
    f = self.cached_factors(node)
    data = self.data_inputs(node)
    operands = [operands[i] for i in data]
    result = [[] for _ in node.inputs]
    reduced = set(f.reduced)
    for j, labels in enumerate(f.operands):
      cands = []
      for out_labels, s in zip(f.outputs, outputs):
        axes_of = _axes_by_label(out_labels, s)
        if axes_of is not None:
          cands.append(Sharding(s.mesh, dims_from(labels, axes_of)))
      # Reduced factors are known only from the other operands (dot: lhs contracting dim <- rhs).
      for k, (other, s) in enumerate(zip(f.operands, operands)):
        if k == j:
          continue
        axes_of = _axes_by_label(other, s)
        if axes_of:
          axes_of = {l: a for l, a in axes_of.items() if l in reduced}
          if axes_of:
            cands.append(Sharding(s.mesh, dims_from(labels, axes_of)))
      result[data[j]] = cands
    return result

  def partition(self, ctx, node):
    self.partition_with(ctx, node, self.factors(node))

  def partition_with(self, ctx, node, f):
    """Partition by the factors `f` (rules with several factorisations pick one and call this)."""
    data = self.data_inputs(node)
    # GSPMD's choice by estimated bytes: split as the output wants (operands follow), compute where the operands
    # already are (the result follows), or the output-driven split with one output factor left whole so that a
    # reduced factor keeps the operands' split over its axes (partial sums, then the result resharded: a
    # weight gradient from activations split over the batch). Ties keep the earlier plan.
    target = self._axes_from_target(ctx, node, f, data)
    plans = [target, self._axes_from_operands(ctx, node, f, data)] + self._reduced_instead(ctx, node, f, data,
                                                                                          target)
    planned = ctx.planned_axes()   # the strategy automatic sharding chose for this node, when it did
    labels = {l for ls in f.operands + f.outputs for l in ls if l}
    if planned is not None and set(planned) <= labels and (self.split_reduced(node) or
                                                           not any(planned.get(l) for l in f.reduced)):
      plans.append(planned)
    axes_of = min(plans, key=lambda p: self._cost(ctx, f, data, p))
    mesh = ctx.mesh
    reduced_split = [l for l in f.reduced if axes_of.get(l)]
    local = []
    for j, labels in enumerate(f.operands):
      req = Sharding(mesh, dims_from(labels, axes_of, ctx.current(data[j])))
      x = ctx.operand(data[j], req)
      shape = ctx.input_shape(data[j])
      for d, l in enumerate(labels):
        if l in reduced_split and shape[d] % req.tiles(d):
          x = ctx.mask(x, shape, req, d, identity_value(f.reduce_op, ctx.input_dtype(data[j])))
      local.append(_diagonal_blocks(ctx, x, shape, req, labels))
    outs = self.emit(ctx, node, local, axes_of)
    partial = f.partial(axes_of)
    for o, out_labels in enumerate(f.outputs):
      ctx.set_output(o, outs[o], Sharding(mesh, dims_from(out_labels, axes_of)), partial=partial)

  def _cost(self, ctx, f, data, axes_of):
    mesh = ctx.mesh
    cost = sum(ctx.operand_cost(data[j], Sharding(mesh, dims_from(labels, axes_of, ctx.current(data[j]))))
               for j, labels in enumerate(f.operands))
    partial = f.partial(axes_of)
    return cost + sum(ctx.output_cost(o, Sharding(mesh, dims_from(labels, axes_of)), partial)
                      for o, labels in enumerate(f.outputs))

  def _axes_from_target(self, ctx, node, f, data, whole=()):
    """Output labels split as the completed outputs (those in `whole` left whole); reduced labels as the operands
    already are."""
    mesh = ctx.mesh
    axes_of, used = {}, set()
    for o, out_labels in enumerate(f.outputs):
      target = ctx.target(o)
      if not target.is_maximal:   # (an opaque result, e.g. a string, is completed as rank-free replicated)
        target = target.with_rank(len(out_labels))
      for d, l in enumerate(out_labels):
        ax = () if target.is_maximal or l in whole else target.dims[d]
        if l and l not in axes_of and not used & set(ax):
          axes_of[l] = ax
          used.update(ax)
    # Reduced factors: keep the largest existing split of an operand that does not clash (slicing is free,
    # gathering is not; the partial result then costs one all-reduce).
    splits = list(_operand_splits(ctx, f, data)) if self.split_reduced(node) else []
    for l in f.reduced:
      best = ()
      for lab, ax in splits:
        if lab == l and not used & set(ax) and _size(mesh, ax) > _size(mesh, best):
          best = ax
      axes_of[l] = best
      used.update(best)
    return axes_of

  def _reduced_instead(self, ctx, node, f, data, target):
    """Variants of the output-driven plan `target`: per split output factor, the output-driven plan with that
    factor whole (its mesh axes free for the reduced factors the operands split over them); only variants that
    split a reduced factor otherwise than `target` are kept."""
    if not self.split_reduced(node) or not f.reduced:
      return []
    variants = []
    for l in dict.fromkeys(l for ls in f.outputs for l in ls if l and target.get(l)):
      axes_of = self._axes_from_target(ctx, node, f, data, whole={l})
      if any(axes_of.get(r) != target.get(r) for r in f.reduced) and axes_of not in variants:
        variants.append(axes_of)
    return variants

  def _axes_from_operands(self, ctx, node, f, data):
    """Every label split as the operands already are (first operand wins, no mesh axis used twice)."""
    axes_of, used = {}, set()
    split_reduced = self.split_reduced(node)
    for l, ax in _operand_splits(ctx, f, data):
      if l not in axes_of and not used & set(ax) and (split_reduced or l not in f.reduced):
        axes_of[l] = ax
        used.update(ax)
    return axes_of


def _operand_splits(ctx, f, data):
  """(label, mesh axes) for every split dim of the operands as they currently are, in operand order."""
  for j, labels in enumerate(f.operands):
    cur = ctx.current(data[j])
    if cur is None or cur.is_maximal:
      continue
    cur = cur.with_rank(len(labels))
    for d, l in enumerate(labels):
      if l and cur.dims[d]:
        yield l, cur.dims[d]


def _size(mesh, axes):
  return math.prod(mesh.axis_size(a) for a in axes) if axes else 1


def broadcast_labels(out_shape, in_shapes):
  """Factor labels of elementwise operands under numpy broadcasting (size-1 broadcast dims get None)."""
  rank = len(out_shape)
  out = tuple(f"d{i}" for i in range(rank))
  ins = []
  for shape in in_shapes:
    r = len(shape)
    ins.append(tuple(None if (shape[i] == 1 and out_shape[rank - r + i] != 1) else f"d{rank - r + i}"
                     for i in range(r)))
  return tuple(ins), out


def dim_labels(rank, prefix="d"):
  """One factor label per dim: ("d0", "d1", ...)."""
  return tuple(f"{prefix}{i}" for i in range(rank))


def unsplit(labels, dims):
  """`labels` with the dims in `dims` carrying no factor (whole on every device)."""
  return tuple(None if k in dims else l for k, l in enumerate(labels))


def const_axis(node, i, rank):
  """The axis held by constant input i, in [0, rank); None when the input is not a constant."""
  v = node.const_input(i)
  return None if v is None else int(np.asarray(v).reshape(-1)[0]) % max(rank, 1)
