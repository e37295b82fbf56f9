"""Stacking: in the one graph of every device's program (rewriter/one_graph/in_process.py), the devices' copies of an
op run as one op over a leading device dimension.

Every mesh device runs the same per-device program, so in one graph each op appears once per device, on tensors
of one shape. A small step is then dominated by the executor's per-op cost, 8 times over on 8 devices. Here a
tensor of the per-device program has one of three forms in the graph:

  * uniform (`uni/<name>`): one tensor, the same on every device -- constants, replicated arguments, reads of
    replicated variables (device 0's), and what is computed from them alone;
  * stacked (`stk/<name>`): one tensor of shape [devices] + the per-device shape, device p's value at index p --
    the partition id (0, 1, ...) and what an op with a rule (rewriter/one_graph/stacking_rules.py) computes from stacked
    and uniform operands, all-reduces, all-gathers and all-to-alls included;
  * per device (`d<p>/<name>`, as rewriter/one_graph/in_process.py builds them): everything else -- what touches a
    device's variables, split arguments, collective-permutes (their in-process meanings), stateful ops, function
    calls, and ops without a rule.

Between forms the graph packs per-device tensors (`Pack`)
or unpacks a stacked one (`Unpack`), once per tensor. Values are those of the per-device ops, up to the order
of floating-point sums.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.rewriter.graph import graph_view
from tf_gspmd.rewriter.collectives import shapes as collective_shapes
from tf_gspmd.rewriter.graph.graph_view import is_control, node_of, split_ref
from tf_gspmd.rewriter.collectives.vocabulary import kind_of
from tf_gspmd.rewriter.one_graph.stacking_rules import PER_DEVICE, STACKED, STACKED_KINDS, UNIFORM, Rules

# Stacking saves the executor's per-op cost (a few microseconds an op) for every device but the first, and costs
# a copy wherever per-device tensors are packed or a group's result is spread: it pays for small tensors, where a
# step is dominated by the number of ops. Larger tensors stay per device (a 4 MiB gradient's all-reduce is one
# AddN the members read, with no copy).
STACK_LIMIT = 1 << 14   # elements per device

_NEVER_UNIFORM = frozenset(("Placeholder", "PlaceholderWithDefault"))
WRITES = frozenset(("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"))
_VARIABLE_OPS = WRITES | {"ReadVariableOp"}


def _levels(gd, order):
  """({node: its level}, {node: its height}): the most nodes on a path from the inputs that order a read after
  them (a control input of a read), and the longest path to an output."""
  ordering = {node_of(i) for x in gd.node if x.op == "ReadVariableOp" for i in x.input if is_control(i)}
  level, height, after = {}, {}, {}
  for x in order:
    level[x.name] = (x.name in ordering) + max((level[node_of(i)] for i in x.input), default=0)
    for i in x.input:
      after.setdefault(node_of(i), []).append(x.name)
  for x in reversed(order):
    height[x.name] = 1 + max((height[y] for y in after.get(x.name, ())), default=-1)
  return level, height


class Stacker(Rules):
  """Decides each node's form and writes the uniform and stacked ones into `out` (the per-device copies are
  rewriter/one_graph/in_process.py's). `per_device` names nodes that must stay per device."""

  def __init__(self, gd, out, devices, partition_id, per_device, uniform_refs, variables, groups, grouped=True,
               stacked_variables=None, positions=None, across=None):
    self.out, self.devices, self.n = out, devices, len(devices)
    positions = range(self.n) if positions is None else positions   # the devices' mesh positions
    across = across or {}   # collectives across processes (in_process.crossing)
    stacked_variables = stacked_variables or {}   # handle Placeholder -> whether replicated
    self.form = {}
    self._uniform = dict(uniform_refs)  # node name -> the name of its uniform tensor's node
    self._packed, self._unpacked = {}, {}
    self._made = set()
    self._consts = {}   # (dtype, shape, bytes) -> the Const holding that value
    self._groups_of = []
    self._nodes = {x.name: x for x in gd.node}
    self._groups = groups   # collective NodeDef -> per device, the mesh positions of its group in rank order
    self._read_group = self._write_group = {}
    if all(x.name in per_device for x in gd.node):   # nothing to stack
      self.form = {x.name: PER_DEVICE for x in gd.node}
      return
    graph = tf.Graph()
    with graph.as_default():
      tf.graph_util.import_graph_def(collective_shapes.for_shapes(gd, variables), name="")
    self.graph = graph
    # Reads join by level -- the most nodes on a path from the inputs that order a read after them (a control
    # input of a read): a read cannot reach another read of its level, nor anything that reaches one -- and
    # writes by height, the longest path to an output. Each keeps the graph acyclic when the members of a group
    # become one node (the two together almost always; see in_process.run).
    order = graph_view.GraphView(gd).order()
    level, height = _levels(gd, order)
    self._stacked_variables = stacked_variables
    self._read_group = self._group([x for x in gd.node if x.op == "ReadVariableOp" and x.name in per_device
                                    and x.name not in self._uniform and not self._of_stacked(x)],
                                   lambda x: x.name + ":0", level) if grouped else {}
    for x in order:
      self.form[x.name] = self._decide(x, per_device, partition_id, positions, across)
    self._write_group = self._group([x for x in gd.node if x.op in WRITES and not self._of_stacked(x) and
                                     x.name in per_device and
                                     self.form[node_of(x.input[1])] != PER_DEVICE and
                                     self._elements(x.input[1]) <= STACK_LIMIT], lambda x: x.input[1],
                                    height) if grouped else {}

  def _of_stacked(self, x):
    """Whether NodeDef `x` reads or writes a variable stored stacked."""
    return x.op in _VARIABLE_OPS and node_of(x.input[0]) in self._stacked_variables

  def _decide(self, x, per_device, partition_id, positions, across):
    """The form of NodeDef `x` (its operands' decided), its uniform or stacked form written where it has one."""
    if x.name in self._stacked_variables:   # a variable stored stacked (runtime/state.py): its one handle
      self._copy(x, f"stk/{x.name}", [])
      return STACKED
    if self._of_stacked(x):   # its read is the stacked value; a write writes every device's row at once
      handle = node_of(x.input[0])
      inputs = [f"stk/{handle}"] + ([self.stacked_ref(x.input[1])] if x.op in WRITES else [])
      self._copy(x, f"stk/{x.name}", inputs)
      if x.op == "ReadVariableOp" and self._stacked_variables[handle]:   # replicated: row 0 stands for all
        zero = self._const("uni/zero", np.int32(0))   # (row 0 of axis 0)
        self._node(f"uni/{x.name}", "GatherV2", [f"stk/{x.name}:0", zero, zero],
                   Tparams=self._dtype(x.name + ":0"), Tindices=tf.int32, Taxis=tf.int32, batch_dims=0)
        self._uniform[x.name] = f"uni/{x.name}"
        return UNIFORM
      return STACKED
    if x.name in self._uniform:
      return UNIFORM
    if x.name == partition_id:
      self._const(f"stk/{x.name}", np.array(positions, dtype=np.int32))
      return STACKED
    if x.name in across:
      self._across(x, *across[x.name])
      return STACKED
    if kind_of(x) in STACKED_KINDS and x.name not in per_device and self._small(x) and self._collective(x):
      return STACKED
    if x.name in per_device or _compat.op_def(x.op) is None or graph_view.is_stateful(x.op) or \
        x.op in _NEVER_UNIFORM or any(v.HasField("func") or v.list.func for v in x.attr.values()):
      return PER_DEVICE
    if x.op in ("Shape", "Size", "Rank") and self._static(x) is not None:   # of a stacked operand
      self._uniform[x.name] = self._const(f"uni/{x.name}", self._static(x)).split(":")[0]
      return UNIFORM
    if all(self.form[node_of(i)] == UNIFORM for i in x.input if not is_control(i)):
      self._copy(x, f"uni/{x.name}", [self._uniform_ref(i) for i in x.input if not is_control(i)])
      self._uniform[x.name] = f"uni/{x.name}"
      return UNIFORM
    return STACKED if self._small(x) and self._stacked(x) else PER_DEVICE

  def _elements(self, i):
    shape = self._shape(i)
    return float("inf") if shape is None else int(np.prod(shape, dtype=np.int64))

  def _small(self, x):
    """Whether stacking NodeDef `x` pays: its results, and what must be packed to feed it, are at most
    STACK_LIMIT elements per device."""
    op = self.graph.get_operation_by_name(x.name)
    return all(self._elements(f"{x.name}:{k}") <= STACK_LIMIT for k in range(len(op.outputs))) and all(
        self._elements(i) <= STACK_LIMIT for i in x.input if not is_control(i) and self.form[node_of(i)] == PER_DEVICE)

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
  # one shape at one level of the per-device program cross as one tensor per device, and so do the values of
  # writes of one shape at one height (see __init__).

  def _group(self, nodes, value, level):
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
    graph_view.write(self.out.node.add(name=name, device=device or self.devices[0]), op, inputs, **attrs)
    return name

  def _const(self, name, value):
    """A Const named `name` holding `value`, as an input string: the one already made with that name, or with that
    value (the stacked forms' shapes, axes and perms repeat across nodes: one Const each)."""
    value = np.asarray(value)
    key = (value.dtype.str, value.shape, value.tobytes())
    if name not in self._made and key in self._consts:
      return self._consts[key]
    if name not in self._made:
      self._made.add(name)
      graph_view.write_const(self.out.node.add(name=name, device=self.devices[0]), value)
      self._consts.setdefault(key, f"{name}:0")
    return f"{name}:0"

  def _copy(self, x, name, inputs, **attrs):
    node = self.out.node.add()
    node.CopyFrom(x)
    node.name, node.device = name, self.devices[0]
    del node.input[:]
    node.input.extend(list(inputs) + self.controls(x))
    graph_view.set_attrs(node, **attrs)
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
