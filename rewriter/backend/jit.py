"""The compile pass: XLA compilation of the per-device program, by backend.

* GPU: the whole per-device program is compiled (`jit_compile=True` on the imported function) when XLA lowers
  all of its collectives (TF's tf2xla lowers only summing or multiplying CollectiveReduceV2); this pass checks
  that every op is one XLA can compile. A program with other collectives (max/min all-reduce, all-gather,
  all-to-all, collective-permute) is cut into segments, as on CPU.
* TPU: the per-device program runs under `TPUStrategy.run`, where XLA compiles it whole; same check.
* CPU: XLA on CPU refuses collectives, so the program is cut into *segments* — maximal groups of compilable
  ops between collectives — and each segment becomes a function marked `_XlaMustCompile`, called from the
  (uncompiled) per-device program. Segments are numbered by the number of uncompilable ops (collectives,
  parameters) on the longest path that reaches them; a path that leaves a segment passes an uncompilable
  op and so enters a later segment, which keeps the cut acyclic. Constants are copied into every segment
  that reads them (XLA wants shapes and axes as compile-time constants). Segments that compute the same (the
  same ops, attributes, constants and wiring once nodes are named by position -- layer l's attention block and
  layer l+1's) call one function, so XLA compiles it once per input signature: a 12-layer transformer's 50
  segments per device are 8 functions.

`jit_compile="auto"` compiles on GPU and TPU and leaves CPU programs to TF's executor, which the runtime
benchmark (bench/runtime.py) measures as faster for CPU programs cut by many collectives; `True` compiles
on every backend.
"""

import collections
import itertools

import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.errors import UnsupportedOpError
from tf_gspmd.rewriter.collectives import vocabulary
from tf_gspmd.rewriter.graph.graph_view import (GraphView, dedupe_controls, is_control, is_stateful, node_def, node_of,
                                          normalize)

# Ops XLA has no kernel for (TF's tf2xla registry), or that must stay outside a compiled segment on CPU
# (every collective: XLA on CPU refuses them).
UNCOMPILABLE = vocabulary.TF_COLLECTIVE_OPS | frozenset({
    "Placeholder", "NoOp", "VarHandleOp", "While", "StatelessWhile", "If", "StatelessIf", "PartitionedCall",
    "StatefulPartitionedCall", "PrintV2", "StringFormat", "Assert", "CheckNumerics", "CheckNumericsV2",
    "ResourceScatterNdUpdate", "UnsortedSegmentProd",
})
MIN_SEGMENT_OPS = 2
_function_ids = itertools.count()


def backend_of(program):
  """"CPU", "GPU" or "TPU": the type of the mesh's devices (those it names when planning without them; else CPU)."""
  devices = program.devices or program.mesh.devices
  if not devices:
    return "CPU"
  return (tf.DeviceSpec.from_string(devices[0]).device_type or "CPU").upper()


def wants_jit(option, backend):
  if option == "auto":
    return backend in ("GPU", "TPU")
  return bool(option)


def _compilable(node):
  if node.op in UNCOMPILABLE:
    return False
  for key in ("T", "dtype", "Tparams", "DstT", "SrcT"):
    if key in node.attr and node.attr[key].type == tf.string.as_datatype_enum:
      return False
  return True


def check_whole_program(graph_def, backend):
  """Raises UnsupportedOpError naming the first op a whole-program XLA compilation on `backend` would refuse."""
  for node in graph_def.node:
    if vocabulary.lowered_by_xla(node) or node.op == "Placeholder":
      continue
    if not _compilable(node):
      raise UnsupportedOpError(f"op type {node.op} cannot be compiled by XLA on {backend}; run with "
                               "jit_compile=False or avoid this op", node=node.name, op_type=node.op)


def segment(graph_def, keep):
  """The per-device GraphDef with its compilable ops grouped into `_XlaMustCompile` functions.

  Args:
    graph_def: the per-device program (with its function library).
    keep: names of nodes that must stay in the outer program (its inputs and outputs).
  Returns:
    (new GraphDef, {old node name: call node name} for the nodes moved into segments).
  """
  view = GraphView(graph_def)
  nodes = list(graph_def.node)
  full = tf.Graph()
  with full.as_default():
    tf.graph_util.import_graph_def(graph_def, name="")
  order = view.order()
  groups = _segment_groups(nodes, order, keep)
  if not groups:
    return graph_def, {}
  out = tf.compat.v1.GraphDef()
  out.versions.CopyFrom(graph_def.versions)
  out.library.CopyFrom(graph_def.library)
  calls, moved = _segment_functions(out, groups, view, full)
  _emit_outer_program(out, order, groups, calls, moved)
  return out, moved


