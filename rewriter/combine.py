"""The combine pass: independent all-reduces over the same devices become one (XLA's all-reduce combiner).

A training step issues one all-reduce per gradient; each costs a rendezvous of every device, which on
CPUs and for small tensors costs more than the bytes. All-reduces that do not depend on each other and
share group, reduction and dtype are concatenated into one collective, then split back.

Independence: every all-reduce gets a *depth*, the largest number of all-reduces on a path from the
program's inputs to it (itself included). An all-reduce that depends on another has a larger depth, so
all-reduces of equal depth are independent, and combining within depths cannot create a cycle. Combined
collectives are capped at MAX_BYTES each. The report keeps the logical collectives and records each
combination (`report.combined`).
"""

import collections

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

MAX_BYTES = 32 << 20
OP = "CollectiveReduceV2"


def _const(t):
  value = tensor_util.constant_value(t)
  return None if value is None else np.asarray(value).tobytes()


def _group(op):
  """What must agree for two all-reduces to share one collective (None: leave this one alone)."""
  key_src = op.inputs[2].op
  if key_src.type in ("GatherV2", "Gather", "ResourceGather"):
    key = ("table", key_src.inputs[0].op.name, key_src.inputs[1].op.name)
  else:
    key = ("const", _const(op.inputs[2]))
  size = _const(op.inputs[1])
  if size is None or key[1] is None or not op.outputs[0].shape.is_fully_defined():
    return None
  return (op.inputs[0].dtype, op.get_attr("merge_op"), op.get_attr("final_op"), size, key)


def _depths(graph):
  depth = {}
  order = _topological(graph)
  for op in order:
    d = max([depth[t.op] for t in op.inputs] + [depth[c] for c in op.control_inputs] + [0])
    depth[op] = d + (1 if op.type == OP else 0)
  return depth


def _topological(graph):
  ops = graph.get_operations()
  pending = {op: len({t.op for t in op.inputs} | set(op.control_inputs)) for op in ops}
  users = collections.defaultdict(set)
  for op in ops:
    for src in {t.op for t in op.inputs} | set(op.control_inputs):
      users[src].add(op)
  ready = collections.deque(op for op in ops if pending[op] == 0)
  order = []
  while ready:
    op = ready.popleft()
    order.append(op)
    for u in sorted(users[op], key=lambda o: o.name):
      pending[u] -= 1
      if pending[u] == 0:
        ready.append(u)
  return order


def combine(graph_def):
  """(new GraphDef, [(members, bytes)] per combined collective)."""
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(graph_def, name="")
  depth = _depths(graph)
  bins = collections.defaultdict(list)
  for op in sorted((o for o in graph.get_operations() if o.type == OP), key=lambda o: o.name):
    group = _group(op)
    if group is not None:
      bins[(depth[op],) + group].append(op)
  combined = []
  for members in bins.values():
    chunk, size = [], 0
    for op in members + [None]:
      nbytes = 0 if op is None else op.outputs[0].shape.num_elements() * op.outputs[0].dtype.size
      if op is None or (chunk and size + nbytes > MAX_BYTES):
        if len(chunk) > 1:
          _replace(graph, chunk, len(combined))
          combined.append((len(chunk), size))
        chunk, size = [], 0
      if op is not None:
        chunk.append(op)
        size += nbytes
  return graph.as_graph_def(), combined


def _replace(graph, members, k):
  first = members[0]
  with graph.as_default(), tf.name_scope(f"combined_all_reduce_{k}/gspmd/"):
    controls = {c for m in members for c in m.control_inputs}
    with tf.control_dependencies(sorted(controls, key=lambda o: o.name)):
      flat = tf.concat([tf.reshape(m.inputs[0], [-1]) for m in members], 0)
      out = tf.raw_ops.CollectiveReduceV2(
          input=flat, group_size=first.inputs[1], group_key=first.inputs[2], instance_key=first.inputs[3],
          ordering_token=[], merge_op=first.get_attr("merge_op"), final_op=first.get_attr("final_op"),
          communication_hint=first.get_attr("communication_hint"), timeout_seconds=first.get_attr("timeout_seconds"),
          name="all_reduce")
    parts = tf.split(out, [m.outputs[0].shape.num_elements() for m in members])
    for m, part in zip(members, parts):
      new = tf.reshape(part, m.outputs[0].shape)
      for consumer in list(m.outputs[0].consumers()):
        for i, t in enumerate(consumer.inputs):
          if t is m.outputs[0]:
            consumer._update_input(i, new)  # pylint: disable=protected-access
  for op in graph.get_operations():
    if any(c in members for c in op.control_inputs):
      keep = [c for c in op.control_inputs if c not in members] + [out.op]
      op._remove_all_control_inputs()  # pylint: disable=protected-access
      op._add_control_inputs(keep)  # pylint: disable=protected-access


def run(program):
  """Pass: combine independent all-reduces of the per-device program (dropped ones are pruned by cleanup)."""
  gd, combined = combine(program.local_graph_def)
  program.report.combined.extend(combined)
  return program.replace(local_graph_def=gd)
