"""How a step's loss combines over microbatches: proven from the step's graph, or refused.

A pipeline runs the loss on each microbatch and combines the microbatches' losses (and gradients). That equals the
loss of the whole batch only for a loss of the form c(n) x sum over the rows r of h(row r) (+ a term that does not
depend on the batch), where n is the number of rows and h the same function whatever n: with c(n) = 1 (a sum over
the rows) the microbatches' losses add up to the batch's; with c(n) = 1/n (a mean) they average to it (a term
without the batch then stays as it is). `reduction` proves which, or refuses.

How: the loss is traced at the microbatch's rows and at the batch's (two graphs, the same Python), and the two
graphs are walked together, node by node (same names, same ops, same attributes; a constant may differ between
them, which makes it a value of the batch size). Each tensor gets an abstract value:
  free    it depends on neither the batch nor its size (parameters, constants equal in both graphs);
  nconst  it depends on the batch size only (a shape, a constant that differs);
  row     dim `dim` holds the batch rows, `k` entries per row, each depending on its own row only (and on free
          values) -- the same function of the row in both graphs;
  sum     c x the sum over the rows of a function of the row, c known in each graph (`c`), `affine` when a free
          term is added;
  top     none of these (`why` names the node): refused.
Each kind of op has a rule for these (element-wise ops and copies as ops/registry states them; contractions,
reductions, gathers, reshapes, slices, ...); any other op makes rows and sums `top`. Nothing is evaluated on data:
the answer holds for every input, and a loss the rules cannot place is refused, never guessed."""

import dataclasses
import math

import numpy as np
import tensorflow as tf

from tf_gspmd.errors import InputError
from tf_gspmd.ops import registry
from tf_gspmd.rewriter.stages.microbatch_values import (FREE, NCONST, Value, folded as _folded, row as _row,
                                                        shape as _shape, static as _static, top as _top)


# ---- element-wise ops ------------------------------------------------------------------------------------------

def _copies_value(op):
  """Whether `op` passes its one input on linearly (Identity, StopGradient, Neg: its rule's `linear`)."""
  return len(op.inputs) == 1 and registry.linear_inputs(op.type, 1) == (0,)


def _elementwise(op, opn, ins):
  """Broadcasting ops: rows meet rows of the same dim (after aligning ranks to the right) and values free of the
  batch that are whole (size 1) along it."""
  if any(s.kind == "sum" for s in ins):
    return _linear(op, ins, opn)
  if any(s.kind == "nconst" for s in ins):
    return _top(op, "combines the batch rows with a value computed from the batch size")
  out_rank = op.outputs[0].shape.rank
  if out_rank is None:
    return _top(op, "has a result of unknown rank")
  if op.type == "BiasAdd" and ins[1].kind == "row":
    return _top(op, "adds a bias that depends on the batch")
  aligned = {}
  for t, s in zip(op.inputs, ins):
    if s.kind == "row":
      rank = len(_shape(t))
      d = s.dim + (0 if op.type == "BiasAdd" else out_rank - rank)
      aligned[(d, s.k)] = True
  if len(aligned) != 1:
    return _top(op, "combines entries of different batch rows")
  (d, k), = aligned
  for i, (t, s) in enumerate(zip(op.inputs, ins)):
    shape = _shape(t)
    if s.kind != "free":
      continue
    if shape is None:
      return _top(op, f"broadcasts input {i}, of unknown rank, with the batch rows")
    pos = d - (out_rank - len(shape)) if not (op.type == "BiasAdd" and i == 1) else (
        0 if d == out_rank - 1 or (op.get_attr("data_format") == b"NCHW" and d == 1) else -1)
    if pos >= 0 and shape[pos] != 1:
      return _top(op, f"reads input {i}, which does not depend on the batch, along the batch rows (dim {pos})")
  return _row(d, k)


def _is_zero(op, i):
  v = _static(op.inputs[i])
  return v is not None and not np.any(v)