def _segment_groups(nodes, order, keep):
  """The segments: {segment number: its nodes in topological order}, each of at least MIN_SEGMENT_OPS ops.

  A node's number is the number of uncompilable ops (collectives, parameters) on the longest path reaching it.
  """
  is_const = {n.name: n.op == "Const" for n in nodes}
  inside = {n.name: _compilable(n) and not is_const[n.name] and n.name not in keep for n in nodes}
  phase = {}
  for n in order:
    p = 0
    for i in n.input:
      src = node_of(i)
      step = 0 if inside[src] or is_const[src] else 1
      p = max(p, phase[src] + step)
    phase[n.name] = p
  groups = collections.defaultdict(list)
  for n in order:
    if inside[n.name]:
      groups[phase[n.name]].append(n)
  return {k: g for k, g in groups.items() if len(g) >= MIN_SEGMENT_OPS}


def _segment_functions(out, groups, view, full):
  """Adds each segment's function to `out`'s library, one per distinct body.

  Returns ({segment number: (its call NodeDef, its output refs)}, {old node name: call node name}).
  """
  moved = {}
  calls = {}
  shared = {}   # the canonical form of a segment's body -> the function computing it
  for k, group in sorted(groups.items()):
    fdef, call, outputs = _build_segment(k, group, view, full)
    # A layer's segment repeats another layer's: one function, compiled once (not one with state, whose op kernels
    # -- a random generator's -- a shared function would share).
    body = None if fdef.signature.is_stateful else _canonical(fdef)
    if body in shared:
      call.attr["f"].func.name = shared[body]
    else:
      if body is not None:
        shared[body] = fdef.signature.name
      out.library.function.add().CopyFrom(fdef)
    calls[k] = (call, outputs)
    for n in group:
      moved[n.name] = call.name
  return calls, moved


def _emit_outer_program(out, order, groups, calls, moved):
  """Adds the outer program's nodes to `out`: untouched nodes (inputs rewired to segment outputs) and one call node
  per segment, where its first member was."""
  member = {n.name: k for k, g in groups.items() for n in g}
  remap = {}
  for k, (call, outputs) in calls.items():
    for j, r in enumerate(outputs):
      remap[r] = f"{call.name}:{j}"

  def rewire(inp):
    if is_control(inp):
      src = inp[1:]
      return "^" + moved.get(src, src)
    return remap.get(normalize(inp), inp)

  emitted = set()
  for n in order:
    if n.name in member:
      k = member[n.name]
      if k not in emitted:
        emitted.add(k)
        call = calls[k][0]
        new = out.node.add()
        new.CopyFrom(call)
        new.ClearField("input")
        new.input.extend(dedupe_controls([rewire(i) for i in call.input]))
      continue
    new = out.node.add()
    new.CopyFrom(n)
    new.ClearField("input")
    new.input.extend(dedupe_controls([rewire(i) for i in n.input]))


def _canonical(fdef):
  """`fdef` as bytes that equal another's exactly when the two compute the same: its nodes renamed by position
  (arguments arg<j>, nodes n<k>), attributes kept except the "_" ones TF adds (names, shapes it inferred)."""
  names = {a.name: f"arg{j}" for j, a in enumerate(fdef.signature.input_arg)}
  names.update({n.name: f"n{k}" for k, n in enumerate(fdef.node_def)})

  def renamed(i):
    control = is_control(i)
    head, colon, rest = (i[1:] if control else i).partition(":")
    return ("^" if control else "") + names.get(head, head) + colon + rest

  sig = type(fdef.signature)()
  sig.CopyFrom(fdef.signature)
  sig.name = ""
  for a in list(sig.input_arg) + list(sig.output_arg):
    a.name = ""
  parts = [sig.SerializeToString(deterministic=True)]
  for n in fdef.node_def:
    c = tf.compat.v1.NodeDef(name=names[n.name], op=n.op, input=[renamed(i) for i in n.input])
    for key, value in n.attr.items():
      if not key.startswith("_"):
        c.attr[key].CopyFrom(value)
    parts.append(c.SerializeToString(deterministic=True))
  rets = [renamed(fdef.ret[a.name]) for a in fdef.signature.output_arg]
  controls = sorted(renamed(v) for v in fdef.control_ret.values())
  return b"\0".join(parts) + repr((rets, controls)).encode()


