"""Cleanup and verify passes on the per-device program."""

import tensorflow as tf

from tf_gspmd.errors import PartitionError
from tf_gspmd.rewriter.graph import graph_view
from tf_gspmd.rewriter.collectives.vocabulary import TF_COLLECTIVE_OPS
from tf_gspmd.rewriter.graph.graph_view import prune


def run(program):
  """Pass: drop nodes that neither feed an output nor have side effects (the report forgets dropped collectives:
  those of the program's graph, and those inside the bodies of dropped loops, branches and calls; a collective
  inside a body that stays runs, as TF keeps a function's stateful ops)."""
  roots = (list(program.local_outputs) + list(program.side_effects) + list(program.local_inputs) +
           list(program.local_variables) + [program.partition_id])
  gd = merge_reads(prune(program.local_graph_def, roots), {graph_view.node_of(r) for r in roots})
  kept = {n.name for n in gd.node}
  report = program.report
  dropped = {k: None for k in report.emitted() if k not in kept}
  if dropped:
    report = report.with_ops_replaced(dropped)
  bodies = {c.within[0] for c in report.collectives if c.within and c.ops} - kept
  if bodies:
    report = report.without_bodies_of(bodies)
  return program.replace(local_graph_def=gd, report=report)


def merge_reads(gd, keep=()):
  """`gd` with every variable read that repeats another -- same variable handle input, control inputs and
  attributes -- left out, its consumers reading the other (nodes in `keep` stay).

  An optimizer reads its step counter once per weight it updates (Keras's Adam: 2 of every 7 reads of a small
  transformer's step), and TF's graph optimizer merges no stateful op, nor therefore what is computed from the
  reads. Two such reads have the same ancestors, so no write is ordered between them: they read one value. After
  the merge TF's optimizer merges what is computed from them alike (the step's bias corrections, once per weight
  before).
  """
  first, same = {}, {}
  for n in gd.node:
    if n.op != "ReadVariableOp" or n.name in keep:
      continue
    key = tf.compat.v1.NodeDef()
    key.CopyFrom(n)
    key.name = ""
    data = [i for i in n.input if not graph_view.is_control(i)]
    del key.input[:]
    key.input.extend(data + sorted(set(n.input) - set(data)))
    key = key.SerializeToString(deterministic=True)
    if key in first:
      same[n.name] = first[key]
    else:
      first[key] = n.name
  if not same:
    return gd
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(gd)
  view = graph_view.GraphView(out)
  for repeat, read in same.items():
    view.rewire(f"{repeat}:0", f"{read}:0")
    view.rewire(f"^{repeat}", f"^{read}")
  kept = [n for n in out.node if n.name not in same]
  del out.node[:]
  out.node.extend(kept)
  return out


def verify(program):
  """Pass: invariants every per-device program must hold."""
  names = {n.name: n for n in program.local_graph_def.node}
  emitted = program.report.emitted()
  for n in list(program.local_inputs) + list(program.local_outputs) + [program.partition_id]:
    if n not in names:
      raise PartitionError(f"per-device program lost its boundary node {n}")
  for node in program.local_graph_def.node:
    if node.op == "XlaSharding":
      raise PartitionError("an XlaSharding op survived partitioning (it has no kernel outside XLA)", node=node.name)
    if node.op in TF_COLLECTIVE_OPS and node.name not in emitted:
      raise PartitionError("a collective not built by the partitioner (its keys could clash): tf_gspmd emits every "
                           "collective itself; remove collective ops from the function", node=node.name,
                           op_type=node.op)
  return program
