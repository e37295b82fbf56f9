"""In-process pass: on CPU devices of one process, the per-device programs become one graph.

Every mesh device runs the same per-device program; TF's collective executor joins their collectives. On
logical CPUs of one process that costs more than the data it moves: a small all-reduce over 4 logical CPUs
takes ~400 us beyond its arithmetic (ring steps, callbacks, thread wake-ups), and a transformer step runs
dozens. The devices share the host's memory and cores, so this pass instead copies the per-device program once
per device into one GraphDef (node `d<p>/<name>`, the partition id a constant) and replaces each collective by
the ordinary ops that compute its result from the members' tensors:

  * all-reduce: the group's first member (runtime rank order) merges every member's operand (AddN for a sum;
    Mul/Maximum/Minimum in rank order); the others read its result, so every member holds the same bits;
  * all-gather: every member's operand concatenated along dim 0 in rank order;
  * all-to-all: block r of every member's operand (dim 0 cut into group-size blocks) to the member of rank r;
  * collective-permute (broadcast send/receive pairs): the receiver reads what its sender sends.

Then:

  * placement: what touches a device's variables (their reads, writes and the handles) runs on that device;
    everything else on the first mesh device. A logical CPU is a label on the same cores, and one executor
    needs no send/receive pair for each edge between devices; XLA segments then compile once for the mesh
    (TF keeps an XLA cache per device);
  * deduplication: copies of an argument that hold the same tile are read from the first device holding it (a
    replicated argument is the same everywhere), and a stateless node that repeats an earlier one (same op,
    attributes and inputs) is left out and its uses read the earlier one. What the devices compute alike -- a
    replicated weight's update, the layer norm of an all-reduced activation -- runs once.

These are the semantics of TF's ops as the partitioner uses them; the per-device program, its report and the
bytes it counts are unchanged (`program.in_process` is another way to run them). Nothing can hang: there are no
collectives left to wait for. The runtime calls the graph once per step with every device's arguments; a
result's per-device tensors may live in the first device's memory (the host's, as for every logical CPU).

The pass leaves the program alone (`in_process` None: TF's collectives run) when the mesh spans processes or
non-CPU devices, when devices are not known (plan mode), when a collective sits inside a function body, or when
the caller chose `exchange="collectives"`.
"""

import dataclasses
from typing import Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd import _compat
from tf_gspmd.rewriter import collectives
from tf_gspmd.rewriter import graph_view
from tf_gspmd.rewriter.graph_view import prune

_MERGE = {b"Add": "AddN", b"Mul": "Mul", b"Max": "Maximum", b"Min": "Minimum"}
_KINDS = frozenset({"CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2", "CollectiveBcastSendV2",
                    "CollectiveBcastRecvV2"})


@dataclasses.dataclass(frozen=True)
class InProcess:
  """The multi-device graph of one step: `inputs` and `outputs` are tensor names, argument-major (argument k of
  device p at k * devices + p); `side_effects` op names of every device's side effects."""
  graph_def: tf.compat.v1.GraphDef
  inputs: Tuple[str, ...]
  outputs: Tuple[str, ...]
  side_effects: Tuple[str, ...]


def _one_process_of_cpus(program):
  return program.options.exchange == "auto" and program.processes is None and program.on_cpus


def applies(program):
  """Whether the program's collectives can run as in-process edges (see the module docstring)."""
  if not _one_process_of_cpus(program) or program.jit == "whole" or program.collective_keys is None:
    return False
  gd = program.local_graph_def
  if any(n.op in collectives.TF_COLLECTIVE_OPS for f in gd.library.function for n in f.node_def):
    return False
  return all(n.op in _KINDS and n.name in program.collective_keys[0] and (
      n.op != "CollectiveReduceV2" or (n.attr["merge_op"].s in _MERGE and n.attr["final_op"].s == b"Id"))
             for n in gd.node if n.op in collectives.TF_COLLECTIVE_OPS)


def keys(program):
  """Pass (before XLA segments can hide them): program.collective_keys, per device {collective op name: (group
  key, instance key)}, evaluated from the per-device program's tables at each partition id."""
  if not _one_process_of_cpus(program):
    return program
  colls = [c for c in program.local_graph_def.node if c.op in collectives.TF_COLLECTIVE_OPS]
  return program.replace(collective_keys=_keys(program, colls) if colls else [{}] * len(program.devices))


def run(program):
  """Pass: program.in_process, the per-device programs of every mesh device as one graph without collectives."""
  if not applies(program):
    return program
  return program.replace(in_process=_build(program))