def _build_segment(k, group, view, full):
  """FunctionDef for segment k, the call NodeDef (inputs still in old names), and its output refs."""
  graph_def = view.graph_def
  names = {n.name for n in group}
  ext_inputs, ext_controls, consts = [], [], []
  for n in group:
    for i in n.input:
      src = node_of(i)
      if src in names:
        continue
      if view.node(src).op == "Const":
        if src not in consts:
          consts.append(src)
        continue
      if is_control(i):
        if i not in ext_controls:
          ext_controls.append(i)
      elif normalize(i) not in ext_inputs:
        ext_inputs.append(normalize(i))
  outputs = [t.name for n in group for t in full.get_operation_by_name(n.name).outputs
             if any(c.name not in names for c, _ in view.consumers(t.name))]
  # The segment as a graph: external inputs become placeholders.
  g = tf.Graph()
  sub = tf.compat.v1.GraphDef()
  sub.versions.CopyFrom(graph_def.versions)
  arg_names = {}
  for j, r in enumerate(ext_inputs):
    dtype = tf.compat.v1.AttrValue(type=full.get_tensor_by_name(r).dtype.as_datatype_enum)
    sub.node.add().CopyFrom(node_def(f"gspmd_arg_{j}", "Placeholder", attrs={"dtype": dtype}))
    arg_names[r] = f"gspmd_arg_{j}:0"
  for c in consts:   # a copy, without the control inputs the original may carry
    node = sub.node.add()
    node.CopyFrom(view.node(c))
    node.ClearField("input")
  for n in group:
    node = sub.node.add()
    node.CopyFrom(n)
    node.ClearField("input")
    for i in n.input:
      src = node_of(i)
      if is_control(i):
        if src in names:
          node.input.append(i)
      elif src in names or src in consts:
        node.input.append(i)
      else:
        node.input.append(arg_names[normalize(i)])
    for key in list(node.attr):
      if key.startswith("_") and key not in ("_output_shapes",):
        del node.attr[key]
    node.ClearField("device")
  sub.library.CopyFrom(graph_def.library)
  with g.as_default():
    tf.graph_util.import_graph_def(sub, name="")
  ops = [g.get_operation_by_name(n.name) for n in group] + [g.get_operation_by_name(c) for c in consts]
  inputs = [g.get_tensor_by_name(arg_names[r]) for r in ext_inputs]
  outs = [g.get_tensor_by_name(r) for r in outputs]
  fname = f"gspmd_xla_segment_{k}_{next(_function_ids)}"   # unique in the process (the eager context's library)
  fdef = _compat.graph_to_function_def(
      g, ops + [t.op for t in inputs], inputs, outs, out_names=[f"out_{j}" for j in range(len(outs))])
  fdef.signature.name = fname
  fdef.attr["_XlaMustCompile"].b = True
  fdef.attr["_noinline"].b = True
  fdef.signature.is_stateful = any(is_stateful(op.type) for op in ops)
  for op in ops:
    if not op.outputs and is_stateful(op.type):
      fdef.signature.control_output.append(op.name)
      fdef.control_ret[op.name] = op.name
  attr = tf.compat.v1.AttrValue
  types = lambda ts: attr(list=attr.ListValue(type=[t.dtype.as_datatype_enum for t in ts]))  # noqa: E731
  call = node_def(f"gspmd/xla_segment_{k}", "StatefulPartitionedCall", ext_inputs + ext_controls, {
      "Tin": types(inputs), "Tout": types(outs), "f": attr(func=tf.compat.v1.NameAttrList(name=fname)),
      "_XlaMustCompile": attr(b=True), "config_proto": attr(s=b""), "executor_type": attr(s=b""),
      "config": attr(s=b"")})
  return fdef, call, outputs


def run(program):
  """Pass: check (GPU, TPU) or segment (CPU; GPU with collectives XLA does not lower) the per-device program for
  XLA, per `Options.jit_compile`."""
  backend = backend_of(program)
  if not wants_jit(program.options.jit_compile, backend):
    return program.replace(jit=None)
  unlowered = [n for n in program.local_graph_def.node
               if n.op in vocabulary.TF_COLLECTIVE_OPS and not vocabulary.lowered_by_xla(n)]
  if backend == "TPU" or (backend == "GPU" and not unlowered):
    check_whole_program(program.local_graph_def, backend)
    return program.replace(jit="whole")
  keep = set(program.local_inputs) | set(program.local_variables) | set(program.local_outputs) | {program.partition_id}
  gd, moved = segment(program.local_graph_def, keep)
  side = []
  for name in program.side_effects:
    call = moved.get(name, name)
    if call not in side:
      side.append(call)
  return program.replace(local_graph_def=gd, side_effects=tuple(side), jit="segments")
