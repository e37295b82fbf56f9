"""The stacking rules: each op of the per-device program written once over a leading device dimension.

rewriter/one_graph/stacking.py decides which form each tensor of the one in-process graph takes (uniform, stacked, per
device); a node with a stacked operand is stacked when its op has a rule here. A rule writes the op for
tensors of shape [devices] + the per-device shape, from operands in their stacked form (or uniform ones where
the op broadcasts them), computing what the per-device copies would (up to the order of floating-point sums: a
BatchMatMulV2 for a MatMul, a reduction over a group dimension for an AddN of the members):

  * elementwise ops broadcast a uniform operand as on one device; a stacked operand of lower rank gets unit
    dimensions after the device dimension; ops without broadcasting (AddN, the gradients of unary ops) take
    every operand stacked;
  * axes, perms, begins, paddings, multiples and shapes move by one; a reduction keeps the device dimension;
  * MatMul becomes BatchMatMulV2 (a uniform operand broadcasts over the devices); an einsum gets a letter for
    the device dimension on its stacked operands and its result;
  * a gather takes the device dimension as one more batch dimension;
  * Softmax and LogSoftmax run on rows (TF's CPU kernel takes rank <= 5);
  * a collective gathers each group's members (runtime rank order) into a group dimension, then sums, multiplies,
    takes the max or min (all-reduce) or concatenates (all-gather) there, and each device takes its group's
    result -- a handful of ops for the whole mesh; an all-to-all is one gather of the members' chunks, each to
    the device that takes it.

A rule returns False where it does not apply (an unknown shape, an operand it cannot take); the node then runs
per device.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd.rewriter.graph.graph_view import is_control, node_of, split_ref

UNIFORM, STACKED, PER_DEVICE = "U", "S", "P"   # the forms of a tensor (rewriter/one_graph/stacking.py)

# Ops applied element by element with broadcasting: over a stacked operand the device dimension is one more (the
# same sets tell rewriter/backend/horizontal.py which ops a fused chain may hold).
BROADCASTING = frozenset((
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "MulNoNan", "Maximum", "Minimum", "Pow",
    "SquaredDifference", "FloorDiv", "FloorMod", "Mod", "TruncateDiv", "TruncateMod", "Equal", "NotEqual", "Less",
    "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr", "BitwiseAnd", "BitwiseOr", "BitwiseXor",
    "SelectV2", "Atan2", "Xdivy", "Xlogy", "Xlog1py",
))
UNARY = frozenset((
    "Identity", "StopGradient", "PreventGradient", "Neg", "Abs", "Sign", "Sqrt", "Rsqrt", "Square", "Exp", "Expm1",
    "Log", "Log1p", "Tanh", "Sigmoid", "Relu", "Relu6", "Elu", "Selu", "Softplus", "Softsign", "Erf", "Erfc",
    "Floor", "Ceil", "Round", "Rint", "Reciprocal", "Inv", "Sin", "Cos", "Tan", "Cast", "LogicalNot", "IsNan",
    "IsInf", "IsFinite", "ZerosLike", "OnesLike", "Invert",
    "Acos", "Asin", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Lgamma", "Digamma", "LeakyRelu",
))
# Two same-shaped operands, element by element (gradients of unary ops).
SAME_SHAPE_GRADS = frozenset(("TanhGrad", "SigmoidGrad", "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad",
                              "SoftplusGrad", "SoftsignGrad", "RsqrtGrad", "SqrtGrad", "ReciprocalGrad", "InvGrad",
                              "LeakyReluGrad"))
_REDUCTIONS = frozenset(("Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"))
COLLECTIVES = frozenset(("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2"))
_REDUCE_BY = {b"Add": "Sum", b"Mul": "Prod", b"Max": "Max", b"Min": "Min"}


class CannotStack(Exception):
  """A node the one graph of a process cannot hold (a collective across processes on an operand of unknown shape):
  the program runs per device, through TF's collectives."""


