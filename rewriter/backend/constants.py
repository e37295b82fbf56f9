"""The constants pass: the constants the per-device program holds on every device, stated in the report.

A Const kernel keeps its tensor for the program's lifetime, on every device, whatever the mesh: a constant sized by
the global model (a [batch, seq] mask, a positional table) costs its full size per device. Partitioning emits
splat constants as Fills of the device's shard and split ranges per device (ops/basic.py, ops/generators.py); what
remains are the user's literal values and the partitioner's small per-device tables. The pass reads the Const nodes
of the per-device program and of the functions it calls (loop bodies, branches) from their NodeDefs alone (their
bytes are their dtype's size times their shape's elements: what the kernel holds, however compactly the proto
stores it), and gives the report their total and the largest. With strict=True a constant of more than
STRICT_BYTES is a PartitionError naming it and the fix.
"""

import dataclasses
import heapq
import math
from typing import Tuple

import tensorflow as tf

from tf_gspmd.errors import PartitionError
from tf_gspmd.rewriter.graph.graph_view import function_names

CONSTANT_OPS = frozenset({"Const", "HostConst"})
STRICT_BYTES = 1 << 20   # strict=True refuses a per-device constant larger than this
LARGEST = 3


@dataclasses.dataclass(frozen=True)
class ConstantNode:
  """One constant of the per-device program: its node (`function/node` inside a function body), dtype, shape and
  the bytes it holds on each device."""

  name: str
  dtype: str
  shape: Tuple[int, ...]
  bytes: int

  def __str__(self):
    return f"{self.name} {self.dtype}[{','.join(str(d) for d in self.shape)}] {self.bytes:,} B"


@dataclasses.dataclass(frozen=True)
class Constants:
  """The constants of the per-device program: their bytes per device, how many, and the largest (up to LARGEST)."""

  bytes: int
  count: int
  largest: Tuple[ConstantNode, ...] = ()

  def __str__(self):
    largest = "; ".join(str(c) for c in self.largest)
    return (f"constants: {self.bytes:,} B per device in {self.count} node(s)"
            + (f"; largest: {largest}" if largest else ""))


def constant_nodes(graph_def):
  """Every ConstantNode of `graph_def` and of the library functions it reaches."""
  library = {f.signature.name: f for f in graph_def.library.function}
  out, seen = [], set()
  pending = [("", graph_def.node)]
  while pending:
    prefix, nodes = pending.pop()
    for nd in nodes:
      if nd.op in CONSTANT_OPS:
        out.append(_describe(prefix + nd.name, nd))
      for fname in function_names(nd):
        if fname in library and fname not in seen:
          seen.add(fname)
          pending.append((fname + "/", library[fname].node_def))
  return out


def _describe(name, nd):
  proto = nd.attr["value"].tensor
  dtype = tf.as_dtype(nd.attr["dtype"].type)
  shape = tuple(d.size for d in proto.tensor_shape.dim)
  if dtype == tf.string:
    size = sum(len(s) for s in proto.string_val)
  else:
    size = math.prod(shape) * dtype.size if dtype not in (tf.resource, tf.variant) else 0
  return ConstantNode(name, dtype.name, shape, size)


def summarize(nodes):
  """The Constants of ConstantNodes `nodes` (those of a per-device program)."""
  largest = heapq.nlargest(LARGEST, nodes, key=lambda c: c.bytes)
  return Constants(bytes=sum(c.bytes for c in nodes), count=len(nodes), largest=tuple(c for c in largest if c.bytes))


def run(program):
  """Pass: `report.constants`; with strict=True, a PartitionError for a constant of more than STRICT_BYTES."""
  nodes = constant_nodes(program.local_graph_def)
  constants = summarize(nodes)
  too_large = [c for c in nodes if c.bytes > STRICT_BYTES]
  if program.options.strict and too_large:
    c = max(too_large, key=lambda c: c.bytes)
    raise PartitionError(
        f"strict=True forbids a constant of more than {STRICT_BYTES:,} B in the per-device program: {c.name} "
        f"({c.dtype}[{','.join(str(d) for d in c.shape)}], {c.bytes:,} B) is held whole on every device"
        + (f" ({len(too_large) - 1} more over the limit)" if len(too_large) > 1 else "")
        + ". Fix: compute it with ops (tf.fill, tf.range, tf.linalg.band_part, tf.one_hot, ...) from its shape, so "
        "that it is partitioned and each device computes only its shard, pass it as an argument (it is then split "
        "like the argument), or pass strict=False to accept it",
        node=c.name, op_type="Const")
  return program.replace(report=program.report.with_constants(constants))
