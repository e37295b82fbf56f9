"""The compile pass: XLA compilation of the per-device program, by backend.

* GPU: the per-device program is cut into XLA *clusters*, each compiled (`_XlaMustCompile`) and called from the
  program. A summing or multiplying all-reduce among GPUs that are each a physical GPU (hint "nccl", set by the
  collectives builder) runs inside a cluster, as XLA's own all-reduce; tf2xla takes one (group key, group size)
  configuration of CollectiveReduceV2 per cluster, so a cluster holds the all-reduces of one group only. Other
  collectives (gathers, all-to-alls, permutes, max/min all-reduces, every collective among logical GPUs that share
  a physical one) run between clusters. A program that is one cluster with nothing outside is compiled whole.
* TPU: the per-device program runs under `TPUStrategy.run`, where XLA compiles it whole; every op is checked.
* CPU: XLA on CPU refuses collectives, so every collective runs between clusters (`jit_compile=True`).
  `jit_compile="segments"` keeps every collective between clusters on GPUs too.

Clusters are grown one after another (`_clusters`): a cluster takes every compilable op whose inputs are ready (made
by earlier clusters, by ops already run between clusters, or by the cluster itself), except an all-reduce of
another configuration than the cluster's; of the configurations ready to start a cluster, the one that grows it
most is taken. The ops between clusters run when their inputs are ready. Every path that leaves a cluster
therefore enters only later ones, and the cut is acyclic. On a Megatron step the per-layer all-reduces of the
model axis fall into one cluster with all the compute, and the data axis's gradient all-reduces, ready only when
nothing of the model axis's is left, into a second with the update (docs/hardware.md argues the bound). Constants
are copied into every cluster that reads them (XLA wants shapes and axes as compile-time constants). Clusters that
compute the same (the same ops, attributes, constants and wiring once nodes are named by position -- layer l's
attention block and layer l+1's) call one function, so XLA compiles it once per input signature.

`jit_compile="auto"` compiles on GPU and TPU and leaves CPU programs to TF's executor, which the runtime
benchmark (bench/runtime.py) measures as faster for CPU programs cut by many collectives; `True` compiles
on every backend.
"""

import collections
import heapq
import itertools

import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.errors import UnsupportedOpError
from tf_gspmd.rewriter.collectives import shapes, vocabulary
from tf_gspmd.rewriter.frontend.trace import CHECK_OPS
from tf_gspmd.rewriter.graph.graph_view import (GraphView, dedupe_controls, is_control, is_stateful, node_def, node_of,
                                          normalize)

# Ops XLA has no kernel for (TF's tf2xla registry), or that must stay outside a compiled cluster; a collective
# runs in one only where `in_xla` says so.
UNCOMPILABLE = frozenset({
    "Placeholder", "NoOp", "VarHandleOp", "While", "StatelessWhile", "If", "StatelessIf", "PartitionedCall",
    "StatefulPartitionedCall", "StringFormat", "ResourceScatterNdUpdate", "UnsortedSegmentProd",
}) | CHECK_OPS   # (checks and prints: XLA would drop them)
MIN_SEGMENT_OPS = {"CPU": 2, "GPU": 1}   # smaller clusters run in TF's executor (on GPUs every op is compiled)
MODES = ("auto", True, False, "segments")
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


def in_xla(node):
  """Whether collective NodeDef `node` runs inside an XLA cluster: tf2xla lowers it, and it is among GPUs that
  NCCL serves (hint "nccl": XLA's all-reduce is NCCL's). XLA on CPU refuses collectives."""
  return vocabulary.lowered_by_xla(node) and node.attr["communication_hint"].s == b"nccl"


def _compilable(node, collectives_in_xla=True):
  if node.op in vocabulary.TF_COLLECTIVE_OPS:
    return collectives_in_xla and in_xla(node)
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


