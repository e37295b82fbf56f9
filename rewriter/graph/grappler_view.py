"""What Grappler is shown of a graph, so that optimizing it costs memory and time by the graph's size, not by
its tensors' sizes.

Two things in Grappler grow with the tensors. Building its GrapplerItem gives every Placeholder a "fake feed": a
tensor of the placeholder's full shape, allocated and filled (grappler_item_builder.cc), 2 GiB for an
f32[32768, 16384] argument that no optimizer reads. And constant folding evaluates every node whose inputs are
constants, at full size: a Fill of an argument-sized shape (`tf.zeros_like(w)` traces to one), and every
element-wise op of two such values, is computed on the host to become a (splat) constant.

`conceal` returns the copy Grappler optimizes, `reveal` undoes what it changed on Grappler's result:

* Placeholders keep their rank but not their dims (a fake feed of one element). Grappler's constant folding
  and arithmetic optimizer treat a fed placeholder's shape as unknown anyway; its remapper reads it, for fusions
  that none of the per-device programs checked lost.
* A generator -- a node Grappler could fold whose outputs would hold more than LIMIT_BYTES and more than its
  inputs (Fill, BroadcastTo, Tile, a stateless random op, ... of constants) -- reads each data input through an
  opaque PlaceholderWithDefault (marked with OPAQUE_ATTR), which Grappler neither folds nor sees through: the
  generator and everything computed from it stay ops, which the partitioner emits at their local shard shapes.

Values up to LIMIT_BYTES fold as before: the shape computations later passes rely on (Shape -> StridedSlice ->
Pack -> Reshape chains) are small. The main graph and every function of its library (While bodies, If branches,
functions Grappler inlines) are treated alike. Static sizes come from the traced shapes (`_output_shapes`), or,
for nodes without them (the per-device program), from TF's shape inference on the constant nodes alone.
"""

import dataclasses
from typing import Any, Dict

import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.rewriter.graph.graph_view import dedupe_controls, is_control, is_stateful, split_ref

LIMIT_BYTES = 1 << 16   # the largest value Grappler may compute (fold) from constants
OPAQUE_ATTR = "_gspmd_opaque"
PLACEHOLDERS = ("Placeholder", "PlaceholderV2")
PWD = "PlaceholderWithDefault"
# Ops whose outputs Grappler may turn into constants though an input is not one (it knows the input's shape).
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
# Ops Grappler never folds, stateless or not: inputs, calls, control flow.
_NEVER_FOLDED = frozenset({"Placeholder", "PlaceholderV2", PWD, "_Arg", "_Retval", "PartitionedCall",
                           "StatefulPartitionedCall", "While", "StatelessWhile", "If", "StatelessIf", "Case",
                           "StatelessCase", "NoOp"})


@dataclasses.dataclass
class Concealed:
  """What `reveal` needs to undo `conceal` on Grappler's result."""

  placeholder_shapes: Dict[str, Any]   # Placeholder name -> its `shape` AttrValue
  opaque: int                          # how many inputs were made opaque (over the graph and its functions)


def conceal(graph_def, gd):
  """Write into `gd` (a GraphDef) the copy of `graph_def` Grappler is to optimize; returns a Concealed."""
  gd.CopyFrom(graph_def)
  shapes = {}
  for nd in gd.node:
    if nd.op in PLACEHOLDERS and "shape" in nd.attr:
      shapes[nd.name] = tf.compat.v1.AttrValue()
      shapes[nd.name].CopyFrom(nd.attr["shape"])
      for d in nd.attr["shape"].shape.dim:
        d.size = -1
  opaque = _make_opaque(gd.node, _MAIN)
  for f in gd.library.function:
    opaque += _make_opaque(f.node_def, _BODY)
  return Concealed(shapes, opaque)


def reveal(optimized, concealed):
  """Undo `conceal` on `optimized` (Grappler's result), in place: placeholder shapes restored, every opaque
  input read directly again (Grappler may have moved or copied the opaque nodes: all are found by their mark)."""
  for nd in optimized.node:
    if nd.op in PLACEHOLDERS and nd.name in concealed.placeholder_shapes:
      nd.attr["shape"].CopyFrom(concealed.placeholder_shapes[nd.name])
  if not concealed.opaque:
    return optimized
  _bypass(optimized.node, _MAIN, None)
  for f in optimized.library.function:
    _bypass(f.node_def, _BODY, f.ret)
  return optimized


# ---- references: the main graph's "node:index" and a function body's "node:output_arg:index" ---------------------

class _Refs:
  """How one kind of graph names tensors."""

  def __init__(self, body):
    self.body = body

  def producer(self, r):
    """The node (or function parameter) a data reference reads."""
    return r.split(":", 1)[0] if self.body else split_ref(r)[0]

  def output(self, r, nd):
    """The flat output index of `nd` that data reference `r` reads (None if unknown)."""
    if not self.body:
      return split_ref(r)[1]
    parts = r.split(":")
    if len(parts) != 3 or nd is None:
      return 0 if len(parts) == 1 else None
    flat = 0
    for arg, n in _output_arg_counts(nd):
      if arg == parts[1]:
        return flat + int(parts[2])
      flat += n
    return None

  def of(self, name):
    """The reference to output 0 of a PlaceholderWithDefault named `name`."""
    return f"{name}:output:0" if self.body else name

  def reads(self, r, name):
    """Whether data reference `r` reads output 0 of node `name`."""
    return r == f"{name}:output:0" if self.body else split_ref(r) == (name, 0)


