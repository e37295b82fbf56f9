"""Functional control flow: While and If, completed and partitioned through their bodies.

A loop variable has one layout for the While's input and output and for the body's parameter and result.
Completion ties input and output, and asks the body what its results become for given parameters; the
partitioner reshards the initial values to the loop layout and partitions body and condition as per-device
functions that also receive the partition id. An If's predicate is replicated (every device takes the same
branch); its branches are partitioned for the arguments' layouts and return the If's completed layouts.
"""

import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.registry import Rule, register
from tf_gspmd.ops.tensor_list import ListShape


def _shapes(node, first=0):
  """The shapes of the inputs from `first` on, as a function body's parameters get them (a TensorList: its
  elements' shape, `ListShape`)."""
  infos = [node.input_info(i) for i in range(first, len(node.inputs))]
  return [ListShape(i.value_shape, i.value_dtype) if i.is_list else i.shape for i in infos]


def _func_attr(name):
  return tf.compat.v1.AttrValue(func=tf.compat.v1.NameAttrList(name=name))


def _shape_list_attr(shapes):
  return tf.compat.v1.AttrValue(list=tf.compat.v1.AttrValue.ListValue(
      shape=[tf.TensorShape(s).as_proto() for s in shapes]))


def _type_list_attr(dtypes):
  return tf.compat.v1.AttrValue(list=tf.compat.v1.AttrValue.ListValue(type=[d.as_datatype_enum for d in dtypes]))


def _body_results(ctx, fname, shapes, params):
  """Completed result layouts of function `fname` for parameter layouts `params` (None = free)."""
  return list(ctx.complete_function(fname, shapes, params).output_shardings)


def _refines(s, base):
  """Whether `s` splits every dim `base` splits the same way, and splits more."""
  if s is None or base is None or s.is_maximal or base.is_maximal or s.rank != base.rank:
    return False
  return all(not b or a == b for a, b in zip(s.dims, base.dims)) and s.num_tiles > base.num_tiles


@register("While", "StatelessWhile")
class While(Rule):
  """Loop variables keep one layout through the loop."""

  priority = 0
  rank_free = True
  forward_without_operands = True   # annotations inside the body speak even when nothing outside does

  def forward(self, ctx, node, operands):
    """The initial values' layouts, and what the body makes of them where it splits more: a loop variable the
    body splits further (a buffer initialised with zeros that the body fills from a split input) is carried in
    the body's layout, the initial value then sliced locally, instead of the body's result gathered back to the
    initial layout on every iteration."""
    cands = [[s] if s is not None else [] for s in operands]
    for i, s in enumerate(_body_results(ctx, node.attr("body").name, _shapes(node), operands)):
      if operands[i] is None or s == operands[i] or _refines(s, operands[i]):
        cands[i].append(s)
    return cands

  def backward(self, ctx, node, outputs, operands):
    return [[s] if s is not None else [] for s in outputs]

  def partition(self, ctx, node):
    """The body keeps an accumulator's sum pending across iterations (each iteration only adds to it: a gradient
    loop's weight gradients, partial over the data axes): its initial value enters as one term of that sum, and
    the loop's output is reduced once, after the loop, instead of in every iteration."""
    n = len(node.inputs)
    loop = [ctx.target(i) for i in range(n)]
    values = [ctx.operand(i, loop[i]) for i in range(n)]
    shapes = _shapes(node)
    body, carried = ctx.partition_loop_body(node.attr("body").name, node.attr("cond").name, shapes, loop)
    cond = ctx.partition_function(node.attr("cond").name, shapes, loop, [Sharding(ctx.mesh)], loop="cond")
    for k, partial in carried.items():
      values[k] = ctx.one_term(values[k], partial[0])
    local = [ctx.local_shape(i, loop[i]) for i in range(n)] + [[]]
    outs = ctx.clone(node, dict(enumerate(values)), extra_inputs=[ctx.pid], extra_dtypes=[tf.int32], attrs={
        "body": _func_attr(body), "cond": _func_attr(cond),
        "T": _type_list_attr([o.dtype for o in node.outputs] + [tf.int32]),
        "output_shapes": _shape_list_attr([s if s is not None else None for s in local])})
    for i in range(n):
      ctx.set_output(i, outs[i], loop[i], partial=carried.get(i))


@register("If", "StatelessIf")
class If(Rule):
  """Both branches see the arguments' layouts; results take the If's completed layouts."""

  priority = 1
  rank_free = True
  forward_without_operands = True

  def forward(self, ctx, node, operands):
    outs = [[] for _ in node.outputs]
    for branch in ("then_branch", "else_branch"):
      for o, s in enumerate(_body_results(ctx, node.attr(branch).name, _shapes(node, 1), operands[1:])):
        outs[o].append(s)
    return outs

  def partition(self, ctx, node):
    mesh = ctx.mesh
    pred = ctx.operand(0, Sharding(mesh))
    n = len(node.inputs) - 1
    arrive = [ctx.current(1 + i) or Sharding(mesh) for i in range(n)]
    values = [ctx.operand(1 + i, arrive[i]) for i in range(n)]
    targets = [ctx.target(o) for o in range(len(node.outputs))]
    shapes = _shapes(node, 1)
    then_b = ctx.partition_function(node.attr("then_branch").name, shapes, arrive, targets)
    else_b = ctx.partition_function(node.attr("else_branch").name, shapes, arrive, targets)
    local = [t.shard_shape(o.shape) if o.shape is not None else None for t, o in zip(targets, node.outputs)]
    inputs = {0: pred}
    inputs.update({1 + i: v for i, v in enumerate(values)})
    outs = ctx.clone(node, inputs, extra_inputs=[ctx.pid], attrs={
        "then_branch": _func_attr(then_b), "else_branch": _func_attr(else_b),
        "Tin": _type_list_attr([node.input_info(1 + i).dtype for i in range(n)] + [tf.int32]),
        "output_shapes": _shape_list_attr(local)})
    for o, t in enumerate(targets):
      ctx.set_output(o, outs[o], t)


@register("PartitionedCall", "StatefulPartitionedCall")
class Call(Rule):
  """A function call left after inlining: its body is completed and partitioned like an If branch."""

  priority = 0
  rank_free = True
  forward_without_operands = True

  def forward(self, ctx, node, operands):
    return [[s] for s in _body_results(ctx, node.attr("f").name, _shapes(node), operands)] or \
        [[] for _ in node.outputs]

  def partition(self, ctx, node):
    mesh = ctx.mesh
    n = len(node.inputs)
    arrive = [ctx.current(i) or Sharding(mesh) for i in range(n)]
    values = {i: ctx.operand(i, arrive[i]) for i in range(n)}
    targets = [ctx.target(o) for o in range(len(node.outputs))]
    body = ctx.partition_function(node.attr("f").name, _shapes(node), arrive, targets)
    outs = ctx.clone(node, values, extra_inputs=[ctx.pid], attrs={
        "f": _func_attr(body), "Tin": _type_list_attr([node.input_info(i).dtype for i in range(n)] + [tf.int32])})
    for o, t in enumerate(targets):
      if node.outputs[o].partitionable:   # a call's shapes are not inferred through its body
        outs[o].set_shape(t.shard_shape(node.outputs[o].shape))
      ctx.set_output(o, outs[o], t)