def _keys(program, colls):
  """Per device: {collective node name: (group key, instance key)}, evaluated from the program's tables."""
  gd = program.local_graph_def
  fetch = []
  for c in colls:
    args = [a.name for a in _compat.op_def(c.op).input_arg]
    fetch += [graph_view.normalize(c.input[args.index(k)]) for k in ("group_key", "instance_key")]
  sub = prune(gd, sorted({t.split(":")[0] for t in fetch}))
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(sub, name="")
  pid = graph_view.normalize(program.partition_id)
  reads_pid = any(n.name == program.partition_id for n in sub.node)
  per_device = []
  with tf.compat.v1.Session(graph=graph) as sess:
    for p in range(len(program.devices)):
      values = sess.run(fetch, {pid: np.int32(p)} if reads_pid else None)
      per_device.append({c.name: (int(values[2 * k]), int(values[2 * k + 1])) for k, c in enumerate(colls)})
  return per_device


def _build(program):
  gd = program.local_graph_def
  devices = program.devices
  n = len(devices)
  position = {tf.DeviceSpec.from_string(d).to_string(): p for p, d in enumerate(devices)}
  colls = [c for c in gd.node if c.op in collectives.TF_COLLECTIVE_OPS]
  keys = program.collective_keys

  def members(group_key):
    """The group's mesh positions in runtime rank order (the order TF's collectives use)."""
    names = sorted(collectives.group_members(group_key), key=collectives.rank_key)
    return [position[tf.DeviceSpec.from_string(d).to_string()] for d in names]

  def ref(p, name):
    return f"^d{p}/{name[1:]}" if name.startswith("^") else f"d{p}/{name}"

  # instance key -> its send node (one instance key per op, the same on every device)
  senders = {keys[0][c.name][1]: c.name for c in colls if c.op == "CollectiveBcastSendV2"}

  out = tf.compat.v1.GraphDef()
  out.versions.CopyFrom(gd.versions)
  out.library.CopyFrom(gd.library)

  def const(name, value, p):
    node = out.node.add()
    node.name, node.device = name, devices[p]
    _become_const(node, value)
    return name

  def become(node, op, inputs, dtype, **attrs):
    node.op = op
    node.ClearField("attr")
    node.attr["T"].CopyFrom(dtype)
    for k, v in attrs.items():   # an int, a tf.DType or an AttrValue
      if isinstance(v, tf.DType):
        node.attr[k].type = v.as_datatype_enum
      elif isinstance(v, int):
        node.attr[k].i = v
      else:
        node.attr[k].CopyFrom(v)
    del node.input[:]
    node.input.extend(inputs)

  handles = set(program.local_variables)   # variable handles, and identities of them
  for x in graph_view.GraphView(gd).order():
    if x.op in ("Identity", "IdentityN") and any(graph_view.node_of(i) in handles for i in x.input):
      handles.add(x.name)
  for p in range(n):
    for x in gd.node:
      node = out.node.add()
      node.CopyFrom(x)
      # What touches a device's variables runs on that device, everything else on the first (see the docstring).
      touches = x.name in handles or any(graph_view.node_of(i) in handles for i in x.input)
      node.name, node.device = f"d{p}/{x.name}", devices[p if touches else 0]
      del node.input[:]
      node.input.extend(ref(p, i) for i in x.input)
      if x.name == program.partition_id:
        _become_const(node, np.int32(p))
        continue
      if x.op not in collectives.TF_COLLECTIVE_OPS:
        continue
      group, instance = keys[p][x.name]
      control = [ref(p, i) for i in x.input if i.startswith("^")]
      dtype = x.attr["T"]
      # (runtime rank order; collectives.Backend emits none over a group of one)
      ranked = members(group) if x.op != "CollectiveBcastRecvV2" else None
      if x.op == "CollectiveReduceV2":
        if p != ranked[0]:
          become(node, "Identity", [ref(ranked[0], x.name)] + control, dtype)
        elif x.attr["merge_op"].s == b"Add":
          become(node, "AddN", [ref(q, x.input[0]) for q in ranked] + control, dtype, N=len(ranked))
        else:   # a chain of the binary merge in rank order
          acc = ref(ranked[0], x.input[0])
          for k, q in enumerate(ranked[1:-1]):
            step = out.node.add()
            step.name, step.device = f"{node.name}/merge_{k}", devices[p]
            become(step, _MERGE[x.attr["merge_op"].s], [acc, ref(q, x.input[0])], dtype)
            acc = step.name
          become(node, _MERGE[x.attr["merge_op"].s], [acc, ref(ranked[-1], x.input[0])] + control, dtype)
      elif x.op == "CollectiveGatherV2":
        become(node, "ConcatV2", [ref(q, x.input[0]) for q in ranked] + [const(f"{node.name}/axis", np.int32(0), p)]
               + control, dtype, N=len(ranked), Tidx=tf.int32)
      elif x.op == "CollectiveAllToAllV2":
        axis = const(f"{node.name}/axis", np.int32(0), p)
        blocks = []
        for q in ranked:
          split = out.node.add()
          split.name, split.device = f"{node.name}/blocks_of_{q}", devices[p]
          become(split, "Split", [axis, ref(q, x.input[0])], dtype, num_split=len(ranked))
          blocks.append(f"{split.name}:{ranked.index(p)}")
        become(node, "ConcatV2", blocks + [axis] + control, dtype, N=len(ranked), Tidx=tf.int32)
      elif x.op == "CollectiveBcastSendV2":
        become(node, "Identity", [ref(p, x.input[0])] + control, dtype)
      else:   # CollectiveBcastRecvV2: what the group's other member sends, in the shape this one expects
        sender = position[tf.DeviceSpec.from_string(collectives.group_members(group)[0]).to_string()]
        args = [a.name for a in _compat.op_def(x.op).input_arg]
        become(node, "Reshape", [ref(sender, senders[instance]), ref(p, x.input[args.index("shape")])] +
               control, dtype, Tshape=x.attr["Tshape"])
  graph, same = _deduplicated(out, _same_tiles(program, ref), {ref(p, h) for h in handles for p in range(n)})
  inputs = list(program.local_inputs) + list(program.local_variables)
  return InProcess(graph, tuple(ref(p, graph_view.normalize(t)) for t in inputs for p in range(n)),
                   tuple(_renamed(ref(p, graph_view.normalize(t)), same) for t in program.local_outputs
                         for p in range(n)),
                   tuple(ref(p, s) for s in program.side_effects for p in range(n)))