def _linear(op, ins, opn=None):
  """Ops of a sum over the rows that keep it one: adding sums of one scale ratio (and values free of the batch,
  which make it affine), scaling or dividing by values free of the batch or by a batch-size value known in both
  graphs (a count of entries), negating, casting between floats."""
  sums = [s for s in ins if s.kind == "sum"]
  if opn is not None and op.type in ("RealDiv", "Div", "DivNoNan", "Mul", "MulNoNan") and \
      [s.kind for s in ins] == ["sum", "nconst"] and not ins[0].affine:
    a, b = _folded(op.inputs[1]), _folded(opn.inputs[1])
    if a is not None and b is not None and a.size == b.size == 1 and a.item() and b.item():
      f = (1 / float(a.item()), 1 / float(b.item())) if "Div" in op.type else (float(a.item()), float(b.item()))
      return Value("sum", c=(ins[0].c[0] * f[0], ins[0].c[1] * f[1]))
  if any(s.kind in ("row", "nconst") for s in ins):
    return _top(op, "adds or multiplies a sum over the batch rows and per-row or batch-size values")
  if op.type in ("Add", "AddV2", "AddN", "Sub", "BiasAdd"):
    ratio = sums[0].c[1] / sums[0].c[0]
    if any(not math.isclose(s.c[1] / s.c[0], ratio, rel_tol=1e-9) for s in sums):
      return _top(op, "adds a sum over the batch rows to a mean over them")
    affine = any(s.affine for s in sums) or any(
        s.kind == "free" and not _is_zero(op, i) for i, s in enumerate(ins))
    return dataclasses.replace(sums[0], affine=affine)
  if len(sums) == 1 and (op.type in ("Mul", "MulNoNan") or (
      op.type in ("RealDiv", "Div", "DivNoNan") and ins[0].kind == "sum") or _copies_value(op)):
    return sums[0]
  if op.type == "Cast" and op.get_attr("SrcT").is_floating and op.get_attr("DstT").is_floating:
    return sums[0]
  return _top(op, "is not linear in the sum over the batch rows")


def _unary(op, opn, ins):
  s = ins[0]
  if s.kind == "row":
    return s
  return _linear(op, ins)


# ---- reductions and contractions -------------------------------------------------------------------------------

def _count(t, axes):
  shape = _shape(t) or ()
  sizes = [shape[a] if a < len(shape) else None for a in axes]
  return None if None in sizes else float(np.prod(sizes))


def _reduce(op, opn, ins):
  """Sum and Mean over the rows make a sum (a mean's scale: 1 / the entries it averages, in each graph); a
  reduction that keeps the rows keeps them; other reductions of the rows (Max, Prod, ...) are refused."""
  x = ins[0]
  axes = _static(op.inputs[1])
  rank = op.inputs[0].shape.rank
  if axes is None or ins[1].kind != "free" or rank is None:
    return _top(op, "reduces over axes that are not constant")
  axes = sorted({int(a) % rank for a in np.atleast_1d(axes)}) if rank else []
  keep = op.get_attr("keep_dims")
  if x.kind == "row" and x.dim not in axes:
    return _row(x.dim if keep else x.dim - sum(a < x.dim for a in axes), x.k)
  if op.type not in ("Sum", "Mean"):
    return _top(op, f"reduces the batch rows by {op.type}: not a sum or a mean over them")
  counts = (_count(op.inputs[0], axes), _count(opn.inputs[0], axes)) if op.type == "Mean" else (1.0, 1.0)
  if None in counts or 0.0 in counts:
    return _top(op, "averages over dims of unknown size")
  scale = (1.0 / counts[0], 1.0 / counts[1])
  if x.kind == "row":
    return Value("sum", c=scale)
  return Value("sum", c=(x.c[0] * scale[0], x.c[1] * scale[1]), affine=x.affine)


def _l2_loss(op, opn, ins):
  return Value("sum") if ins[0].kind == "row" else _top(op, "is not linear in the sum over the batch rows")


def _labels(op):
  """Per operand and for the result, a label per dim (einsum subscripts; None: a broadcast dim of size 1), or
  None where the op's form is not handled (an ellipsis)."""
  if op.type == "MatMul":
    a = ("k", "i") if op.get_attr("transpose_a") else ("i", "k")
    b = ("j", "k") if op.get_attr("transpose_b") else ("k", "j")
    return [a, b], ("i", "j")
  if op.type == "Einsum":
    eq = op.get_attr("equation").decode()
    if "..." in eq or "->" not in eq:
      return None
    ins, out = eq.split("->")
    return [tuple(s) for s in ins.split(",")], tuple(out)
  out_rank = op.outputs[0].shape.rank
  out_shape = _shape(op.outputs[0])
  adj = ("adj_x", "adj_y")
  labels = []
  for t, attr, mm in zip(op.inputs, adj, (("i", "k"), ("k", "j"))):
    shape = _shape(t)
    batch = tuple(f"b{d + out_rank - len(shape)}" if shape[d] == out_shape[d + out_rank - len(shape)] else None
                  for d in range(len(shape) - 2))
    labels.append(batch + (mm[::-1] if op.get_attr(attr) else mm))
  return labels, tuple(f"b{d}" for d in range(out_rank - 2)) + ("i", "j")