class Rules:
  """The rules, as methods of rewriter.one_graph.stacking.Stacker (whose forms, references and emission they use)."""

  def _operand(self, i, rank):
    """Input `i` for an op of per-device rank `rank` broadcasting over the device dimension: uniform as is, stacked
    with unit dimensions after the device dimension up to `rank` (None when that needs an unknown shape)."""
    if self.form[node_of(i)] == UNIFORM:
      return self._uniform_ref(i)
    own = self._rank(i)
    if own is None:
      return None
    if own == rank:
      return self.stacked_ref(i)
    shape = self._shape(i)
    if shape is None:
      return None
    return self._reshape(f"stk_rank/{node_of(i)}/{split_ref(i)[1]}/{rank}", self.stacked_ref(i),
                         [self.n] + [1] * (rank - own) + shape, self._dtype(i))

  def _broadcast(self, i):
    """Input `i` stacked, a uniform one broadcast over the device dimension."""
    if self.form[node_of(i)] != UNIFORM:
      return self.stacked_ref(i)
    shape = self._shape(i)
    if shape is None:
      return None
    target = self._const(f"stk_shape/{node_of(i)}/{split_ref(i)[1]}/b", np.array([self.n] + shape, np.int64))
    return self._node(f"stk_bcast/{node_of(i)}/{split_ref(i)[1]}", "BroadcastTo", [self._uniform_ref(i), target],
                      T=self._dtype(i), Tidx=tf.int64) + ":0"

  def _reshape(self, name, ref, dims, dtype, controls=()):
    """A Reshape node `name` of tensor `ref` to the static `dims`; its output."""
    target = self._const(f"stk_reshape/{name}", np.array(dims, np.int64))
    return self._node(name, "Reshape", [ref, target] + list(controls), T=dtype, Tshape=tf.int64) + ":0"

  # ---- rules ----------------------------------------------------------------------------------------------------

  def _stacked(self, x):
    """Write the stacked form of NodeDef `x` (some data input stacked); False where it has no rule."""
    data = [i for i in x.input if not is_control(i)]
    name = f"stk/{x.name}"
    out = self._tensor(x.name + ":0") if self.graph.get_operation_by_name(x.name).outputs else None
    rank = out.shape.rank if out is not None else None
    op = x.op
    if op in UNARY or op in SAME_SHAPE_GRADS or op in BROADCASTING or op == "AddN" or op == "BiasAdd":
      if rank is None:
        return False
      if op == "BiasAdd" and (x.attr["data_format"].s not in (b"", b"NHWC") or
                              self.form[node_of(data[1])] != UNIFORM):
        return False
      if op in SAME_SHAPE_GRADS or op == "AddN":   # no broadcasting: every operand stacked at the output's shape
        ins = [self._broadcast(i) for i in data]
      else:
        ins = [self._operand(i, rank) for i in data]
      if any(i is None for i in ins):
        return False
      self._copy(x, name, ins)
      return True
    if op in ("Softmax", "LogSoftmax"):   # over the last dimension; TF's CPU kernel takes rank <= 5: as a matrix
      shape = self._shape(x.name + ":0")
      if shape is None or not shape or self.form[node_of(data[0])] == UNIFORM:
        return False
      flat = self._reshape(f"stkh/{x.name}/rows", self.stacked_ref(data[0]), [-1, shape[-1]], x.attr["T"])
      soft = self._node(f"stkh/{x.name}/flat", op, [flat], T=x.attr["T"])
      self._reshape(name, soft + ":0", [self.n] + shape, x.attr["T"], self.controls(x))
      return True
    if op == "Reshape":
      shape = self._shape(x.name + ":0")
      if shape is None:
        return False
      self._reshape(name, self.stacked_ref(data[0]), [self.n] + shape, x.attr["T"], self.controls(x))
      return True
    if op == "Transpose":
      perm = self._value(data[1])
      if perm is None or self.form[node_of(data[0])] == UNIFORM:
        return False
      perm = [0] + [int(a) % len(perm) + 1 for a in perm]
      node_perm = self._const(f"stkh/{x.name}/perm", np.array(perm, np.int32))
      self._node(name, "Transpose", [self.stacked_ref(data[0]), node_perm] + self.controls(x), T=x.attr["T"],
                 Tperm=tf.int32)
      return True
    if op in _REDUCTIONS or op in ("ArgMax", "ArgMin", "Cumsum", "Cumprod"):
      axes = self._value(data[1])
      in_rank = self._rank(data[0])
      if axes is None or in_rank is None or self.form[node_of(data[0])] == UNIFORM:
        return False
      axes = np.asarray(axes)
      shifted = (axes % max(in_rank, 1)) + 1 if in_rank else axes
      ax = self._const(f"stkh/{x.name}/axes", shifted.astype(axes.dtype))
      self._copy(x, name, [self.stacked_ref(data[0]), ax])
      return True
    if op == "MatMul":
      a, b = (self._operand(i, 2) for i in data)
      if a is None or b is None:
        return False
      self._node(name, "BatchMatMulV2", [a, b] + self.controls(x), T=x.attr["T"], adj_x=x.attr["transpose_a"].b,
                 adj_y=x.attr["transpose_b"].b)
      return True
    if op in ("BatchMatMulV2", "BatchMatMulV3"):
      if rank is None:
        return False
      ins = [self._operand(i, rank) for i in data]
      if any(i is None for i in ins):
        return False
      self._copy(x, name, ins)
      return True
    if op == "ConcatV2":
      axis = self._value(data[-1])
      if axis is None or rank is None:
        return False
      ins = [self._broadcast(i) for i in data[:-1]]
      if any(i is None for i in ins):
        return False
      self._node(name, "ConcatV2", ins + [self._const(f"stkh/{x.name}/axis", np.int32(int(axis) % rank + 1))] +
                 self.controls(x), T=x.attr["T"], N=len(ins), Tidx=tf.int32)
      return True
    if op == "Split":
      axis, in_rank = self._value(data[0]), self._rank(data[1])
      if axis is None or in_rank is None or self.form[node_of(data[1])] == UNIFORM:
        return False
      self._copy(x, name, [self._const(f"stkh/{x.name}/axis", np.int32(int(axis) % in_rank + 1)),
                           self.stacked_ref(data[1])])
      return True
    if op == "SplitV":
      sizes, axis, in_rank = self._value(data[1]), self._value(data[2]), self._rank(data[0])
      if sizes is None or axis is None or in_rank is None or self.form[node_of(data[0])] == UNIFORM:
        return False
      self._copy(x, name, [self.stacked_ref(data[0]), self._uniform_ref(data[1]),
                           self._const(f"stkh/{x.name}/axis", np.int32(int(axis) % in_rank + 1))])
      return True
    if op == "Pack":
      if rank is None:
        return False
      ins = [self._broadcast(i) for i in data]
      if any(i is None for i in ins):
        return False
      self._copy(x, name, ins, axis=x.attr["axis"].i % rank + 1)
      return True
    if op == "Unpack":
      in_rank = self._rank(data[0])
      if in_rank is None or self.form[node_of(data[0])] == UNIFORM:
        return False
      self._copy(x, name, [self.stacked_ref(data[0])], axis=x.attr["axis"].i % in_rank + 1)
      return True
    if op in ("Slice", "StridedSlice", "Tile", "Pad", "PadV2", "MirrorPad", "ExpandDims", "BroadcastTo",
              "OneHot", "Squeeze"):
      return self._shaping(x, data, name, rank)
    if op == "GatherV2":
      return self._gather(x, data, name)
    if op == "Einsum":
      return self._einsum(x, data, name)
    return False

  def _shaping(self, x, data, name, rank):
    op = x.op
    src = data[0]
    if self.form[node_of(src)] == UNIFORM:
      return False
    in_rank = self._rank(src)
    if in_rank is None:
      return False
    consts = [self._value(i) for i in data[1:]]
    if op in ("Slice", "StridedSlice", "Tile", "Pad", "PadV2", "MirrorPad", "BroadcastTo") and \
        any(c is None for c in consts[:3 if op == "StridedSlice" else 1]):
      return False
    if op == "Slice":
      begin, size = consts
      if size is None:
        return False
      ins = [self._const(f"stkh/{x.name}/begin", np.concatenate([[0], begin]).astype(begin.dtype)),
             self._const(f"stkh/{x.name}/size", np.concatenate([[-1], size]).astype(size.dtype))]
      self._copy(x, name, [self.stacked_ref(src)] + ins)
      return True
    if op == "StridedSlice":
      begin, end, strides = consts
      ins = [self._const(f"stkh/{x.name}/{k}", np.concatenate([[v0], c]).astype(c.dtype))
             for k, v0, c in (("begin", 0, begin), ("end", 0, end), ("strides", 1, strides))]
      masks = {m: x.attr[m].i << 1 for m in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                                             "shrink_axis_mask")}
      masks["begin_mask"] |= 1
      masks["end_mask"] |= 1
      self._copy(x, name, [self.stacked_ref(src)] + ins, **masks)
      return True
    if op == "Tile":
      self._copy(x, name, [self.stacked_ref(src),
                           self._const(f"stkh/{x.name}/multiples", np.concatenate([[1], consts[0]]).astype(consts[0].dtype))])
      return True
    if op in ("Pad", "PadV2", "MirrorPad"):
      pads = np.concatenate([np.zeros((1, 2), consts[0].dtype), consts[0]])
      rest = [self._uniform_ref(i) for i in data[2:]]
      if op == "PadV2" and self.form[node_of(data[2])] != UNIFORM:
        return False
      self._copy(x, name, [self.stacked_ref(src), self._const(f"stkh/{x.name}/paddings", pads)] + rest)
      return True
    if op == "BroadcastTo":
      shape = self._shape(x.name + ":0")
      operand = self._operand(src, rank) if shape is not None else None
      if operand is None:
        return False
      self._copy(x, name, [operand, self._const(f"stkh/{x.name}/shape", np.array([self.n] + shape, np.int64))], )
      self.out.node[-1].attr["Tidx"].type = tf.int64.as_datatype_enum
      return True
    if op == "ExpandDims":
      axis = consts[0]
      if axis is None:
        return False
      axis = int(np.reshape(axis, ()))
      self._copy(x, name, [self.stacked_ref(src), self._const(f"stkh/{x.name}/axis", np.int32(axis + 1 if axis >= 0 else axis))])
      self.out.node[-1].attr["Tdim"].type = tf.int32.as_datatype_enum
      return True
    if op == "Squeeze":
      dims = list(x.attr["squeeze_dims"].list.i)
      if not dims:
        shape = self._shape(src)
        if shape is None:
          return False
        dims = [d for d, s in enumerate(shape) if s == 1]
      self._copy(x, name, [self.stacked_ref(src)], squeeze_dims=[d % in_rank + 1 for d in dims])
      return True
    if op == "OneHot":
      if any(self.form[node_of(i)] != UNIFORM for i in data[1:]):
        return False
      axis = x.attr["axis"].i
      self._copy(x, name, [self.stacked_ref(src)] + [self._uniform_ref(i) for i in data[1:]],
                 axis=axis if axis < 0 else axis + 1)
      return True
    return False

  def _collective(self, x):
    """A collective over the device dimension: the members of each group gathered into a group dimension (in rank
    order), reduced, concatenated or exchanged there, and each device's result taken from its group's."""
    ranked = [tuple(r) for r in self._groups(x)]
    groups = sorted(set(ranked))
    size = len(groups[0])
    flat = [q for group in groups for q in group]
    shape = self._shape(x.input[0])
    if sorted(flat) != list(range(self.n)) or any(len(g) != size for g in groups) or shape is None or \
        any(p not in ranked[p] for p in range(self.n)) or \
        (x.op != "CollectiveReduceV2" and (not shape or shape[0] % size)):
      return False
    name, dtype = f"stk/{x.name}", x.attr["T"].type
    t = tf.as_dtype(dtype)

    def gather(ref, index, label, controls=()):
      if list(index) == list(range(len(index))):
        return ref
      return self._node(f"stkh/{x.name}/{label}", "GatherV2",
                        [ref, self._const(f"stkh/{x.name}/{label}_index", np.array(index, np.int32)),
                         self._const(f"stkh/{x.name}/{label}_axis", np.int32(0))] + list(controls),
                        Tparams=t, Tindices=tf.int32, Taxis=tf.int32, batch_dims=0) + ":0"

    def reshape(ref, dims, label):
      return self._reshape(f"stkh/{x.name}/{label}", ref, dims, t)

    # A group that is one mesh axis (or neighbouring axes): the device dimension, read as [outer, size, inner],
    # varies the middle index within a group.
    inner = next((b for b in range(1, self.n // size + 1) if (self.n // size) % b == 0 and all(
        ranked[p] == tuple((p // (size * b)) * size * b + j * b + p % b for j in range(size)) for p in range(self.n))),
                 None)
    if inner is not None and x.op in ("CollectiveReduceV2", "CollectiveGatherV2"):
      mesh = [self.n // (size * inner), size, inner]
      source = self.stacked_ref(x.input[0])
      if x.op == "CollectiveReduceV2":   # reduced over the middle index, where every member sits
        grouped = reshape(source, mesh + shape, "grouped")
        merged = self._node(f"stkh/{x.name}/reduced", _REDUCE_BY[x.attr["merge_op"].s],
                            [grouped, self._const(f"stkh/{x.name}/reduced_axis", np.int32(1))] + self.controls(x),
                            T=t, Tidx=tf.int32, keep_dims=True) + ":0"
        dims = shape
      else:   # the members' operands in rank order along their dim 0: the middle index moved next to it
        grouped = reshape(source, mesh + shape, "grouped")
        moved = self._node(f"stkh/{x.name}/moved", "Transpose",
                           [grouped, self._const(f"stkh/{x.name}/perm", np.array(
                               [0, 2, 1] + list(range(3, len(shape) + 3)), np.int32))] + self.controls(x),
                           T=t, Tperm=tf.int32) + ":0"
        dims = [size * shape[0]] + shape[1:]
        merged = reshape(moved, [mesh[0], 1, inner] + dims, "merged")
      wide = self._node(f"stkh/{x.name}/wide", "BroadcastTo",
                        [merged, self._const(f"stkh/{x.name}/wide_shape", np.array(mesh + dims, np.int64))],
                        T=t, Tidx=tf.int64) + ":0"
      self._reshape(name, wide, [self.n] + dims, t)
      return True
    if x.op == "CollectiveAllToAllV2":   # device q, rank k of its group, takes chunk k of each member, in rank order
      chunks = reshape(self.stacked_ref(x.input[0]), [self.n * size, shape[0] // size] + shape[1:], "chunks")
      taken = gather(chunks, [member * size + ranked[q].index(q) for q in range(self.n) for member in ranked[q]],
                     "taken", self.controls(x))
      self._node(name, "Identity", [reshape(taken, [self.n] + shape, "result")], T=t)
      return True
    members = gather(self.stacked_ref(x.input[0]), flat, "members", self.controls(x))
    which = [groups.index(ranked[p]) for p in range(self.n)]

    def spread(ref, dims, label):
      """Each device's copy of its group's row of `ref` ([groups] + dims): neighbours in mesh order form a group
      when the collective runs over the mesh's last axes, and a broadcast costs less than a gather there."""
      if which != [p // size for p in range(self.n)]:
        return gather(ref, which, label)
      one = reshape(ref, [len(groups), 1] + dims, f"{label}_one")
      wide = self._node(f"stkh/{x.name}/{label}_wide", "BroadcastTo",
                        [one, self._const(f"stkh/{x.name}/{label}_wide_shape",
                                          np.array([len(groups), size] + dims, np.int64))],
                        T=t, Tidx=tf.int64) + ":0"
      return reshape(wide, [self.n] + dims, label)

    if x.op == "CollectiveReduceV2":
      grouped = reshape(members, [len(groups), size] + shape, "grouped")
      reduced = self._node(f"stkh/{x.name}/reduced", _REDUCE_BY[x.attr["merge_op"].s],
                           [grouped, self._const(f"stkh/{x.name}/reduced_axis", np.int32(1))], T=t, Tidx=tf.int32,
                           keep_dims=False) + ":0"
      result = spread(reduced, shape, "result")
    else:
      grouped = reshape(members, [len(groups), size * shape[0]] + shape[1:], "grouped")
      result = spread(grouped, [size * shape[0]] + shape[1:], "result")
    self._node(name, "Identity", [result], T=t)
    return True

  def _across(self, x, group_key, size, instance_key, slots):
    """A collective whose groups cross processes (in_process.crossing): one TF collective of the stacked operand
    among the first devices of the `size` processes they join (`group_key`), on this process's first device.
    An all-reduce reduces every row with its peers' as it is; an all-gather's blocks are put process-major
    around it; an all-to-all sends each process every device's blocks for its members, and each device takes
    its own from what arrives (`slots`)."""
    t = tf.as_dtype(x.attr["T"].type)
    shape = self._shape(x.input[0])
    per = slots.shape[1]   # the group's members in each process
    if x.op != "CollectiveReduceV2" and (not shape or x.op == "CollectiveAllToAllV2" and shape[0] % (size * per)):
      raise CannotStack(f"collective {x.name} across processes has an operand of unknown shape or rank 0")
    operand = self._broadcast(x.input[0])
    if operand is None:
      raise CannotStack(f"collective {x.name} across processes has an operand of unknown shape")
    consts = [self._const(f"stkx/{x.name}/{what}", np.int32(v))
              for what, v in (("group_size", size), ("group_key", group_key), ("instance_key", instance_key))]
    name = f"stk/{x.name}"

    def reshape(ref, dims, label):
      return self._reshape(f"stkx/{x.name}/{label}", ref, dims, t)

    def swap(ref, rank, label):   # the first two dims exchanged
      perm = self._const(f"stkx/{x.name}/{label}_perm", np.array([1, 0] + list(range(2, rank)), np.int32))
      return self._node(f"stkx/{x.name}/{label}", "Transpose", [ref, perm], T=t, Tperm=tf.int32) + ":0"

    if x.op == "CollectiveReduceV2":
      self._copy(x, name, [operand] + consts)
      return
    rest = int(np.prod(shape[1:], dtype=np.int64))
    if x.op == "CollectiveGatherV2":   # [processes * n, rows, ...] -> row i: every process's rows of device i
      self._copy(x, f"stkx/{x.name}/op", [operand] + consts)
      got = reshape(f"stkx/{x.name}/op:0", [size, self.n, shape[0] * rest], "got")
      self._reshape(name, swap(got, 3, "mine"), [self.n, size * shape[0]] + shape[1:], t)
      return
    block = shape[0] // (size * per) * rest   # an all-to-all: what a device sends each member
    out = reshape(swap(reshape(operand, [self.n, size, per * block], "blocks"), 3, "out"),
                  [size, self.n * per * block], "sent")
    self._copy(x, f"stkx/{x.name}/op", [out] + consts)
    got = reshape(f"stkx/{x.name}/op:0", [size, self.n * per, block], "got")   # [process, its row, slot, block]
    if slots.reshape(-1).tolist() != list(range(self.n * per)):
      got = self._node(f"stkx/{x.name}/taken", "GatherV2",
                       [got, self._const(f"stkx/{x.name}/slots", slots),
                        self._const(f"stkx/{x.name}/slots_axis", np.int32(1))],
                       Tparams=t, Tindices=tf.int32, Taxis=tf.int32, batch_dims=0) + ":0"
    got = reshape(got, [size, self.n, per * block], "each")
    self._reshape(name, swap(got, 3, "mine"), [self.n] + shape, t)

  def _gather(self, x, data, name):
    params, indices, axis = data
    axis = self._value(axis)
    p_rank = self._rank(params)
    if axis is None or p_rank is None:
      return False
    axis = int(axis) % p_rank
    batch = x.attr["batch_dims"].i
    if batch < 0:
      return False
    ax = lambda a: self._const(f"stkh/{x.name}/axis", np.int32(a))  # noqa: E731
    if self.form[node_of(params)] == UNIFORM:
      if axis != 0 or batch != 0:
        return False
      self._copy(x, name, [self._uniform_ref(params), self.stacked_ref(indices), ax(0)])
      return True
    idx = self._broadcast(indices)
    if idx is None:
      return False
    self._copy(x, name, [self.stacked_ref(params), idx, ax(axis + 1)], batch_dims=batch + 1)
    return True

  def _einsum(self, x, data, name):
    equation = x.attr["equation"].s.decode()
    if "->" not in equation:
      return False
    lhs, result = equation.split("->")
    operands = lhs.split(",")
    free = [c for c in "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in equation]
    if not free or len(operands) != len(data):
      return False
    letter = free[0]
    ins, terms = [], []
    for term, i in zip(operands, data):
      if self.form[node_of(i)] == UNIFORM:
        ins.append(self._uniform_ref(i))
        terms.append(term)
      else:
        ins.append(self.stacked_ref(i))
        terms.append(letter + term)
    node = self._copy(x, name, ins)
    self.out.node[-1].attr["equation"].s = (",".join(terms) + "->" + letter + result).encode()
    return bool(node)
