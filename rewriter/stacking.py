"""Stacking: in the one graph of every device's program (rewriter/in_process.py), the devices' copies of an op run
as one op over a leading device dimension.

Every mesh device runs the same per-device program, so in one graph each op appears once per device, on tensors
of one shape. A small step is then dominated by the executor's per-op cost, 8 times over on 8 devices. Here a
tensor of the per-device program has one of three forms in the graph:

  * uniform (`uni/<name>`): one tensor, the same on every device -- constants and what is computed from them alone;
  * stacked (`stk/<name>`): one tensor of shape [devices] + the per-device shape, device p's value at index p --
    the partition id (0, 1, ...) and what an op with a rule below computes from stacked and uniform operands;
  * per device (`d<p>/<name>`, as rewriter/in_process.py builds them): everything else -- what touches a
    device's variables, arguments, collectives (their in-process meanings), stateful ops, function calls, and
    ops without a rule.

A rule writes the op over the device dimension: elementwise ops broadcast a uniform operand as they would on
one device (a stacked operand of lower rank gets unit dimensions after the device dimension); axes, perms,
begins and shapes move by one; MatMul becomes BatchMatMulV2; gathers take the device dimension as a batch
dimension. Between forms the graph packs per-device tensors (`Pack`) or unpacks a stacked one (`Unpack`),
once per tensor. Values are exactly those of the per-device ops: the same kernels on the same elements.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd import _compat
from tf_gspmd.rewriter import graph_view
from tf_gspmd.rewriter.graph_view import is_control, node_of, split_ref

UNIFORM, STACKED, PER_DEVICE = "U", "S", "P"

# Ops applied element by element with broadcasting: over a stacked operand the device dimension is one more.
_BROADCASTING = frozenset((
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "MulNoNan", "Maximum", "Minimum", "Pow",
    "SquaredDifference", "FloorDiv", "FloorMod", "Mod", "TruncateDiv", "TruncateMod", "Equal", "NotEqual", "Less",
    "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr", "BitwiseAnd", "BitwiseOr", "BitwiseXor",
    "SelectV2", "Atan2", "Xdivy", "Xlogy", "Xlog1py",
))
_UNARY = frozenset((
    "Identity", "StopGradient", "PreventGradient", "Neg", "Abs", "Sign", "Sqrt", "Rsqrt", "Square", "Exp", "Expm1",
    "Log", "Log1p", "Tanh", "Sigmoid", "Relu", "Relu6", "Elu", "Selu", "Softplus", "Softsign", "Erf", "Erfc",
    "Floor", "Ceil", "Round", "Rint", "Reciprocal", "Inv", "Sin", "Cos", "Tan", "Cast", "LogicalNot", "IsNan",
    "IsInf", "IsFinite", "ZerosLike", "OnesLike", "Invert",
    "Acos", "Asin", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Lgamma", "Digamma", "LeakyRelu",
))
# Two same-shaped operands, element by element (gradients of unary ops).
_GRADS = frozenset(("TanhGrad", "SigmoidGrad", "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "SoftplusGrad",
                    "SoftsignGrad", "RsqrtGrad", "SqrtGrad", "ReciprocalGrad", "InvGrad", "LeakyReluGrad"))
_REDUCTIONS = frozenset(("Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"))
_NEVER_UNIFORM = frozenset(("Placeholder", "PlaceholderWithDefault"))
_WRITES = frozenset(("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"))
_COLLECTIVES = frozenset(("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2"))
_REDUCE_BY = {b"Add": "Sum", b"Mul": "Prod", b"Max": "Max", b"Min": "Min"}


def _for_shapes(gd, variables):
  """`gd` for shape inference only: each collective replaced by an op of its result's shape (TF's shape functions
  leave a gather's or a receive's unknown), each read of a captured variable (`variables`: handle -> (shape,
  dtype) of a device's shard) by a placeholder of the shard's shape."""
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(gd)
  nodes = {x.name: x for x in gd.node}
  consts = {x.name: x for x in gd.node if x.op == "Const"}

  def handle(i):
    x = nodes.get(node_of(i))
    while x is not None and x.op == "Identity":
      x = nodes.get(node_of(x.input[0]))
    return None if x is None else x.name

  for x in out.node:
    if x.op == "ReadVariableOp" and variables.get(handle(x.input[0])) is not None:
      shape, _ = variables[handle(x.input[0])]
      dtype = x.attr["dtype"].type
      x.op = "Placeholder"
      x.ClearField("attr")
      x.attr["dtype"].type = dtype
      x.attr["shape"].shape.CopyFrom(tf.TensorShape(shape).as_proto())
      kept = [i for i in x.input if is_control(i)]
      del x.input[:]
      x.input.extend(kept)
      continue
    if not x.op.startswith("Collective"):
      continue
    data = [i for i in x.input if not is_control(i)]
    controls = [i for i in x.input if is_control(i)]
    dtype = x.attr["T"].type
    if x.op in ("CollectiveReduceV2", "CollectiveAllToAllV2", "CollectiveBcastSendV2"):
      op, inputs, attrs = "Identity", [data[0]], {}
    elif x.op == "CollectiveGatherV2" and node_of(data[1]) in consts:
      size = int(tf.make_ndarray(consts[node_of(data[1])].attr["value"].tensor))
      axis = out.node.add()
      axis.name, axis.op = f"{x.name}/shape_axis", "Const"
      axis.attr["dtype"].type = tf.int32.as_datatype_enum
      axis.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.int32(0)))
      op, inputs, attrs = "ConcatV2", [data[0]] * size + [axis.name], {"N": size, "Tidx": tf.int32}
    elif x.op == "CollectiveBcastRecvV2":
      zero = out.node.add()
      zero.name, zero.op = f"{x.name}/shape_zero", "Const"
      zero.attr["dtype"].type = dtype
      zero.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.zeros((), tf.as_dtype(dtype).as_numpy_dtype)))
      op, inputs, attrs = "Fill", [data[3], zero.name], {"index_type": tf.as_dtype(x.attr["Tshape"].type)}
    else:
      continue
    x.op = op
    x.ClearField("attr")
    x.attr["T"].type = dtype
    for key, v in attrs.items():
      if isinstance(v, int):
        x.attr[key].i = v
      else:
        x.attr[key].type = v.as_datatype_enum
    del x.input[:]
    x.input.extend(inputs + controls)
  return out


class Stacker:
  """Decides each node's form and writes the uniform and stacked ones into `out` (the per-device copies are
  rewriter/in_process.py's). `per_device` names nodes that must stay per device."""

  def __init__(self, gd, out, devices, partition_id, per_device, uniform_refs, variables, groups, grouped=True):
    self.out, self.devices, self.n = out, devices, len(devices)
    self.form = {}
    self._uniform = dict(uniform_refs)  # node name -> the name of its uniform tensor's node
    self._packed, self._unpacked = {}, {}
    self._made = set()
    self._groups_of = []
    self._nodes = {x.name: x for x in gd.node}
    self._groups = groups   # collective NodeDef -> per device, the mesh positions of its group in rank order
    self._read_group = self._write_group = {}
    if all(x.name in per_device for x in gd.node):   # nothing to stack
      self.form = {x.name: PER_DEVICE for x in gd.node}
      return
    graph = tf.Graph()
    with graph.as_default():
      tf.graph_util.import_graph_def(_for_shapes(gd, variables), name="")
    self.graph = graph
    # Reads join by level -- the most nodes on a path from the inputs that order a read after them (a control
    # input of a read): a read cannot reach another read of its level, nor anything that reaches one -- and
    # writes by height, the longest path to an output. Each keeps the graph acyclic when the members of a group
    # become one node (the two together almost always; see in_process.run).
    order = graph_view.GraphView(gd).order()
    ordering = {node_of(i) for x in gd.node if x.op == "ReadVariableOp" for i in x.input if is_control(i)}
    level, height, after = {}, {}, {}
    for x in order:
      level[x.name] = (x.name in ordering) + max((level[node_of(i)] for i in x.input), default=0)
      for i in x.input:
        after.setdefault(node_of(i), []).append(x.name)
    for x in reversed(order):
      height[x.name] = 1 + max((height[y] for y in after.get(x.name, ())), default=-1)
    self._read_group = self._group(order, [x for x in gd.node if x.op == "ReadVariableOp" and x.name in per_device
                                           and x.name not in self._uniform], lambda x: x.name + ":0", level) \
        if grouped else {}
    for x in graph_view.GraphView(gd).order():
      if x.name in self._uniform:
        self.form[x.name] = UNIFORM
      elif x.name == partition_id:
        self._const(f"stk/{x.name}", np.arange(self.n, dtype=np.int32))
        self.form[x.name] = STACKED
      elif x.op in _COLLECTIVES and x.name not in per_device and self._collective(x):
        self.form[x.name] = STACKED
      elif x.name in per_device or _compat.op_def(x.op) is None or graph_view.is_stateful(x.op) or \
          x.op in _NEVER_UNIFORM or any(v.HasField("func") or v.list.func for v in x.attr.values()):
        self.form[x.name] = PER_DEVICE
      elif x.op in ("Shape", "Size", "Rank") and self._static(x) is not None:   # of a stacked operand
        self._uniform[x.name] = self._const(f"uni/{x.name}", self._static(x)).split(":")[0]
        self.form[x.name] = UNIFORM
      elif all(self.form[node_of(i)] == UNIFORM for i in x.input if not is_control(i)):
        self._copy(x, f"uni/{x.name}", [self._uniform_ref(i) for i in x.input if not is_control(i)])
        self._uniform[x.name] = f"uni/{x.name}"
        self.form[x.name] = UNIFORM
      else:
        self.form[x.name] = STACKED if self._stacked(x) else PER_DEVICE
    self._write_group = self._group(order, [x for x in gd.node if x.op in _WRITES and x.name in per_device and
                                            self.form[node_of(x.input[1])] != PER_DEVICE], lambda x: x.input[1],
                                    height) if grouped else {}

  # ---- references ----------------------------------------------------------------------------------------------

  def _uniform_ref(self, i):
    name, k = split_ref(i)
    return f"{self._uniform[name]}:{k}"

  def controls(self, x):
    out = []
    for i in x.input:
      if is_control(i):
        name = i[1:]
        form = self.form[name]
        if form == PER_DEVICE:
          out += [f"^d{p}/{name}" for p in range(self.n)]
        else:
          out.append("^" + (self._uniform[name] if form == UNIFORM else f"stk/{name}"))
    return out

  def stacked_ref(self, i):
    """Input `i` as a stacked tensor (per-device tensors packed once)."""
    name, k = split_ref(i)
    form = self.form[name]
    if form == STACKED:
      return f"stk/{name}:{k}"
    key = (name, k)
    if key not in self._packed and key in self._read_group:
      self._stack_reads(self._read_group[key])
    if key not in self._packed:
      pack = self._node(f"stk_pack/{name}/{k}", "Pack", [self.per_device_ref(i, p) for p in range(self.n)],
                        T=self._dtype(i), N=self.n, axis=0)
      self._packed[key] = f"{pack}:0"
    return self._packed[key]

  # ---- variable reads and writes, a group at a time -------------------------------------------------------------
  # A read runs on its variable's device and a write there too; each value that crosses between a device and the
  # first one is a send and a receive in TF's executor, which cost more than the small ops around them. Reads of
  # one shape at one depth of the per-device program cross as one tensor per device, and so do writes: equal
  # depth (the longest path from the program's inputs) keeps the graph acyclic when they are joined.

  def _group(self, order, nodes, value, level):
    """{(node name, 0): (group id, position)} for `nodes` grouped by `level`, the form, dtype and shape of
    `value(node)`: groups of two or more."""
    groups = {}
    for x in nodes:
      shape = self._shape(value(x))
      if shape is not None:
        key = (level[x.name], self.form.get(node_of(value(x))), self._dtype(value(x)), tuple(shape))
        groups.setdefault(key, []).append(x.name)
    found = {}
    for members in groups.values():
      if len(members) > 1:
        gid = len(self._groups_of)
        self._groups_of.append(members)
        found.update({(m, 0): (gid, j) for j, m in enumerate(members)})
    return found

  def _stack_reads(self, group):
    gid, _ = group
    members = self._groups_of[gid]
    dtype = self._dtype(members[0] + ":0")
    per_device = [self._node(f"stk_reads/{gid}/d{p}", "Pack", [f"d{p}/{m}:0" for m in members], device=self.devices[p],
                             T=dtype, N=len(members), axis=0) + ":0" for p in range(self.n)]
    both = self._node(f"stk_reads/{gid}", "Pack", per_device, T=dtype, N=self.n, axis=1)
    each = self._node(f"stk_reads/{gid}/each", "Unpack", [both + ":0"], T=dtype, num=len(members), axis=0)
    for j, m in enumerate(members):
      self._packed[(m, 0)] = f"{each}:{j}"

  def write_value(self, x, p):
    """Device p's value input of write NodeDef `x`, or None where it is not one of a group."""
    key = (x.name, 0)
    if key not in self._write_group:
      return None
    gid, j = self._write_group[key]
    members = self._groups_of[gid]
    name = f"stk_writes/{gid}"
    if name not in self._made:
      values = [self._nodes[m].input[1] for m in members]
      dtype = self._dtype(values[0])
      if self.form[node_of(values[0])] == UNIFORM:   # the same values for every device
        both = self._node(name, "Pack", [self._uniform_ref(v) for v in values], T=dtype, N=len(members), axis=0)
        each = [f"{both}:0"] * self.n
      else:
        both = self._node(name, "Pack", [self.stacked_ref(v) for v in values], T=dtype, N=len(members), axis=1)
        unpacked = self._node(f"{name}/each", "Unpack", [both + ":0"], T=dtype, num=self.n, axis=0)
        each = [f"{unpacked}:{q}" for q in range(self.n)]
      for q in range(self.n):
        self._node(f"{name}/d{q}", "Unpack", [each[q]], device=self.devices[q], T=dtype, num=len(members), axis=0)
    return f"{name}/d{p}:{j}"

  def per_device_ref(self, i, p):
    """Device p's tensor of input `i` (a data reference of the per-device program)."""
    name, k = split_ref(i)
    form = self.form[name]
    if form == PER_DEVICE:
      return f"d{p}/{name}:{k}"
    if form == UNIFORM:
      return self._uniform_ref(i)
    key = (name, k)
    if key not in self._unpacked:
      self._unpacked[key] = self._node(f"stk_unpack/{name}/{k}", "Unpack", [f"stk/{name}:{k}"],
                                       T=self._dtype(i), num=self.n, axis=0)
    return f"{self._unpacked[key]}:{p}"

  def rename(self, i, existing):
    """An input string of the one graph, with a reference to device p's copy of a uniform or stacked node (a node
    not in `existing`: those have no copies) turned into one to its form."""
    control = is_control(i)
    name, k = split_ref(i[1:] if control else i)
    head, _, rest = name.partition("/")
    if not (head[:1] == "d" and head[1:].isdigit()) or name in existing or \
        self.form.get(rest, PER_DEVICE) == PER_DEVICE:
      return i
    if control:
      return "^" + (self._uniform[rest] if self.form[rest] == UNIFORM else f"stk/{rest}")
    return self.per_device_ref(f"{rest}:{k}", int(head[1:]))

  # ---- emission ------------------------------------------------------------------------------------------------

  def _node(self, name, op, inputs, device=None, **attrs):
    if name in self._made:   # a helper another consumer made already
      return name
    self._made.add(name)
    node = self.out.node.add()
    node.name, node.op, node.device = name, op, device or self.devices[0]
    node.input.extend(inputs)
    for key, v in attrs.items():
      if isinstance(v, tf.DType):
        node.attr[key].type = v.as_datatype_enum
      elif isinstance(v, bool):
        node.attr[key].b = v
      elif isinstance(v, int):
        node.attr[key].i = v
      elif isinstance(v, str):
        node.attr[key].s = v.encode()
      elif isinstance(v, (list, tuple)):
        node.attr[key].list.i.extend(v)
      else:
        node.attr[key].CopyFrom(v)
    return name

  def _const(self, name, value):
    if name in self._made:
      return f"{name}:0"
    self._made.add(name)
    value = np.asarray(value)
    node = self.out.node.add()
    node.name, node.op, node.device = name, "Const", self.devices[0]
    node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
    return f"{name}:0"

  def _copy(self, x, name, inputs, **attrs):
    node = self.out.node.add()
    node.CopyFrom(x)
    node.name, node.device = name, self.devices[0]
    del node.input[:]
    node.input.extend(list(inputs) + self.controls(x))
    for key, v in attrs.items():
      if isinstance(v, bool):
        node.attr[key].b = v
      elif isinstance(v, int):
        node.attr[key].i = v
      else:
        node.attr[key].list.Clear()
        node.attr[key].list.i.extend(v)
    return name

  # ---- what the per-device program says about a tensor ----------------------------------------------------------

  def _tensor(self, i):
    name, k = split_ref(i)
    return self.graph.get_operation_by_name(name).outputs[k]

  def _static(self, x):
    return tf.get_static_value(self._tensor(x.name + ":0"))

  def _dtype(self, i):
    return self._tensor(i).dtype

  def _shape(self, i):
    """The static per-device shape of input `i` as a list, or None where not fully known."""
    shape = self._tensor(i).shape
    return shape.as_list() if shape.is_fully_defined() else None

  def _rank(self, i):
    return self._tensor(i).shape.rank

  def _value(self, i):
    """The constant value of uniform input `i`, or None."""
    if self.form[node_of(i)] != UNIFORM:
      return None
    return tf.get_static_value(self._tensor(i))

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
    target = self._const(f"stk_shape/{node_of(i)}/{split_ref(i)[1]}/{rank}",
                         np.array([self.n] + [1] * (rank - own) + shape, np.int64))
    return self._node(f"stk_rank/{node_of(i)}/{split_ref(i)[1]}/{rank}", "Reshape", [self.stacked_ref(i), target],
                      T=self._dtype(i), Tshape=tf.int64) + ":0"

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

  # ---- rules ----------------------------------------------------------------------------------------------------

  def _stacked(self, x):
    """Write the stacked form of NodeDef `x` (some data input stacked); False where it has no rule."""
    data = [i for i in x.input if not is_control(i)]
    name = f"stk/{x.name}"
    out = self._tensor(x.name + ":0") if self.graph.get_operation_by_name(x.name).outputs else None
    rank = out.shape.rank if out is not None else None
    op = x.op
    if op in _UNARY or op in _GRADS or op in _BROADCASTING or op == "AddN" or op == "BiasAdd":
      if rank is None:
        return False
      if op == "BiasAdd" and (x.attr["data_format"].s not in (b"", b"NHWC") or
                              self.form[node_of(data[1])] != UNIFORM):
        return False
      if op in _GRADS or op == "AddN":   # no broadcasting: every operand stacked at the output's shape
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
      flat = self._node(f"stkh/{x.name}/rows", "Reshape", [self.stacked_ref(data[0]),
                                                    self._const(f"stkh/{x.name}/rows_shape", np.array([-1, shape[-1]], np.int64))],
                        T=x.attr["T"], Tshape=tf.int64)
      soft = self._node(f"stkh/{x.name}/flat", op, [flat + ":0"], T=x.attr["T"])
      self._node(name, "Reshape", [soft + ":0", self._const(f"stkh/{x.name}/shape", np.array([self.n] + shape, np.int64))] +
                 self.controls(x), T=x.attr["T"], Tshape=tf.int64)
      return True
    if op == "Reshape":
      shape = self._shape(x.name + ":0")
      if shape is None:
        return False
      target = self._const(f"stkh/{x.name}/shape", np.array([self.n] + shape, np.int64))
      self._node(name, "Reshape", [self.stacked_ref(data[0]), target] + self.controls(x), T=x.attr["T"],
                 Tshape=tf.int64)
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
      return self._node(f"stkh/{x.name}/{label}", "Reshape", [ref, self._const(f"stkh/{x.name}/{label}_shape", np.array(dims, np.int64))],
                        T=t, Tshape=tf.int64) + ":0"

    members = gather(self.stacked_ref(x.input[0]), flat, "members", self.controls(x))
    which = [groups.index(ranked[p]) for p in range(self.n)]
    if x.op == "CollectiveReduceV2":
      grouped = reshape(members, [len(groups), size] + shape, "grouped")
      reduced = self._node(f"stkh/{x.name}/reduced", _REDUCE_BY[x.attr["merge_op"].s],
                           [grouped, self._const(f"stkh/{x.name}/reduced_axis", np.int32(1))], T=t, Tidx=tf.int32,
                           keep_dims=False) + ":0"
      result = gather(reduced, which, "result")
    elif x.op == "CollectiveGatherV2":
      grouped = reshape(members, [len(groups), size * shape[0]] + shape[1:], "grouped")
      result = gather(grouped, which, "result")
    else:
      blocks = reshape(members, [len(groups), size, size, shape[0] // size] + shape[1:], "blocks")
      moved = self._node(f"stkh/{x.name}/moved", "Transpose",
                         [blocks, self._const(f"stkh/{x.name}/perm", np.array([0, 2, 1] + list(range(3, len(shape) + 3)),
                                                                       np.int32))], T=t, Tperm=tf.int32) + ":0"
      rows = reshape(moved, [self.n] + shape, "rows")
      result = gather(rows, [flat.index(p) for p in range(self.n)], "result")
    self._node(name, "Identity", [result], T=t)
    return True

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