def _contract(op, opn, ins):
  """MatMul, BatchMatMul, Einsum: multilinear. Rows of one label (the batch's) stay rows where the result keeps
  that label and become a sum where it is contracted; a sum times values free of the batch stays a sum."""
  found = _labels(op)
  if found is None:
    return _top(op, "has a form (an ellipsis) the rules do not follow")
  labels, out = found
  sums = [s for s in ins if s.kind == "sum"]
  if sums:
    if len(sums) == 1 and all(s.kind in ("sum", "free") for s in ins):
      return sums[0]
    return _top(op, "multiplies a sum over the batch rows by per-row or batch-size values")
  if any(s.kind == "nconst" for s in ins):
    return _top(op, "combines the batch rows with a value computed from the batch size")
  rows = {(labels[i][s.dim], s.k) for i, s in enumerate(ins) if s.kind == "row"}
  if len(rows) != 1:
    return _top(op, "multiplies entries of different batch rows together")
  (label, k), = rows
  if label is None or any(label in labels[i] for i, s in enumerate(ins) if s.kind == "free") or any(
      labels[i].count(label) != 1 for i, s in enumerate(ins) if s.kind == "row"):
    return _top(op, "mixes the batch rows")
  return _row(out.index(label), k) if label in out else Value("sum")


# ---- data movement ------------------------------------------------------------------------------------------

def _gather(op, opn, ins):
  """A table free of the batch read at per-row indices gives rows; rows of a table read along another dim stay
  rows."""
  params, indices = ins[0], ins[1]
  axis = 0 if op.type in ("Gather", "ResourceGather") else _static(op.inputs[2])
  if axis is None or (op.type != "Gather" and op.get_attr("batch_dims") != 0):
    return _top(op, "gathers along a dim that is not constant (or with batch_dims)")
  if op.type == "ResourceGather":
    rank = op.outputs[0].shape.rank - op.inputs[1].shape.rank + 1
  else:
    rank = op.inputs[0].shape.rank
  axis = int(axis) % rank
  if params.kind == "free" and indices.kind == "row":
    return _row(axis + indices.dim, indices.k)
  if params.kind == "row" and indices.kind == "free" and params.dim != axis:
    d = params.dim if params.dim < axis else params.dim - 1 + op.inputs[1].shape.rank
    return _row(d, params.k)
  return _top(op, "gathers across the batch rows")


def _gather_nd(op, opn, ins):
  if ins[0].kind == "free" and ins[1].kind == "row" and ins[1].dim < op.inputs[1].shape.rank - 1:
    return ins[1]
  return _top(op, "gathers across the batch rows")