def segment(graph_def, keep, backend="CPU", collectives_in_xla=False, partition_id=None, variables=None):
  """The per-device GraphDef with its compilable ops grouped into `_XlaMustCompile` functions (clusters).

  Args:
    graph_def: the per-device program (with its function library).
    keep: names of nodes that must stay in the outer program (its inputs and outputs).
    backend: "CPU" or "GPU" (the smallest cluster compiled, MIN_SEGMENT_OPS).
    collectives_in_xla: collectives `in_xla` go into clusters (GPU).
    partition_id: its partition-id Placeholder: what is computed from it and constants alone (a collective's
      group key) is copied into every cluster that reads it, as constants are.
    variables: {variable handle Placeholder: (shard shape, dtype)}, for the clusters' arguments' static shapes.
  Returns:
    (new GraphDef, {old node name: call node name} for the nodes moved into clusters).
  """
  view = GraphView(graph_def)
  full = tf.Graph()
  with full.as_default():
    tf.graph_util.import_graph_def(shapes.for_shapes(graph_def, variables or {}), name="")
  order = view.order()
  fixed = per_device_constants(order, partition_id)
  groups = dict(enumerate(_clusters(view, order, keep, fixed, collectives_in_xla, MIN_SEGMENT_OPS[backend])))
  if not groups:
    return graph_def, {}
  out = tf.compat.v1.GraphDef()
  out.versions.CopyFrom(graph_def.versions)
  out.library.CopyFrom(graph_def.library)
  calls, moved = _segment_functions(out, groups, view, full, fixed)
  _emit_outer_program(out, order, groups, calls, moved)
  return out, moved


def per_device_constants(order, partition_id):
  """Names of the nodes computed from constants and the partition id alone (a row of a per-device table): each
  device's value is fixed; a cluster computes its own copy instead of taking it as an argument."""
  fixed = set()
  kinds = {n.name: n.op for n in order}
  for n in order:
    # A constant that waits for a stateful op, by a control input, runs after it: not fixed. The control inputs
    # constant folding leaves on a folded value, from the stateless ops it replaced, order nothing.
    constant = n.op == "Const" and not any(is_stateful(kinds.get(node_of(i), "NoOp")) for i in n.input)
    picked = (n.op in ("GatherV2", "Identity", "Reshape", "StridedSlice", "Squeeze") and n.input and
              not any(is_control(i) for i in n.input) and
              all(node_of(i) in fixed or node_of(i) == partition_id for i in n.input))
    if constant or picked:
      fixed.add(n.name)
  return fixed


def configuration(view, node):
  """A collective's (group size, group key) configuration, as values: each input's constant value, or the ops and
  constants that compute it from the partition id (two all-reduces over one mesh axis read equal tables)."""
  memo = {}

  def value(ref):
    name = node_of(ref)
    if name not in memo:
      n = view.node(name)
      if n.op == "Const":
        memo[name] = ("Const", n.attr["value"].SerializeToString(deterministic=True))
      elif n.op == "Placeholder":
        memo[name] = ("Placeholder", name)
      else:
        memo[name] = (n.op, tuple(value(i) for i in n.input if not is_control(i)))
    return memo[name]

  return value(node.input[1]), value(node.input[2])


