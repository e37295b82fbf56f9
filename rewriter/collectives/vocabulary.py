"""The collectives vocabulary: every TF collective op the partitioner emits, in one place.

Each entry states, for one op type, the kind of collective it performs, how it is built (the TF op), whether
XLA compiles it, and its in-process meaning: the ordinary ops that compute, from the group members' tensors,
what the op returns on one member when every device's program is one graph (rewriter/one_graph/in_process.py). The
collectives backend (rewriter/collectives/builders.py) builds ops through `build`; the in-process exchange rewrites each
op through `in_process`; passes ask `EMITTED_OPS` / `TF_COLLECTIVE_OPS` which op types are collectives. A new
collective op is one entry here (and the backend method that uses it).

The in-process meanings, in runtime rank order (the order TF's collectives use among a group's members):
  * all-reduce: the group's first member merges every member's operand (AddN for a sum; Mul, Maximum or Minimum
    in rank order); the others read its result, so every member holds the same bits;
  * all-gather: every member's operand concatenated along dim 0;
  * all-to-all: block r of every member's operand (dim 0 cut into group-size blocks) to the member of rank r;
  * collective-permute (a send/receive pair in a group of two): the receiver reads what its sender sends.

In the stacked one graph (rewriter/one_graph/stacking.py) the all-reduce, all-gather and all-to-all are written
once for every device over the device dimension (rewriter/one_graph/stacking_rules.py); other collectives keep
these meanings, per device.
"""

import dataclasses
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from tf_gspmd.rewriter.graph import graph_view

_MERGE = {b"Add": "AddN", b"Mul": "Mul", b"Max": "Maximum", b"Min": "Minimum"}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One TF collective op type of the vocabulary."""

  op_type: str                 # the TF op
  kind: str                    # what it does: all-reduce, all-gather, all-to-all, collective-permute
  build: Callable[..., Any]    # builds the op: tf.raw_ops.<op_type>
  in_process: Callable[..., None]   # (edges, x, node, p): device p's copy `node` of NodeDef `x` becomes its meaning
  xla: bool = False            # XLA compiles it (TF 2.21's tf2xla registers a kernel), for the merges in `xla_merges`
  xla_merges: tuple = ()
  in_process_if: Optional[Callable[[Any], bool]] = None   # which of its NodeDefs have an in-process meaning
  sender: bool = False         # the sending half of a send/receive pair (its receiver reads what it sends)
  # For shape inference (rewriter/collectives/shapes.py), an op of the result's shape that stands for NodeDef `x`:
  # (x, data inputs, {name: Const NodeDef}, the GraphDef being written) -> (op, inputs, attrs), or None where TF's
  # own shape function gives the result its operand's shape; `unshaped`: a stand-in may be none (shape unknown).
  stand_in: Optional[Callable[..., Any]] = None
  # What device p's result is a function of, beside the op and its control inputs (the one graph emits one copy
  # for devices whose results are equal, rewriter/one_graph/in_process.py): "group", the members' operands in rank
  # order (every member gets the same result); "rank", those and p's rank among them; None: p's own.
  depends_on: Optional[str] = None

  def runs_in_process(self, node_def):
    return self.in_process_if is None or self.in_process_if(node_def)


def _all_reduce(edges, x, node, p):
  ranked = edges.ranked(p, x.name)
  dtype = x.attr["T"]
  control = edges.controls(p, x)
  if p != ranked[0]:
    graph_view.write(node, "Identity", [edges.ref(ranked[0], x.name)] + control, T=dtype)
  elif x.attr["merge_op"].s == b"Add":
    graph_view.write(node, "AddN", [edges.ref(q, x.input[0]) for q in ranked] + control, T=dtype, N=len(ranked))
  else:   # a chain of the binary merge in rank order
    merge = _MERGE[x.attr["merge_op"].s]
    acc = edges.ref(ranked[0], x.input[0])
    for k, q in enumerate(ranked[1:-1]):
      step = edges.add(f"{node.name}/merge_{k}", p)
      graph_view.write(step, merge, [acc, edges.ref(q, x.input[0])], T=dtype)
      acc = step.name
    graph_view.write(node, merge, [acc, edges.ref(ranked[-1], x.input[0])] + control, T=dtype)


def _all_gather(edges, x, node, p):
  ranked = edges.ranked(p, x.name)
  graph_view.write(node, "ConcatV2", [edges.ref(q, x.input[0]) for q in ranked] +
                   [edges.const(f"{node.name}/axis", np.int32(0), p)] + edges.controls(p, x), T=x.attr["T"],
                   N=len(ranked), Tidx=tf.int32)


def _all_to_all(edges, x, node, p):
  ranked = edges.ranked(p, x.name)
  axis = edges.const(f"{node.name}/axis", np.int32(0), p)
  blocks = []
  for q in ranked:
    split = edges.add(f"{node.name}/blocks_of_{q}", p)
    graph_view.write(split, "Split", [axis, edges.ref(q, x.input[0])], T=x.attr["T"], num_split=len(ranked))
    blocks.append(f"{split.name}:{ranked.index(p)}")
  graph_view.write(node, "ConcatV2", blocks + [axis] + edges.controls(p, x), T=x.attr["T"], N=len(ranked),
                   Tidx=tf.int32)


def _send(edges, x, node, p):
  graph_view.write(node, "Identity", [edges.ref(p, x.input[0])] + edges.controls(p, x), T=x.attr["T"])


def _receive(edges, x, node, p):
  """What the group's other member sends, in the shape this one expects."""
  sender, send_op = edges.sender(p, x.name)
  graph_view.write(node, "Reshape", [edges.ref(sender, send_op), edges.ref(p, edges.input(x, "shape"))] +
                   edges.controls(p, x), T=x.attr["T"], Tshape=x.attr["Tshape"])