_MAIN, _BODY = _Refs(False), _Refs(True)


# ---- static sizes -------------------------------------------------------------------------------------------------

def _attr(nd, op_def, name):
  """AttrValue `name` of `nd`, or its op's default (None if neither)."""
  if name in nd.attr:
    return nd.attr[name]
  for a in op_def.attr:
    if a.name == name and a.HasField("default_value"):
      return a.default_value
  return None


def _arg_types(nd, args, op_def):
  """[(arg name, [dtype enum per tensor])] of an op's input or output args; None where an attr is missing."""
  out = []
  for arg in args:
    if arg.type_list_attr:
      a = _attr(nd, op_def, arg.type_list_attr)
      types = None if a is None else list(a.list.type)
    else:
      t = arg.type
      if not t:
        a = _attr(nd, op_def, arg.type_attr)
        t = None if a is None else a.type
      n = _attr(nd, op_def, arg.number_attr).i if arg.number_attr and _attr(nd, op_def, arg.number_attr) else 1
      types = None if t is None else [t] * n
    if types is None:
      return None
    out.append((arg.name, types))
  return out


def _output_arg_counts(nd):
  op_def = _compat.op_def(nd.op)
  types = _arg_types(nd, op_def.output_arg, op_def) if op_def is not None else None
  return [(name, len(t)) for name, t in types or ()]


def _input_dtypes(nd):
  """The dtype enum of each data input of `nd`, in order (None if unknown)."""
  op_def = _compat.op_def(nd.op)
  types = _arg_types(nd, op_def.input_arg, op_def) if op_def is not None else None
  return None if types is None else [t for _, ts in types for t in ts]


def _nbytes(shape, dtype):
  """Bytes of a tensor of `shape` (a TensorShapeProto) and dtype enum `dtype`; None if the shape is not static."""
  if shape.unknown_rank or any(d.size < 0 for d in shape.dim):
    return None
  n = 1
  for d in shape.dim:
    n *= d.size
  return n * tf.as_dtype(dtype).size


def _traced_outputs(nodes):
  """{node name: [(TensorShapeProto, bytes or None) per output]} from the traced shapes (`_output_shapes`)."""
  out = {}
  for nd in nodes:
    if "_output_shapes" not in nd.attr:
      continue
    op_def = _compat.op_def(nd.op)
    types = _arg_types(nd, op_def.output_arg, op_def) if op_def is not None else None
    dtypes = [t for _, ts in types or () for t in ts]
    shapes = list(nd.attr["_output_shapes"].list.shape)
    if len(dtypes) == len(shapes):
      out[nd.name] = [(s, _nbytes(s, t)) for s, t in zip(shapes, dtypes)]
  return out


def _inferred_outputs(nodes, refs, constant):
  """Static outputs of the `constant` nodes, by TF's shape inference on them alone (their values are known, so
  their shapes are): imported with the shape ops among them as placeholders. {} if the import fails."""
  by_name = {nd.name: nd for nd in nodes}
  gd = tf.compat.v1.GraphDef()
  stand_ins = {}

  def graph_ref(r):
    name = refs.producer(r)
    k = refs.output(r, by_name[name])
    if name in stand_ins:
      return stand_ins[name][k]
    return f"{name}:{k}"

  for nd in nodes:
    if constant.get(nd.name) and nd.op in _SHAPE_OPS:
      op_def = _compat.op_def(nd.op)
      dtypes = [t for _, ts in _arg_types(nd, op_def.output_arg, op_def) or () for t in ts]
      stand_ins[nd.name] = [f"{nd.name}/out_{k}" for k in range(len(dtypes))]
      for name, dtype in zip(stand_ins[nd.name], dtypes):
        ph = gd.node.add(name=name, op="Placeholder")
        ph.attr["dtype"].type = dtype
  for nd in nodes:
    if not constant.get(nd.name) or nd.op in _SHAPE_OPS:
      continue
    data = [i for i in nd.input if not is_control(i)]
    if any(refs.output(i, by_name[refs.producer(i)]) is None for i in data):
      return {}
    copy = gd.node.add(name=nd.name, op=nd.op, input=[graph_ref(i) for i in data])
    for key, value in nd.attr.items():
      if key != "_output_shapes":
        copy.attr[key].CopyFrom(value)
  graph = tf.Graph()
  try:
    with graph.as_default():
      tf.graph_util.import_graph_def(gd, name="")
  except (ValueError, TypeError, KeyError, tf.errors.OpError):
    return {}
  out = {}
  for op in graph.get_operations():
    if op.name in by_name:
      out[op.name] = [(t.shape.as_proto(), _nbytes(t.shape.as_proto(), t.dtype.as_datatype_enum)) for t in op.outputs]
  return out


