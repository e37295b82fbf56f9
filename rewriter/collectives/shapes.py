"""Static shapes of a per-device program that holds collectives: TF's shape functions leave a gather's or a
receive's result unknown, which the program determines (its group size, the shape it is sent)."""

import tensorflow as tf

from tf_gspmd.rewriter.collectives import vocabulary
from tf_gspmd.rewriter.graph import graph_view
from tf_gspmd.rewriter.graph.graph_view import is_control


def adds_shapes(gd, variables):
  """Whether `for_shapes(gd, variables)` can give a tensor a static shape TF's import of `gd` leaves unknown: `gd`
  reads one of `variables`, or has a collective whose result's shape TF's shape function does not know."""
  nodes = {x.name: x for x in gd.node}
  return any((x.op in vocabulary.TF_COLLECTIVE_OPS and (x.op not in vocabulary.EMITTED or
                                                         vocabulary.EMITTED[x.op].stand_in is not None)) or
             (x.op == "ReadVariableOp" and variables.get(graph_view.through_identities(nodes, x.input[0])) is not None)
             for x in gd.node)


def for_shapes(gd, variables):
  """`gd` for shape inference only: each collective replaced by an op of its result's shape (its vocabulary entry's
  `stand_in`), each read of a captured variable (`variables`: handle -> (shape, dtype) of a device's shard) by a
  placeholder of the shard's shape."""
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(gd)
  nodes = {x.name: x for x in gd.node}
  consts = {x.name: x for x in gd.node if x.op == "Const"}
  for x in out.node:
    handle = graph_view.through_identities(nodes, x.input[0]) if x.op == "ReadVariableOp" else None
    if variables.get(handle) is not None:
      shape, _ = variables[handle]
      graph_view.write(x, "Placeholder", [i for i in x.input if is_control(i)],
                       dtype=tf.as_dtype(x.attr["dtype"].type), shape=tf.TensorShape(shape))
      continue
    entry = vocabulary.EMITTED.get(x.op)
    if entry is None:
      continue
    data = [i for i in x.input if not is_control(i)]
    controls = [i for i in x.input if is_control(i)]
    dtype = tf.as_dtype(x.attr["T"].type)
    stand_in = ("Identity", [data[0]], {}) if entry.stand_in is None else entry.stand_in(x, data, consts, out)
    if stand_in is not None:
      op, inputs, attrs = stand_in
      graph_view.write(x, op, inputs + controls, T=dtype, **attrs)
  return out
