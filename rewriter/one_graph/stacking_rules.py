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

from tf_gspmd.ops import registry
from tf_gspmd.rewriter.collectives import vocabulary
from tf_gspmd.rewriter.collectives.vocabulary import kind_of
from tf_gspmd.rewriter.graph.graph_view import is_control, node_of, split_ref

UNIFORM, STACKED, PER_DEVICE = "U", "S", "P"   # the forms of a tensor (rewriter/one_graph/stacking.py)

STACKED_KINDS = ("all-reduce", "all-gather", "all-to-all")   # the collectives written over the device dimension
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

  # ---- rules: one method per one-graph form of ops/registry.STACKED_FORMS ----------------------------------------

  def _stacked(self, x):
    """Write the stacked form of NodeDef `x` (some data input stacked): the form its rule in ops/ states; False where
    it has none, or where its method does not apply."""
    form = registry.stacked_form(x.op)
    if form is None:
      return False
    out = self._tensor(x.name + ":0") if self.graph.get_operation_by_name(x.name).outputs else None
    data = [i for i in x.input if not is_control(i)]
    return getattr(self, f"_stack_{form}")(x, data, f"stk/{x.name}", out.shape.rank if out is not None else None)

  def _copied(self, x, name, ins, **attrs):
    """`x` copied as `name` over the inputs `ins`; False where one of them is None (it needs an unknown shape)."""
    if any(i is None for i in ins):
      return False
    self._copy(x, name, ins, **attrs)
    return True

  def _stacked_source(self, x, i):
    """The per-device rank of `x`'s input `i` when it is stacked, else None (a uniform operand, or its rank unknown)."""
    return None if self.form[node_of(i)] == UNIFORM else self._rank(i)

  def _stack_broadcasting(self, x, data, name, rank):
    if rank is None:
      return False
    return self._copied(x, name, [self._operand(i, rank) for i in data])

  def _stack_same_shape(self, x, data, name, rank):   # no broadcasting: every operand stacked at the output's shape
    if rank is None:
      return False
    return self._copied(x, name, [self._broadcast(i) for i in data])

  def _stack_scalar_or_same(self, x, data, name, rank):   # each operand at the output's shape, or a uniform scalar
    shape = self._shape(x.name + ":0")
    if shape is None:
      return False
    ins = []
    for i in data:
      if self.form[node_of(i)] == UNIFORM and self._rank(i) == 0:
        ins.append(self._uniform_ref(i))
        continue
      ref = self._operand(i, len(shape))
      if ref is not None and (self.form[node_of(i)] == UNIFORM or self._shape(i) != shape):
        target = self._const(f"stk_shape/{node_of(i)}/{split_ref(i)[1]}/full", np.array([self.n] + shape, np.int64))
        ref = self._node(f"stk_full/{x.name}/{len(ins)}", "BroadcastTo", [ref, target], T=self._dtype(i),
                         Tidx=tf.int64) + ":0"
      ins.append(ref)
    return self._copied(x, name, ins)

  def _stack_bias_add(self, x, data, name, rank):
    if x.attr["data_format"].s not in (b"", b"NHWC") or self.form[node_of(data[1])] != UNIFORM:
      return False
    return self._stack_broadcasting(x, data, name, rank)

  def _stack_softmax(self, x, data, name, rank):   # over the last dim; TF's CPU kernel takes rank <= 5: as a matrix
    shape = self._shape(x.name + ":0")
    if shape is None or not shape or self.form[node_of(data[0])] == UNIFORM:
      return False
    flat = self._reshape(f"stkh/{x.name}/rows", self.stacked_ref(data[0]), [-1, shape[-1]], x.attr["T"])
    soft = self._node(f"stkh/{x.name}/flat", x.op, [flat], T=x.attr["T"])
    self._reshape(name, soft + ":0", [self.n] + shape, x.attr["T"], self.controls(x))
    return True

  def _stack_reshape(self, x, data, name, rank):
    shape = self._shape(x.name + ":0")
    if shape is None:
      return False
    self._reshape(name, self.stacked_ref(data[0]), [self.n] + shape, x.attr["T"], self.controls(x))
    return True

  def _stack_transpose(self, x, data, name, rank):
    perm = self._value(data[1])
    if perm is None or self.form[node_of(data[0])] == UNIFORM:
      return False
    perm = [0] + [int(a) % len(perm) + 1 for a in perm]
    node_perm = self._const(f"stkh/{x.name}/perm", np.array(perm, np.int32))
    self._node(name, "Transpose", [self.stacked_ref(data[0]), node_perm] + self.controls(x), T=x.attr["T"],
               Tperm=tf.int32)
    return True

  def _stack_reduction(self, x, data, name, rank):   # along the axes of operand 1: the device dim stays
    axes, in_rank = self._value(data[1]), self._stacked_source(x, data[0])
    if axes is None or in_rank is None:
      return False
    axes = np.asarray(axes)
    shifted = (axes % max(in_rank, 1)) + 1 if in_rank else axes
    return self._copied(x, name, [self.stacked_ref(data[0]), self._const(f"stkh/{x.name}/axes",
                                                                         shifted.astype(axes.dtype))])

  def _stack_matmul(self, x, data, name, rank):
    a, b = (self._operand(i, 2) for i in data)
    if a is None or b is None:
      return False
    self._node(name, "BatchMatMulV2", [a, b] + self.controls(x), T=x.attr["T"], adj_x=x.attr["transpose_a"].b,
               adj_y=x.attr["transpose_b"].b)
    return True

  def _stack_concat(self, x, data, name, rank):
    axis = self._value(data[-1])
    ins = [self._broadcast(i) for i in data[:-1]]
    if axis is None or rank is None or any(i is None for i in ins):
      return False
    self._node(name, "ConcatV2", ins + [self._const(f"stkh/{x.name}/axis", np.int32(int(axis) % rank + 1))] +
               self.controls(x), T=x.attr["T"], N=len(ins), Tidx=tf.int32)
    return True

  def _stack_split(self, x, data, name, rank):
    axis, in_rank = self._value(data[0]), self._stacked_source(x, data[1])
    if axis is None or in_rank is None:
      return False
    return self._copied(x, name, [self._const(f"stkh/{x.name}/axis", np.int32(int(axis) % in_rank + 1)),
                                  self.stacked_ref(data[1])])

  def _stack_split_v(self, x, data, name, rank):
    sizes, axis, in_rank = self._value(data[1]), self._value(data[2]), self._stacked_source(x, data[0])
    if sizes is None or axis is None or in_rank is None:
      return False
    return self._copied(x, name, [self.stacked_ref(data[0]), self._uniform_ref(data[1]),
                                  self._const(f"stkh/{x.name}/axis", np.int32(int(axis) % in_rank + 1))])

  def _stack_pack(self, x, data, name, rank):
    if rank is None:
      return False
    return self._copied(x, name, [self._broadcast(i) for i in data], axis=x.attr["axis"].i % rank + 1)

  def _stack_unpack(self, x, data, name, rank):
    in_rank = self._stacked_source(x, data[0])
    if in_rank is None:
      return False
    return self._copied(x, name, [self.stacked_ref(data[0])], axis=x.attr["axis"].i % in_rank + 1)

  def _stack_slice(self, x, data, name, rank):
    begin, size = self._value(data[1]), self._value(data[2])
    if self._stacked_source(x, data[0]) is None or begin is None or size is None:
      return False
    return self._copied(x, name, [
        self.stacked_ref(data[0]),
        self._const(f"stkh/{x.name}/begin", np.concatenate([[0], begin]).astype(begin.dtype)),
        self._const(f"stkh/{x.name}/size", np.concatenate([[-1], size]).astype(size.dtype))])

  def _stack_strided_slice(self, x, data, name, rank):
    consts = [self._value(i) for i in data[1:4]]
    if self._stacked_source(x, data[0]) is None or any(c is None for c in consts):
      return False
    ins = [self._const(f"stkh/{x.name}/{k}", np.concatenate([[v0], c]).astype(c.dtype))
           for k, v0, c in zip(("begin", "end", "strides"), (0, 0, 1), consts)]
    masks = {m: x.attr[m].i << 1 for m in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                                           "shrink_axis_mask")}
    masks["begin_mask"] |= 1
    masks["end_mask"] |= 1
    return self._copied(x, name, [self.stacked_ref(data[0])] + ins, **masks)

  def _stack_tile(self, x, data, name, rank):
    multiples = self._value(data[1])
    if self._stacked_source(x, data[0]) is None or multiples is None:
      return False
    return self._copied(x, name, [self.stacked_ref(data[0]), self._const(
        f"stkh/{x.name}/multiples", np.concatenate([[1], multiples]).astype(multiples.dtype))])

  def _stack_pad(self, x, data, name, rank):
    paddings = self._value(data[1])
    if self._stacked_source(x, data[0]) is None or paddings is None or \
        (x.op == "PadV2" and self.form[node_of(data[2])] != UNIFORM):
      return False
    pads = np.concatenate([np.zeros((1, 2), paddings.dtype), paddings])
    return self._copied(x, name, [self.stacked_ref(data[0]), self._const(f"stkh/{x.name}/paddings", pads)] +
                        [self._uniform_ref(i) for i in data[2:]])

  def _stack_broadcast_to(self, x, data, name, rank):
    shape = self._shape(x.name + ":0")
    if self._stacked_source(x, data[0]) is None or self._value(data[1]) is None or shape is None:
      return False
    operand = self._operand(data[0], rank)
    if not self._copied(x, name, [operand, self._const(f"stkh/{x.name}/shape", np.array([self.n] + shape,
                                                                                         np.int64))]):
      return False
    self.out.node[-1].attr["Tidx"].type = tf.int64.as_datatype_enum
    return True

  def _stack_expand_dims(self, x, data, name, rank):
    axis = self._value(data[1])
    if self._stacked_source(x, data[0]) is None or axis is None:
      return False
    axis = int(np.reshape(axis, ()))
    self._copy(x, name, [self.stacked_ref(data[0]),
                         self._const(f"stkh/{x.name}/axis", np.int32(axis + 1 if axis >= 0 else axis))])
    self.out.node[-1].attr["Tdim"].type = tf.int32.as_datatype_enum
    return True

  def _stack_squeeze(self, x, data, name, rank):
    in_rank = self._stacked_source(x, data[0])
    if in_rank is None:
      return False
    dims = list(x.attr["squeeze_dims"].list.i)
    if not dims:
      shape = self._shape(data[0])
      if shape is None:
        return False
      dims = [d for d, s in enumerate(shape) if s == 1]
    return self._copied(x, name, [self.stacked_ref(data[0])], squeeze_dims=[d % in_rank + 1 for d in dims])

  def _stack_one_hot(self, x, data, name, rank):
    if self._stacked_source(x, data[0]) is None or any(self.form[node_of(i)] != UNIFORM for i in data[1:]):
      return False
    axis = x.attr["axis"].i
    return self._copied(x, name, [self.stacked_ref(data[0])] + [self._uniform_ref(i) for i in data[1:]],
                        axis=axis if axis < 0 else axis + 1)

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
        (kind_of(x) != "all-reduce" and (not shape or shape[0] % size)):
      return False
    # A group that is one mesh axis (or neighbouring axes): the device dimension, read as [outer, size, inner],
    # varies the middle index within a group.
    inner = next((b for b in range(1, self.n // size + 1) if (self.n // size) % b == 0 and all(
        ranked[p] == tuple((p // (size * b)) * size * b + j * b + p % b for j in range(size)) for p in range(self.n))),
                 None)
    if inner is not None and kind_of(x) in ("all-reduce", "all-gather"):
      self._collective_on_axes(x, shape, size, inner)
    elif kind_of(x) == "all-to-all":   # device q, rank k of its group, takes chunk k of each member, in rank order
      t = tf.as_dtype(x.attr["T"].type)
      chunks = self._grouping(x, self.stacked_ref(x.input[0]), [self.n * size, shape[0] // size] + shape[1:],
                              "chunks")
      taken = self._rows(x, chunks, [member * size + ranked[q].index(q) for q in range(self.n)
                                     for member in ranked[q]], "taken", self.controls(x))
      self._node(f"stk/{x.name}", "Identity", [self._grouping(x, taken, [self.n] + shape, "result")], T=t)
    else:
      self._collective_of_groups(x, shape, ranked, groups)
    return True

  def _rows(self, x, ref, index, label, controls=()):
    """Rows `index` of `ref` (a helper node of collective `x`); `ref` itself where that is every row in order."""
    if list(index) == list(range(len(index))):
      return ref
    return self._node(f"stkh/{x.name}/{label}", "GatherV2",
                      [ref, self._const(f"stkh/{x.name}/{label}_index", np.array(index, np.int32)),
                       self._const(f"stkh/{x.name}/{label}_axis", np.int32(0))] + list(controls),
                      Tparams=tf.as_dtype(x.attr["T"].type), Tindices=tf.int32, Taxis=tf.int32, batch_dims=0) + ":0"

  def _grouping(self, x, ref, dims, label):
    """`ref` reshaped to `dims` (a helper node of collective `x`)."""
    return self._reshape(f"stkh/{x.name}/{label}", ref, dims, tf.as_dtype(x.attr["T"].type))

  def _collective_on_axes(self, x, shape, size, inner):
    """An all-reduce or all-gather whose groups vary the middle index of the device dimension read as
    [outer, size, inner]: reduced or concatenated there, and broadcast back to every member."""
    t = tf.as_dtype(x.attr["T"].type)
    mesh = [self.n // (size * inner), size, inner]
    grouped = self._grouping(x, self.stacked_ref(x.input[0]), mesh + shape, "grouped")
    if kind_of(x) == "all-reduce":   # reduced over the middle index, where every member sits
      merged = self._node(f"stkh/{x.name}/reduced", _REDUCE_BY[x.attr["merge_op"].s],
                          [grouped, self._const(f"stkh/{x.name}/reduced_axis", np.int32(1))] + self.controls(x),
                          T=t, Tidx=tf.int32, keep_dims=True) + ":0"
      dims = shape
    else:   # the members' operands in rank order along their dim 0: the middle index moved next to it
      moved = self._node(f"stkh/{x.name}/moved", "Transpose",
                         [grouped, self._const(f"stkh/{x.name}/perm", np.array(
                             [0, 2, 1] + list(range(3, len(shape) + 3)), np.int32))] + self.controls(x),
                         T=t, Tperm=tf.int32) + ":0"
      dims = [size * shape[0]] + shape[1:]
      merged = self._grouping(x, moved, [mesh[0], 1, inner] + dims, "merged")
    wide = self._node(f"stkh/{x.name}/wide", "BroadcastTo",
                      [merged, self._const(f"stkh/{x.name}/wide_shape", np.array(mesh + dims, np.int64))],
                      T=t, Tidx=tf.int64) + ":0"
    self._reshape(f"stk/{x.name}", wide, [self.n] + dims, t)

  def _collective_of_groups(self, x, shape, ranked, groups):
    """An all-reduce or all-gather over any groups: the members gathered group by group, reduced or concatenated,
    and each device's copy of its group's result spread back."""
    t = tf.as_dtype(x.attr["T"].type)
    size = len(groups[0])
    members = self._rows(x, self.stacked_ref(x.input[0]), [q for group in groups for q in group], "members",
                         self.controls(x))
    which = [groups.index(ranked[p]) for p in range(self.n)]

    def spread(ref, dims, label):
      """Each device's copy of its group's row of `ref` ([groups] + dims): neighbours in mesh order form a group
      when the collective runs over the mesh's last axes, and a broadcast costs less than a gather there."""
      if which != [p // size for p in range(self.n)]:
        return self._rows(x, ref, which, label)
      one = self._grouping(x, ref, [len(groups), 1] + dims, f"{label}_one")
      wide = self._node(f"stkh/{x.name}/{label}_wide", "BroadcastTo",
                        [one, self._const(f"stkh/{x.name}/{label}_wide_shape",
                                          np.array([len(groups), size] + dims, np.int64))],
                        T=t, Tidx=tf.int64) + ":0"
      return self._grouping(x, wide, [self.n] + dims, label)

    if kind_of(x) == "all-reduce":
      grouped = self._grouping(x, members, [len(groups), size] + shape, "grouped")
      reduced = self._node(f"stkh/{x.name}/reduced", _REDUCE_BY[x.attr["merge_op"].s],
                           [grouped, self._const(f"stkh/{x.name}/reduced_axis", np.int32(1))], T=t, Tidx=tf.int32,
                           keep_dims=False) + ":0"
      result = spread(reduced, shape, "result")
    else:
      grouped = self._grouping(x, members, [len(groups), size * shape[0]] + shape[1:], "grouped")
      result = spread(grouped, [size * shape[0]] + shape[1:], "result")
    self._node(f"stk/{x.name}", "Identity", [result], T=t)

  def _regrouped(self, x, name, operand, consts):
    """Node `name`: collective `x` over the processes' groups (`consts`: their size, key and instance key)."""
    node = self.out.node.add(name=name, device=self.devices[0])
    vocabulary.write_regrouped(node, x, operand, *consts, controls=self.controls(x))

  def _across(self, x, group_key, size, instance_key, slots):
    """A collective whose groups cross processes (in_process.crossing): one TF collective of the stacked operand
    among the first devices of the `size` processes they join (`group_key`), on this process's first device.
    An all-reduce reduces every row with its peers' as it is; an all-gather's blocks are put process-major
    around it; an all-to-all sends each process every device's blocks for its members, and each device takes
    its own from what arrives (`slots`)."""
    t = tf.as_dtype(x.attr["T"].type)
    shape = self._shape(x.input[0])
    per = slots.shape[1]   # the group's members in each process
    if kind_of(x) != "all-reduce" and (not shape or kind_of(x) == "all-to-all" and shape[0] % (size * per)):
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

    if kind_of(x) == "all-reduce":
      self._regrouped(x, name, operand, consts)
      return
    rest = int(np.prod(shape[1:], dtype=np.int64))
    if kind_of(x) == "all-gather":   # [processes * n, rows, ...] -> row i: every process's rows of device i
      self._regrouped(x, f"stkx/{x.name}/op", operand, consts)
      got = reshape(f"stkx/{x.name}/op:0", [size, self.n, shape[0] * rest], "got")
      self._reshape(name, swap(got, 3, "mine"), [self.n, size * shape[0]] + shape[1:], t)
      return
    block = shape[0] // (size * per) * rest   # an all-to-all: what a device sends each member
    out = reshape(swap(reshape(operand, [self.n, size, per * block], "blocks"), 3, "out"),
                  [size, self.n * per * block], "sent")
    self._regrouped(x, f"stkx/{x.name}/op", out, consts)
    got = reshape(f"stkx/{x.name}/op:0", [size, self.n * per, block], "got")   # [process, its row, slot, block]
    if slots.reshape(-1).tolist() != list(range(self.n * per)):
      got = self._node(f"stkx/{x.name}/taken", "GatherV2",
                       [got, self._const(f"stkx/{x.name}/slots", slots),
                        self._const(f"stkx/{x.name}/slots_axis", np.int32(1))],
                       Tparams=t, Tindices=tf.int32, Taxis=tf.int32, batch_dims=0) + ":0"
    got = reshape(got, [size, self.n, per * block], "each")
    self._reshape(name, swap(got, 3, "mine"), [self.n] + shape, t)

  def _stack_gather(self, x, data, name, rank):  # pylint: disable=unused-argument
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

  def _stack_einsum(self, x, data, name, rank):  # pylint: disable=unused-argument
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