def _reshape(op, opn, ins):
  """A reshape keeps rows where the batch rows' entries stay together: the result's one dim whose size differs
  between the two graphs holds them, after as many entries as before them."""
  x = ins[0]
  if x.kind != "row":
    return x if x.kind == "sum" else _top(op, "reshapes by a shape that is not constant")
  shape_m, shape_n = _shape(op.outputs[0]), _shape(opn.outputs[0])
  if shape_m is None or None in shape_m or None in shape_n or len(shape_m) != len(shape_n):
    return _top(op, "has a result of unknown shape")
  differ = [d for d, (a, b) in enumerate(zip(shape_m, shape_n)) if a != b]
  before = int(np.prod(_shape(op.inputs[0])[:x.dim]))
  inner = int(np.prod(_shape(op.inputs[0])[x.dim + 1:])) * x.k
  if len(differ) == 1 and int(np.prod(shape_m[:differ[0]])) == before:
    d = differ[0]
    per = int(np.prod(shape_m[d + 1:]))
    if per and inner % per == 0:
      return _row(d, inner // per)
  return _top(op, "reshapes the batch rows together with other dims")


def _transpose(op, opn, ins):
  perm = _static(op.inputs[1])
  if ins[0].kind == "sum":
    return ins[0]
  if perm is None:
    return _top(op, "transposes by a permutation that is not constant")
  return _row(list(perm).index(ins[0].dim), ins[0].k)


def _expand_dims(op, opn, ins):
  if ins[0].kind == "sum":
    return ins[0]
  a = _axis(op.inputs[1], op.outputs[0].shape.rank)
  if a is None:
    return _top(op, "inserts a dim at a position that is not constant")
  return _row(ins[0].dim + (a <= ins[0].dim), ins[0].k)


def _squeeze(op, opn, ins):
  if ins[0].kind == "sum":
    return ins[0]
  removed = []
  for o in (op, opn):
    dims = list(o.get_attr("squeeze_dims"))
    rank = o.inputs[0].shape.rank
    shape = _shape(o.inputs[0])
    removed.append(sorted(int(a) % rank for a in dims) if dims else [d for d, n in enumerate(shape) if n == 1])
  x = ins[0]
  if removed[0] != removed[1] or x.dim in removed[0]:
    return _top(op, "squeezes the dim of the batch rows")
  return _row(x.dim - sum(a < x.dim for a in removed[0]), x.k)


def _keeps_rows(op, opn, ins):
  """Slice / Pad / Tile: rows stay rows where the op leaves their dim's size as it is in both graphs (no cut,
  pad or repeat of it) and its other arguments are free of the batch (or the same constants in both graphs)."""
  x = ins[0]
  if x.kind == "sum":
    return x
  for i, s in enumerate(ins[1:], 1):
    if s.kind == "nconst":
      a, b = _static(op.inputs[i]), _static(opn.inputs[i])
      if a is None or b is None or not np.array_equal(a, b):
        return _top(op, "takes arguments computed from the batch size")
    elif s.kind != "free":
      return _top(op, "takes arguments that depend on the batch")
  if all(_shape(o.outputs[0])[x.dim] == _shape(o.inputs[0])[x.dim] for o in (op, opn)):
    return x
  return _top(op, "cuts, pads or repeats the batch rows")


def _strided_slice(op, opn, ins):
  """Rows stay rows where the slice takes their dim whole (begin and end masked, stride 1, not shrunk); the
  spec's new axes, shrunk dims and ellipsis move it."""
  x = ins[0]
  if x.kind == "sum":
    return x
  begin, strides = _static(op.inputs[1]), _static(op.inputs[3])
  if begin is None or strides is None or any(s.kind != "free" for s in ins[1:]):
    return _top(op, "slices by bounds that are not constant")
  bits = {m: op.get_attr(m) for m in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                                      "shrink_axis_mask")}
  rank = op.inputs[0].shape.rank
  spec = len(begin)
  consumed = sum(1 for i in range(spec) if not (bits["new_axis_mask"] | bits["ellipsis_mask"]) >> i & 1)
  at_in = at_out = 0
  for i in range(spec):
    if bits["ellipsis_mask"] >> i & 1:
      span = rank - consumed
      if at_in <= x.dim < at_in + span:
        return _row(at_out + x.dim - at_in, x.k)
      at_in, at_out = at_in + span, at_out + span
    elif bits["new_axis_mask"] >> i & 1:
      at_out += 1
    else:
      if at_in == x.dim:
        whole = (bits["begin_mask"] >> i & 1 and bits["end_mask"] >> i & 1 and strides[i] == 1
                 and not bits["shrink_axis_mask"] >> i & 1)
        return _row(at_out, x.k) if whole else _top(op, "slices the batch rows")
      at_in += 1
      at_out += 0 if bits["shrink_axis_mask"] >> i & 1 else 1
  return _row(at_out + x.dim - at_in, x.k)


def _axis(t, rank):
  a = _static(t)
  return None if a is None else int(a) % rank


def _concat(op, opn, ins):
  values, axis_t = (ins[:-1], op.inputs[-1]) if op.type == "ConcatV2" else (ins[1:], op.inputs[0])
  a = _axis(axis_t, op.outputs[0].shape.rank)
  rows = {(s.kind, s.dim, s.k) for s in values}
  if a is None or len(rows) != 1 or values[0].kind != "row" or values[0].dim == a:
    return _top(op, "concatenates the batch rows with other values, or along their dim")
  return values[0]


