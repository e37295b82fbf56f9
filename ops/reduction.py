"""Reductions over constant axes: reduced dims are reduced factors; split ones need one all-reduce.

Padding of an unevenly split reduced dim is masked with the reduction's identity (0 for Sum, -inf for
Max, ...) before the local reduction, so it never leaks into the result.
"""

import math

import numpy as np
import tensorflow as tf

from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.registry import register

_REDUCE_OP = {"Sum": "Add", "Mean": "Add", "Max": "Max", "Min": "Min", "Prod": "Mul"}


def reduced_axes(node):
  axes = node.const_input(1)
  if axes is None:
    return None
  rank = len(node.input_shape(0))
  return sorted({int(a) % rank for a in np.atleast_1d(axes)}) if rank else []


@register("Sum", "Mean", "Max", "Min", "Prod")
class Reduce(FactorRule):
  """reduce(x, axes): kept dims pass through, reduced dims combine partial results with the op's reducer."""

  def data_inputs(self, node):
    return [0]

  def factors(self, node):
    rank = len(node.input_shape(0))
    red = reduced_axes(node)
    if red is None:  # axes computed at run time: reduce everything locally after replication
      red = []
    labels = tuple(f"d{i}" for i in range(rank))
    keep = node.attr("keep_dims")
    out = tuple((None if i in red else l) for i, l in enumerate(labels) if keep or i not in red)
    ins = tuple((f"r{i}" if i in red else l) for i, l in enumerate(labels))
    return Factors((ins,), (out,), _REDUCE_OP[node.op])

  def split_reduced(self, node):
    # An integer Mean truncates sum/count; partial sums cannot be scaled first, so it reduces unsplit.
    return node.op != "Mean" or not node.outputs[0].dtype.is_integer

  def emit(self, ctx, node, local_inputs, axes_of):
    if node.op != "Mean" or not any(axes_of.get(l) for l in self.factors(node).reduced):
      return ctx.clone(node, {0: local_inputs[0]})
    # Mean = Sum * (1/count) with the global count: the scale is linear, so it commutes with the all-reduce.
    count = math.prod(node.input_shape(0)[i] for i in reduced_axes(node))
    (total,) = ctx.clone(node, {0: local_inputs[0]}, op_type="Sum")
    return [total * tf.constant(1.0 / count, node.outputs[0].dtype)]