# ---- generators ---------------------------------------------------------------------------------------------------

def _order(nodes, refs):
  """`nodes` in topological order (their inputs from outside the list, e.g. parameters, count as ready)."""
  by_name = {nd.name: nd for nd in nodes}
  done, out = set(), []
  for root in nodes:
    stack = [(root, False)]
    while stack:
      nd, expanded = stack.pop()
      if nd.name in done:
        continue
      if expanded:
        done.add(nd.name)
        out.append(nd)
        continue
      stack.append((nd, True))
      for i in nd.input:
        p = by_name.get(refs.producer(i[1:] if is_control(i) else i))
        if p is not None and p.name not in done:
          stack.append((p, False))
  return out


def _constant(nd, data, constant, refs):
  """Whether Grappler may find `nd`'s outputs constant, given which of its data inputs' producers are."""
  if nd.op == "Const" or nd.op in _SHAPE_OPS:
    return True
  return bool(data) and nd.op not in _NEVER_FOLDED and not is_stateful(nd.op) and all(
      constant.get(refs.producer(i), False) for i in data)


def _generators(nodes, refs):
  """The nodes of `nodes` Grappler would fold into values of more than LIMIT_BYTES, more than their inputs hold.

  A node's outputs are constant to Grappler when it is a Const, a shape op, or a stateless op whose data inputs
  all are. Sizes are the traced ones, else inferred on the constant nodes alone. Once a generator is found its
  outputs count as not constant (its inputs will be opaque), so only the first of a chain is one."""
  by_name = {nd.name: nd for nd in nodes}
  order = _order(nodes, refs)
  constant = {}
  for nd in order:
    constant[nd.name] = _constant(nd, [i for i in nd.input if not is_control(i)], constant, refs)
  candidates = [nd for nd in order if constant[nd.name]]
  static = _traced_outputs(candidates)
  if len(static) < len(candidates):
    static = {**_inferred_outputs(nodes, refs, constant), **static}
  found = []
  for nd in candidates:
    data = [i for i in nd.input if not is_control(i)]
    constant[nd.name] = _constant(nd, data, constant, refs)
    outs = static.get(nd.name)
    if not constant[nd.name] or nd.op == "Const" or not outs or any(b is None for _, b in outs):
      continue
    held = sum(b for _, b in outs)
    read = 0
    for i in data:
      src_outs, k = static.get(refs.producer(i)) or (), refs.output(i, by_name.get(refs.producer(i)))
      read += (src_outs[k][1] or 0) if k is not None and k < len(src_outs) else 0
    if held > LIMIT_BYTES and held > read:
      found.append(nd)
      constant[nd.name] = False
  return found, static


def _make_opaque(container, refs):
  """Route every data input of each generator among the NodeDefs of `container` (a repeated field) through an
  opaque PlaceholderWithDefault appended to it; returns how many."""
  nodes = list(container)
  generators, static = _generators(nodes, refs)
  by_name = {nd.name: nd for nd in nodes}
  names = set(by_name)
  count = 0
  for nd in generators:
    dtypes = _input_dtypes(nd)
    if dtypes is None:
      continue
    k = 0
    for pos, i in enumerate(nd.input):
      if is_control(i):
        continue
      name = f"{nd.name}/opaque_{k}"
      while name in names:
        name += "_"
      names.add(name)
      pwd = container.add(name=name, op=PWD, input=[i])
      pwd.attr["dtype"].type = dtypes[k]
      src_outs = static.get(refs.producer(i))
      src = by_name.get(refs.producer(i))
      j = refs.output(i, src) if src is not None else None
      if src_outs and j is not None and j < len(src_outs):
        pwd.attr["shape"].shape.CopyFrom(src_outs[j][0])
      else:
        pwd.attr["shape"].shape.unknown_rank = True
      pwd.attr[OPAQUE_ATTR].b = True
      nd.input[pos] = refs.of(name)
      k += 1
      count += 1
  return count


def _bypass(container, refs, ret):
  """Remove the opaque nodes of `container`, their readers (and `ret`, a function's results) reading their input."""
  opaque = {nd.name: nd.input[0] for nd in container if nd.op == PWD and OPAQUE_ATTR in nd.attr and nd.input}
  if not opaque:
    return
  for nd in container:
    inputs = []
    for i in nd.input:
      name = i[1:] if is_control(i) else refs.producer(i)
      if name in opaque and is_control(i):
        i = "^" + refs.producer(opaque[name])
      elif name in opaque and refs.reads(i, name):
        i = opaque[name]
      inputs.append(i)
    if inputs != list(nd.input):
      del nd.input[:]
      nd.input.extend(dedupe_controls(inputs))
  if ret is not None:
    for key, r in ret.items():
      name = refs.producer(r)
      if name in opaque and refs.reads(r, name):
        ret[key] = opaque[name]
  kept = [nd for nd in container if nd.name not in opaque]
  del container[:]
  container.extend(kept)