def _pack(op, opn, ins):
  a = op.get_attr("axis") % op.outputs[0].shape.rank
  if len({(s.kind, s.dim, s.k) for s in ins}) != 1 or ins[0].kind != "row":
    return _top(op, "stacks the batch rows with other values")
  return _row(ins[0].dim + (a <= ins[0].dim), ins[0].k)


def _unpack(op, opn, ins):
  x = ins[0]
  a = op.get_attr("axis") % op.inputs[0].shape.rank
  if x.kind != "row" or a == x.dim:
    return _top(op, "unstacks the batch rows")
  return [_row(x.dim - (a < x.dim), x.k)] * len(op.outputs)


def _one_hot(op, opn, ins):
  x, a = ins[0], op.get_attr("axis")
  if x.kind != "row" or any(s.kind != "free" for s in ins[1:]):
    return _top(op, "one-hot encodes with arguments that depend on the batch")
  return _row(x.dim if a < 0 else x.dim + (a <= x.dim), x.k)


def _along(op, opn, ins, axis_input=1):
  """Ops along one constant dim (Cumsum, ArgMax, Softmax's last dim, ...): rows stay rows unless that dim is
  theirs; a reducing one (ArgMax) drops the dim."""
  x = ins[0]
  rank = op.inputs[0].shape.rank
  if x.kind != "row" or rank is None:
    return _top(op, "runs along a sum over the batch rows")
  a = rank - 1 if axis_input is None else _axis(op.inputs[axis_input], rank)
  if a is None or a == x.dim or any(s.kind != "free" for s in ins[1:]):
    return _top(op, "runs along the batch rows")
  dropped = op.type in ("ArgMax", "ArgMin")
  return [_row(x.dim - (dropped and a < x.dim), x.k)] * len(op.outputs)


def _cross_entropy(op, opn, ins):
  """(Sparse)SoftmaxCrossEntropyWithLogits: logits and labels are the same rows (dim 0); both results are too."""
  if all(s.kind == "row" and s.dim == 0 for s in ins) and len({s.k for s in ins}) == 1:
    return [ins[0]] * 2
  return _top(op, "pairs logits and labels that are not the same batch rows")


# Ops of images and volumes whose batch is dim 0 of one data input (the others: filters, sizes, free of it).
_BATCHED = {"Conv2D": 0, "Conv3D": 0, "DepthwiseConv2dNative": 0, "MaxPool": 0, "AvgPool": 0, "MaxPool3D": 0,
            "AvgPool3D": 0, "MaxPoolV2": 0, "ResizeNearestNeighbor": 0, "ResizeBilinear": 0, "ResizeBicubic": 0,
            "DepthToSpace": 0, "SpaceToDepth": 0, "LRN": 0, "Conv2DBackpropInput": 2, "Conv3DBackpropInputV2": 2,
            "FusedBatchNorm": 0, "FusedBatchNormV2": 0, "FusedBatchNormV3": 0}


def _batched(op, opn, ins):
  i = _BATCHED[op.type]
  x = ins[i]
  training = op.type.startswith("FusedBatchNorm") and op.get_attr("is_training")
  if x.kind != "row" or x.dim != 0 or training or any(
      s.kind not in ("free", "nconst") for j, s in enumerate(ins) if j != i):
    return _top(op, "mixes the batch rows (or its filter or statistics depend on them)")
  return [x] + [FREE] * (len(op.outputs) - 1)


def _broadcast_to(op, opn, ins):
  x = ins[0]
  if x.kind == "sum":
    return x
  out, shape = _shape(op.outputs[0]), _shape(op.inputs[0])
  d = x.dim + len(out) - len(shape)
  return _row(d, x.k) if out[d] == shape[x.dim] else _top(op, "broadcasts along the batch rows")


def _select(op, opn, ins):
  if op.inputs[0].shape.rank != op.outputs[0].shape.rank:
    return _top(op, "selects whole batch rows")
  return _elementwise(op, opn, ins)


def _elementwise_rule(op):
  """The rule of an element-wise op (ops/registry's `is_elementwise`) by its arity, or of a copy; else None."""
  if _copies_value(op):
    return _unary
  if not registry.is_elementwise(op.type):
    return None
  return _unary if len(op.inputs) == 1 else _elementwise