def _clusters(view, order, keep, fixed, collectives_in_xla, min_ops):
  """The clusters, in the order they run: lists of `order`'s nodes (a topological order) in that order (see the
  module docstring); a cluster smaller than `min_ops` ops runs in TF's executor instead. `fixed`: the per-device
  constants, which every cluster has."""
  by_name = {n.name: n for n in order}
  const = fixed
  inside = {n.name: n.name not in const and n.name not in keep and _compilable(n, collectives_in_xla)
            for n in order}
  config = {n.name: configuration(view, n) for n in order
            if inside[n.name] and n.op in vocabulary.TF_COLLECTIVE_OPS}
  position = {n.name: k for k, n in enumerate(order)}
  succs = collections.defaultdict(list)
  missing = {}
  for n in order:
    preds = {node_of(i) for i in n.input} - const
    missing[n.name] = len(preds)
    for p in preds:
      succs[p].append(n.name)
  ready_in, ready_out = [], collections.deque()
  placed = set()

  def done(name):
    placed.add(name)
    for s in succs[name]:
      missing[s] -= 1
      if missing[s] == 0 and s not in const and s not in placed:
        if inside[s]:
          heapq.heappush(ready_in, (position[s], s))
        else:
          ready_out.append(s)

  for n in order:
    if missing[n.name] == 0 and n.name not in const:   # the program's inputs, ops of constants only
      if inside[n.name]:
        heapq.heappush(ready_in, (position[n.name], n.name))
      else:
        ready_out.append(n.name)

  def grow(first, cfg):
    """The cluster grown from the ready ops `first` with configuration `cfg` (None: the first all-reduce's)."""
    heap, taken, members, left = list(first), set(), [], {}
    while heap:
      _, name = heapq.heappop(heap)
      if name in taken:
        continue
      if name in config:
        if cfg is None:
          cfg = config[name]
        elif config[name] != cfg:
          continue
      taken.add(name)
      members.append(name)
      for s in succs[name]:
        left[s] = left.get(s, missing[s]) - 1
        if left[s] == 0 and inside.get(s):
          heapq.heappush(heap, (position[s], s))
    return members

  clusters = []
  while True:
    while ready_out:
      done(ready_out.popleft())
    if not ready_in:
      break
    first = sorted(set(ready_in))
    starts = [None] + sorted({config[n] for _, n in first if n in config}, key=repr)
    members = max((grow(first, cfg) for cfg in starts), key=len)
    placed.update(members)
    ready_in = [(p, n) for p, n in first if n not in placed]
    heapq.heapify(ready_in)
    for name in members:
      done(name)
    if len(members) >= min_ops:
      clusters.append([by_name[n] for n in sorted(members, key=position.get)])
  return clusters


def _segment_functions(out, groups, view, full, fixed):
  """Adds each segment's function to `out`'s library, one per distinct body.

  Returns ({segment number: (its call NodeDef, its output refs)}, {old node name: call node name}).
  """
  moved = {}
  calls = {}
  shared = {}   # the canonical form of a segment's body -> the function computing it
  for k, group in sorted(groups.items()):
    fdef, call, outputs = _build_segment(k, group, view, full, fixed)
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


def _segment_inputs(group, view, fixed):
  """What segment `group` reads from outside: (its arguments (tensor refs), its control inputs, the per-device
  constants it copies, in an order that has each after the ones it reads)."""
  names = {n.name for n in group}
  ext_inputs, ext_controls, copies = [], [], []

  def read(i):   # the source of input `i` of a segment node: inside, a copy, or an argument
    src = node_of(i)
    if src in names or src in copies:
      return
    if src in fixed:   # (copied without its control inputs, see per_device_constants)
      for j in view.node(src).input:
        if not is_control(j):
          read(j)
      copies.append(src)
    elif is_control(i):
      if i not in ext_controls:
        ext_controls.append(i)
    elif normalize(i) not in ext_inputs:
      ext_inputs.append(normalize(i))

  for n in group:
    for i in n.input:
      read(i)
  return ext_inputs, ext_controls, copies