def _become_const(node, value):
  """Turn NodeDef `node` into a Const holding `value` (its name and device kept)."""
  value = np.asarray(value)
  node.op = "Const"
  node.ClearField("attr")
  del node.input[:]
  node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
  node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))


def _renamed(i, same):
  """Input string `i` with its node replaced by the node it equals under `same` (a left-out node's)."""
  name = graph_view.node_of(i)
  name = same.get(name, name)
  if graph_view.is_control(i):
    return f"^{name}"
  index = graph_view.split_ref(i)[1]
  return name if ":" not in i else f"{name}:{index}"


def _same_tiles(program, ref):
  """{argument Placeholder of device p: that of the first device holding the same tile}: equal tiles hold equal
  values (a replicated argument is the same on every device), so the copies can read one."""
  same = {}
  for name, sharding, spec in zip(program.local_inputs, program.param_shardings, program.arg_specs):
    rank = spec.shape.rank
    if sharding is None or sharding.is_maximal or rank is None:
      continue
    s = sharding.with_rank(rank)
    first = {}
    for p in range(len(program.devices)):
      q = first.setdefault(tuple(s.tile_index(p, d) for d in range(rank)), p)
      if q != p:
        same[ref(p, name)] = ref(q, name)
  return same


def _deduplicated(gd, same, keep):
  """(`gd` with every stateless node that repeats an earlier one -- same op, attributes and inputs once `same`
  maps node names to the nodes they equal -- left out, {left-out node: the node it equals}).

  The devices' copies of the program compute many values alike (a replicated weight's update, a layer norm of
  an all-reduced activation, every member of a group after an all-reduce); in one graph each runs once. Stateful
  ops (variable reads and writes, stateful calls) and the nodes in `keep` are never merged.
  """
  functions = {f.signature.name: f for f in gd.library.function}
  same = dict(same)
  seen, kept = {}, []
  for node in graph_view.GraphView(gd).order():
    new = tf.compat.v1.NodeDef()
    new.CopyFrom(node)
    del new.input[:]
    new.input.extend(graph_view.dedupe_controls([_renamed(i, same) for i in node.input]))
    called = functions.get(node.op) or (functions.get(node.attr["f"].func.name) if "f" in node.attr else None)
    stateful = called.signature.is_stateful if called is not None else graph_view.is_stateful(node.op)
    if stateful or node.op == "Placeholder" or node.name in keep or node.name in same:
      kept.append(new)
      continue
    if node.op == "Identity" and len(new.input) == 1 and graph_view.split_ref(new.input[0])[1] == 0 and \
        not graph_view.is_control(new.input[0]):   # (an all-reduce member reading the group's result)
      same[node.name] = graph_view.node_of(new.input[0])
      continue
    key = tf.compat.v1.NodeDef()
    key.CopyFrom(new)
    key.name, key.device = "", ""
    key = key.SerializeToString(deterministic=True)
    if key in seen:
      same[node.name] = seen[key]
    else:
      seen[key] = node.name
      kept.append(new)
  out = tf.compat.v1.GraphDef()
  out.versions.CopyFrom(gd.versions)
  out.library.CopyFrom(gd.library)
  out.node.extend(kept)
  return out, same
