"""Cleanup and verify passes on the per-device program."""

from tf_gspmd.errors import PartitionError
from tf_gspmd.rewriter.vocabulary import TF_COLLECTIVE_OPS
from tf_gspmd.rewriter.graph_view import prune


def run(program):
  """Pass: drop nodes that neither feed an output nor have side effects (the report forgets dropped collectives:
  those of the program's graph, and those inside the bodies of dropped loops, branches and calls; a collective
  inside a body that stays runs, as TF keeps a function's stateful ops)."""
  roots = (list(program.local_outputs) + list(program.side_effects) + list(program.local_inputs) +
           list(program.local_variables) + [program.partition_id])
  gd = prune(program.local_graph_def, roots)
  kept = {n.name for n in gd.node}
  report = program.report
  dropped = {k: None for k in report.emitted() if k not in kept}
  if dropped:
    report = report.with_ops_replaced(dropped)
  bodies = {c.within[0] for c in report.collectives if c.within and c.ops} - kept
  if bodies:
    report = report.without_bodies_of(bodies)
  return program.replace(local_graph_def=gd, report=report)


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