def _build_segment(k, group, view, full, fixed):
  """FunctionDef for segment k, the call NodeDef (inputs still in old names), and its output refs. `fixed`: the
  per-device constants (`per_device_constants`), copied into the segment where it reads them."""
  graph_def = view.graph_def
  names = {n.name for n in group}
  ext_inputs, ext_controls, copies = _segment_inputs(group, view, fixed)
  outputs = [t.name for n in group for t in full.get_operation_by_name(n.name).outputs
             if any(c.name not in names for c, _ in view.consumers(t.name))]
  # The segment as a graph: external inputs become placeholders (of their static shapes, where known).
  g = tf.Graph()
  sub = tf.compat.v1.GraphDef()
  sub.versions.CopyFrom(graph_def.versions)
  arg_names = {}
  for j, r in enumerate(ext_inputs):
    t = full.get_tensor_by_name(r)
    attrs = {"dtype": tf.compat.v1.AttrValue(type=t.dtype.as_datatype_enum)}
    sub.node.add().CopyFrom(node_def(f"gspmd_arg_{j}", "Placeholder", attrs=attrs))
    arg_names[r] = f"gspmd_arg_{j}:0"
  for c in copies:   # without the control inputs the original may carry
    node = sub.node.add()
    node.CopyFrom(view.node(c))
    node.ClearField("input")
    node.input.extend(arg_names.get(normalize(i), i) for i in view.node(c).input if not is_control(i))
    node.ClearField("device")
  for n in group:
    node = sub.node.add()
    node.CopyFrom(n)
    node.ClearField("input")
    for i in n.input:
      src = node_of(i)
      if is_control(i):
        if src in names:
          node.input.append(i)
      elif src in names or src in copies:
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
  ops = [g.get_operation_by_name(n.name) for n in group] + [g.get_operation_by_name(c) for c in copies]
  inputs = [g.get_tensor_by_name(arg_names[r]) for r in ext_inputs]
  outs = [g.get_tensor_by_name(r) for r in outputs]
  fname = f"gspmd_xla_segment_{k}_{next(_function_ids)}"   # unique in the process (the eager context's library)
  fdef = _compat.graph_to_function_def(
      g, ops + [t.op for t in inputs], inputs, outs, out_names=[f"out_{j}" for j in range(len(outs))])
  fdef.signature.name = fname
  fdef.attr["_XlaMustCompile"].b = True
  fdef.attr["_noinline"].b = True
  # what the arguments' static shapes are known to be (for readers of the function)
  fdef.attr["_input_shapes"].list.shape.extend(full.get_tensor_by_name(r).shape.as_proto() for r in ext_inputs)
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
  """Pass: check (TPU) or cut into XLA clusters (CPU, GPU) the per-device program, per `Options.jit_compile`."""
  backend = backend_of(program)
  option = program.options.jit_compile
  if not wants_jit(option, backend):
    return program.replace(jit=None)
  if backend == "TPU":
    check_whole_program(program.local_graph_def, backend)
    return program.replace(jit="whole")
  gpu = backend == "GPU" and option != "segments"
  if gpu and _one_cluster(program.local_graph_def):
    return program.replace(jit="whole")
  keep = set(program.local_inputs) | set(program.local_variables) | set(program.local_outputs) | {program.partition_id}
  variables = {ph: (s.with_rank(len(v.shape)).shard_shape(tuple(v.shape)), v.dtype)
               for ph, v, s in zip(program.local_variables, program.variables, program.variable_shardings)
               if v is not None}
  gd, moved = segment(program.local_graph_def, keep, "GPU" if backend == "GPU" else "CPU", collectives_in_xla=gpu,
                      partition_id=program.partition_id, variables=variables)
  side = []
  for name in program.side_effects:
    call = moved.get(name, name)
    if call not in side:
      side.append(call)
  return program.replace(local_graph_def=gd, side_effects=tuple(side), jit="segments")


def _one_cluster(graph_def):
  """Whether XLA compiles the whole per-device program on GPUs: every op compiles (collectives inside XLA), and its
  all-reduces share one configuration."""
  view = GraphView(graph_def)
  configs = set()
  for node in graph_def.node:
    if node.op in ("Placeholder", "Const"):
      continue
    if not _compilable(node):
      return False
    if node.op in vocabulary.TF_COLLECTIVE_OPS:
      configs.add(configuration(view, node))
  return len(configs) <= 1
