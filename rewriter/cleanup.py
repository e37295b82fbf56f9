"""Cleanup and verify passes on the per-device program."""

import tensorflow as tf

from tf_gspmd.errors import PartitionError
from tf_gspmd.rewriter.graph_ir import prune
from tf_gspmd.rewriter.partition import PARTITION_ID

COLLECTIVE_OPS = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2", "CollectiveReduceScatterV2")


def run(program):
  """Pass: drop nodes that neither feed an output nor have side effects."""
  roots = (list(program.local_outputs) + list(program.side_effects) + list(program.local_inputs) +
           list(program.local_variables) + [PARTITION_ID])
  gd = prune(program.local_graph_def, roots)
  return program.replace(local_graph_def=gd)


def verify(program):
  """Pass: invariants every per-device program must hold."""
  names = {n.name: n for n in program.local_graph_def.node}
  for n in list(program.local_inputs) + list(program.local_outputs) + [PARTITION_ID]:
    if n not in names:
      raise PartitionError(f"per-device program lost its boundary node {n}")
  for node in program.local_graph_def.node:
    if node.op == "XlaSharding":
      raise PartitionError("an XlaSharding op survived partitioning (it has no kernel outside XLA)", node=node.name)
    if node.op in COLLECTIVE_OPS and "/gspmd/" not in node.name:
      raise PartitionError("a collective not built by the partitioner (its keys could clash)", node=node.name,
                           op_type=node.op)
  return program