def _rules():
  # (element-wise ops are the registry's, `_elementwise_rule`; BiasAdd broadcasts its own way)
  table = {_elementwise: ("BiasAdd",), _unary: ("Cast",), _reduce: ("Sum", "Mean", "Max", "Min", "Prod"),
           _contract: ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"), _batched: _BATCHED,
           _gather: ("Gather", "GatherV2", "ResourceGather"),
           _keeps_rows: ("Slice", "Tile", "Pad", "PadV2", "MirrorPad"),
           _along: ("Cumsum", "Cumprod", "CumulativeLogsumexp", "ArgMax", "ArgMin"),
           (lambda op, opn, ins: _along(op, opn, ins, None)): ("Softmax", "LogSoftmax", "TopKV2"),
           _cross_entropy: ("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits"),
           (lambda op, opn, ins: [NCONST] * len(op.outputs)): ("Shape", "ShapeN", "Size"),
           _concat: ("ConcatV2", "Concat"), _reshape: ("Reshape",), _squeeze: ("Squeeze",), _l2_loss: ("L2Loss",),
           _gather_nd: ("GatherNd",), _transpose: ("Transpose",),
           _expand_dims: ("ExpandDims",), _pack: ("Pack",), _unpack: ("Unpack",), _strided_slice: ("StridedSlice",),
           _one_hot: ("OneHot",), _broadcast_to: ("BroadcastTo",), _select: ("Select",),
           (lambda op, opn, ins: list(ins)): ("IdentityN",)}
  return {t: rule for rule, types in table.items() for t in types}


RULES = _rules()
# Stateful ops whose results are the same in every call (variable reads): the others (random draws) run once per
# microbatch.
_READS = frozenset(("ReadVariableOp", "ResourceGather", "VarHandleOp", "VariableShape"))


# ---- the walk ------------------------------------------------------------------------------------------------

def _same(op, opn):
  """Whether two nodes of the two graphs are the same op of the same inputs (a constant's value and a
  placeholder's shape aside)."""
  if op.type != opn.type or [t.name for t in op.inputs] != [t.name for t in opn.inputs]:
    return False
  a, b = op.node_def.attr, opn.node_def.attr
  keys = (set(a) | set(b)) - {"value", "shape", "_output_shapes"}
  return all(k in a and k in b and a[k] == b[k] for k in keys)


def _checked(op, opn, i, v, factor):
  """`v` for result i where its static shapes in the two graphs agree with it: those of a sum the same, those of
  rows the same but for their dim, `factor` (batch rows / microbatch rows) times larger; else `top`."""
  if v.kind not in ("row", "sum"):
    return v
  a, b = _shape(op.outputs[i]), _shape(opn.outputs[i])
  if a is None or b is None or None in a or None in b or len(a) != len(b):
    return _top(op, "has a result of unknown shape")
  want = list(a)
  if v.kind == "row":
    want[v.dim] *= factor
  if list(b) != want or (v.kind == "row" and a[v.dim] % v.k):
    return _top(op, "has a result whose shape depends on the batch size other than by its rows")
  return v


def _transfer(op, opn, ins, factor):
  """The abstract values of `op`'s results from its inputs' (`opn`: the same node in the batch's graph; `factor`:
  batch rows / microbatch rows)."""
  n = len(op.outputs)
  if op.type == "Const":
    same = np.array_equal(tf.make_ndarray(op.get_attr("value")), tf.make_ndarray(opn.get_attr("value")))
    return [FREE if same else NCONST] * n
  tops = [s for s in ins if s.kind == "top"]
  if tops:
    return [tops[0]] * n
  if op.op_def.is_stateful and op.type not in _READS and n:
    return [_top(op, "is stateful (a random draw?): each microbatch would run it on its own")] * n
  if all(s.kind == "free" for s in ins):
    return [FREE] * n
  if all(s.kind in ("free", "nconst") for s in ins):
    return [NCONST] * n
  rule = RULES.get(op.type) or _elementwise_rule(op)
  if rule is None:
    return [_top(op, "has no rule saying how it treats the batch rows")] * n
  out = rule(op, opn, ins)
  return [_checked(op, opn, i, v, factor) for i, v in enumerate(out if isinstance(out, list) else [out] * n)]


