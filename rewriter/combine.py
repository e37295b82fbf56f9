"""The combine pass: independent all-reduces over the same devices become one (XLA's all-reduce combiner).

A training step issues one all-reduce per gradient; each costs a rendezvous of every device, which on
CPUs and for small tensors costs more than the bytes. All-reduces that do not depend on each other and
share mesh axes, reduction and dtype are concatenated into one collective (built by the collectives
backend), then split back.

Independence: every all-reduce gets a *depth*, the largest number of all-reduces on a path from the
program's inputs to it (itself included). An all-reduce that depends on another has a larger depth, so
all-reduces of equal depth are independent, and combining within depths cannot create a cycle. Combined
collectives are capped at MAX_BYTES each. The report keeps the logical collectives and records each
combination (`report.combined`); the members are left without consumers for cleanup to remove.
"""

import collections

import tensorflow as tf

from tf_gspmd.rewriter.collectives import Backend
from tf_gspmd.rewriter.graph_view import GraphView, node_of, ref
from tf_gspmd.rewriter.partition import HELPER_SCOPE

MAX_BYTES = 32 << 20


def _depths(view, all_reduces):
  depth = {}
  for nd in view.order():
    d = max([depth[node_of(i)] for i in nd.input if node_of(i) in depth] + [0])
    depth[nd.name] = d + (1 if nd.name in all_reduces else 0)
  return depth


def combine(program):
  """(new GraphDef, {op name: Emitted} of its collectives, [(members, bytes)] per combined collective,
  {member op name: Emitted of the combined op carrying it})."""
  emitted = dict(program.collective_ops or {})
  reduces = {name: e for name, e in emitted.items() if e.kind == "all-reduce"}
  view = GraphView(program.local_graph_def)
  depth = _depths(view, reduces)
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(program.local_graph_def, name="")
  bins = collections.defaultdict(list)
  for name in sorted(reduces):
    op = graph.get_operation_by_name(name)
    if op.outputs[0].shape.is_fully_defined():
      e = reduces[name]
      bins[(depth[name], e.axes, e.reduction, op.inputs[0].dtype)].append(op)
  pid = graph.get_tensor_by_name(ref(program.partition_id))
  backend = Backend(program.mesh, program.devices, pid,
                    lambda table, name: tf.gather(tf.constant(table, name=name), pid), program.report,
                    program.processes)
  combined, rewires, carriers = [], [], {}
  for (_, axes, reduction, _), members in bins.items():
    chunk, size = [], 0
    for op in members + [None]:
      nbytes = 0 if op is None else op.outputs[0].shape.num_elements() * op.outputs[0].dtype.size
      if op is None or (chunk and size + nbytes > MAX_BYTES):
        if len(chunk) > 1:
          merged = _build(graph, backend, chunk, axes, reduction, len(combined), rewires)
          carriers.update((m.name, backend.emitted[merged.op.name]) for m in chunk)
          combined.append((len(chunk), size))
        chunk, size = [], 0
      if op is not None:
        chunk.append(op)
        size += nbytes
  out = GraphView(graph.as_graph_def())
  for old, new in rewires:
    out.rewire(old, new)
  emitted.update(backend.emitted)
  return out.graph_def, emitted, combined, carriers


def _build(graph, backend, members, axes, reduction, k, rewires):
  """The combined all-reduce of `members` in `graph` (returned); adds (old reference, new one) to `rewires`."""
  with graph.as_default(), tf.name_scope(f"combined_all_reduce_{k}{HELPER_SCOPE}"):
    controls = {c for m in members for c in m.control_inputs}
    with tf.control_dependencies(sorted(controls, key=lambda o: o.name)):
      flat = tf.concat([tf.reshape(m.inputs[0], [-1]) for m in members], 0)
      out = backend.all_reduce(flat, axes, reduction, members[0].name, "combined", record=False)
    parts = tf.split(out, [m.outputs[0].shape.num_elements() for m in members])
    for m, part in zip(members, parts):
      rewires.append((m.outputs[0].name, tf.reshape(part, m.outputs[0].shape).name))
      rewires.append(("^" + m.name, "^" + out.op.name))
    return out


def run(program):
  """Pass: combine independent all-reduces of the per-device program (dropped ones are pruned by cleanup)."""
  gd, emitted, combined, carriers = combine(program)
  program.report.combined.extend(combined)
  program.report.replace_ops(carriers)
  return program.replace(local_graph_def=gd, collective_ops=emitted)