def _gathered(x, data, consts, out):
  """An all-gather's result for shapes: its operand concatenated group-size times (the size a Const)."""
  if graph_view.node_of(data[1]) not in consts:
    return None
  size = int(tf.make_ndarray(consts[graph_view.node_of(data[1])].attr["value"].tensor))
  axis = graph_view.write_const(out.node.add(name=f"{x.name}/shape_axis"), np.int32(0))
  return "ConcatV2", [data[0]] * size + [axis.name], {"N": size, "Tidx": tf.int32}


def _received(x, data, consts, out):  # pylint: disable=unused-argument
  """A receive's result for shapes: zeros of the shape it is given."""
  zero = graph_view.write_const(out.node.add(name=f"{x.name}/shape_zero"),
                                np.zeros((), tf.as_dtype(x.attr["T"].type).as_numpy_dtype))
  return "Fill", [data[3], zero.name], {"index_type": tf.as_dtype(x.attr["Tshape"].type)}


def _plain_reduce(node_def):
  return node_def.attr["merge_op"].s in _MERGE and node_def.attr["final_op"].s == b"Id"


EMITTED = {c.op_type: c for c in (
    Collective("CollectiveReduceV2", "all-reduce", tf.raw_ops.CollectiveReduceV2, _all_reduce, xla=True,
               xla_merges=(b"Add", b"Mul"), in_process_if=_plain_reduce, depends_on="group"),
    Collective("CollectiveGatherV2", "all-gather", tf.raw_ops.CollectiveGatherV2, _all_gather, stand_in=_gathered,
               depends_on="group"),
    Collective("CollectiveAllToAllV2", "all-to-all", tf.raw_ops.CollectiveAllToAllV2, _all_to_all,
               depends_on="rank"),
    Collective("CollectiveBcastSendV2", "collective-permute", tf.raw_ops.CollectiveBcastSendV2, _send,
               sender=True),
    Collective("CollectiveBcastRecvV2", "collective-permute", tf.raw_ops.CollectiveBcastRecvV2, _receive,
               stand_in=_received),
)}
BY_KIND = {c.kind: c for c in EMITTED.values() if c.kind != "collective-permute" or c.sender}   # the op each sends by
PERMUTE_SEND, PERMUTE_RECEIVE = BY_KIND["collective-permute"], EMITTED["CollectiveBcastRecvV2"]

EMITTED_OPS = frozenset(EMITTED)   # what the backend builds
TF_COLLECTIVE_OPS = EMITTED_OPS | frozenset({   # every TF collective op type (a program may hold only ours)
    "CollectiveReduceScatterV2", "CollectiveReduceV3", "CollectiveAllToAllV3", "CollectiveReduce", "CollectiveGather",
    "CollectiveBcastSend", "CollectiveBcastRecv"})
# The collectives XLA compiles: TF 2.21's tf2xla registers an XLA kernel (XLA_CPU_JIT, XLA_GPU_JIT) for
# CollectiveReduceV2 only, which sums or multiplies (`lowered_by_xla`); gathers, all-to-alls and broadcasts
# have none and run outside XLA.
XLA_LOWERED = frozenset(c.op_type for c in EMITTED.values() if c.xla)


def write_regrouped(node, x, operand, group_size, group_key, instance_key, controls=()):
  """NodeDef `node` (its name and device set): collective NodeDef `x`'s op run among other groups -- `operand` over
  groups of `group_size` members keyed `group_key`, as instance `instance_key` (input strings) -- with `x`'s
  attributes (the one graph of a process runs a collective across processes so, rewriter/one_graph/)."""
  name, device = node.name, node.device
  node.CopyFrom(x)
  node.name, node.device = name, device
  del node.input[:]
  node.input.extend([operand, group_size, group_key, instance_key] + list(controls))


def kind_of(node_def):
  """The kind of collective NodeDef `node_def` performs (all-reduce, all-gather, all-to-all, collective-permute),
  or None where it is not one the backend builds."""
  c = EMITTED.get(node_def.op)
  return c.kind if c is not None else None


def lowered_by_xla(node):
  """Whether XLA compiles the collective NodeDef `node`: a type tf2xla lowers, with a merge its kernel takes."""
  c = EMITTED.get(node.op)
  return c is not None and c.xla and node.attr["merge_op"].s in c.xla_merges