def _loss_value(fn, param_specs, micro_specs, batch_specs):
  """The abstract value of `fn(params, *batch)`'s loss, from its graphs at the microbatch's and the batch's rows."""
  graphs = [_trace(fn, param_specs, specs) for specs in (micro_specs, batch_specs)]
  (cf, loss), (cfn, _) = graphs
  by_name = {o.name: o for o in cfn.graph.get_operations()}
  n_params, n_args = len(tf.nest.flatten(param_specs)), len(tf.nest.flatten(param_specs)) + len(batch_specs)
  values = {t.name: (_row(0, 1) if n_params <= i < n_args else FREE) for i, t in enumerate(cf.inputs)}
  factor = batch_specs[0].shape[0] // micro_specs[0].shape[0]
  for op in cf.graph.get_operations():
    if op.type == "Placeholder":
      continue
    opn = by_name.get(op.name)
    if opn is None or not _same(op, opn):
      out = [_top(op, "is not the same op in the graphs of the microbatch and of the batch")] * len(op.outputs)
    else:
      try:
        out = _transfer(op, opn, [values.get(t.name, FREE) for t in op.inputs], factor)
      except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:   # (e.g. a rank unknown)
        out = [_top(op, f"could not be followed ({type(e).__name__}: {e})")] * len(op.outputs)
    values.update((t.name, v) for t, v in zip(op.outputs, out))
  return values[loss.name]


def _trace(fn, param_specs, batch_specs):
  n = len(tf.nest.flatten(param_specs))

  def flat_fn(*args):
    return fn(tf.nest.pack_sequence_as(param_specs, list(args[:n])), *args[n:])

  cf = tf.function(flat_fn).get_concrete_function(*tf.nest.flatten(param_specs), *batch_specs)
  loss = cf.structured_outputs
  if not isinstance(loss, tf.Tensor) or loss.shape.rank != 0:
    raise InputError(f"the step returns {loss!r}; it must return the scalar loss of the batch",
                     node=getattr(fn, "__name__", "the step"))
  return cf, loss


def reduction(fn, param_specs, batch_specs, microbatches):
  """How the losses of `microbatches` microbatches of `fn(params, *batch)` combine into the loss of the batch:
  "mean" (their mean; also for a loss free of the batch) or "sum" (their sum), and so their gradients.

  `param_specs`: the parameters' nest of tf.TensorSpecs; `batch_specs`: the batch arguments' (rows on dim 0, a
  multiple of `microbatches`). Raises InputError, naming the node where the proof stops, for a loss that is not
  c(n) x a sum of per-row terms with c(n) = 1 or 1/n (+ a term free of the batch, for a mean).
  """
  if microbatches == 1:
    return "mean"
  micro = [tf.TensorSpec([s.shape[0] // microbatches] + s.shape.as_list()[1:], s.dtype) for s in batch_specs]
  value = _loss_value(fn, param_specs, micro, batch_specs)
  name = getattr(fn, "__name__", "the step")
  fix = ("write the loss as tf.reduce_mean (or tf.reduce_sum) of per-example terms, or give microbatches=1 (the "
         "whole batch in one call)")
  if value.kind == "free":
    return "mean"
  if value.kind != "sum":
    why = value.why or f"its value is {value.kind}"
    raise InputError(f"the step's loss could not be shown to be a sum or a mean of per-row terms over the batch "
                     f"(at {why}), so the losses of microbatches={microbatches} microbatches need not combine into "
                     f"the batch's loss: {fix}", node=name)
  ratio = value.c[1] / value.c[0]
  if math.isclose(ratio * microbatches, 1.0, rel_tol=1e-9):
    return "mean"
  if math.isclose(ratio, 1.0, rel_tol=1e-9) and not value.affine:
    return "sum"
  if math.isclose(ratio, 1.0, rel_tol=1e-9):
    raise InputError(f"the step's loss is a sum over the batch rows plus a term that does not depend on the batch "
                     f"(a regularizer?): adding up the losses of microbatches={microbatches} microbatches would count "
                     f"that term {microbatches} times; make the loss a mean over the rows, or give microbatches=1",
                     node=name)
  raise InputError(f"the step's loss scales its sum over the batch rows by {ratio:g} from a microbatch to the batch "
                   f"(a sum: 1, a mean: 1/{microbatches}), so the microbatches' losses do not combine into it: {fix}",
                   node=name)
