"""Graph plumbing: function parameters, constants, identities, sharding annotations, bias add."""

import math

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.registry import Rule, register


def _rank(info):
  """Dims a passed-through value's layout has: a TensorList handle's are its elements'."""
  return len(info.value_shape) if info.is_list else len(info.shape or ())


@register("Placeholder")
class Parameter(Rule):
  """A function argument: arrives in the layout the caller's data has (scattered or already sharded)."""

  priority = 0
  rank_free = True

  def partition(self, ctx, node):
    ctx.parameter(node)


@register("Const")
class Constant(Rule):
  """A constant whose elements all hold one value (a splat: zeros, ones, a fill) is emitted as a Fill of the device's
  own shard when its layout splits it -- padding of an uneven split holds the value too, as a Fill's does -- and
  when, replicated, it holds more than WHOLE_SPLAT_BYTES; no device holds the global value. Any other constant is
  the user's literal data: materialised whole on every device and sliced locally when its users want it split (no
  communication)."""

  priority = 0

  def partition(self, ctx, node):
    target, out = ctx.target(0), node.outputs[0]
    fill = out.partitionable and not target.is_maximal and (
        not target.is_replicated or math.prod(out.shape) * out.dtype.size > WHOLE_SPLAT_BYTES)
    value = splat_value(node.attr("value")) if fill else None
    if value is None:
      (whole,) = ctx.clone(node, {})
      ctx.set_output(0, whole, Sharding(ctx.mesh))
      return
    local = target.with_rank(len(out.shape)).shard_shape(out.shape)
    with ctx.helper_scope():
      dims = tf.constant(local, tf.int64 if max(local) >= 2**31 else tf.int32, name="shape")
      scalar = tf.constant(value, out.dtype, name="value")
    with ctx.after_control_inputs():
      y = tf.fill(dims, scalar, name=node.name)
    ctx.record(y)
    ctx.set_output(0, y, target)


WHOLE_SPLAT_BYTES = 1 << 16   # a replicated splat constant above this size is a Fill too (it is held on every device)
_PEEK = 64                    # elements compared first, so that most constants that are no splat are told cheaply


def splat_value(proto):
  """The value every element of the numeric constant `proto` (a TensorProto of more than one element) holds, as a
  numpy scalar of its dtype; None when its elements differ, it has at most one, or it is not numeric.

  Reads the proto as TF stores it: `tensor_content` (the elements' bytes, compared without decoding them, so -0.0
  and 0.0 differ and a NaN equals itself) or a typed value field, which may hold fewer values than elements (the
  last one repeats; none: all zeros). Only the stored values are decoded, never the expanded tensor."""
  dtype = tf.as_dtype(proto.dtype)
  if dtype.is_quantized or not (dtype.is_floating or dtype.is_integer or dtype.is_bool or dtype.is_complex):
    return None
  n = math.prod(d.size for d in proto.tensor_shape.dim)
  if n < 2:
    return None
  if proto.tensor_content:
    data, size = proto.tensor_content, dtype.size
    if len(data) != n * size:
      return None
    words = np.frombuffer(data, np.uint64 if size == 16 else np.dtype(f"u{size}")).reshape(n, -1)
    if not (words[:_PEEK] == words[0]).all() or not (words == words[0]).all():
      return None
    return np.frombuffer(data[:size], dtype.as_numpy_dtype)[0]
  fields = [(f.name, v) for f, v in proto.ListFields() if f.name.endswith("_val")]
  if not fields:
    return np.zeros((), dtype.as_numpy_dtype)[()]
  name, stored = fields[0]
  small = type(proto)(dtype=proto.dtype)
  small.tensor_shape.dim.add().size = len(stored) // (2 if dtype.is_complex else 1)
  getattr(small, name).extend(stored)
  values = tf.make_ndarray(small)
  if values.size == 0 or values.size > n:
    return None
  words = values.view(np.uint8).reshape(values.size, -1)
  return values[0] if (words == words[0]).all() else None


@register("Identity", "XlaSharding", "EnsureShape")
class IdentityLike(FactorRule):
  """Identity, TF's XlaSharding annotation op, EnsureShape: the value passes through unchanged."""

  linear = (0,)

  priority = 0

  data = (0,)

  def stacked_form(self, op_type):
    return "broadcasting" if op_type == "Identity" else None   # (the others check or annotate a per-device shape)

  def factors(self, node):
    labels = tuple(f"d{i}" for i in range(_rank(node.outputs[0])))
    return Factors((labels,), (labels,))

  def emit(self, ctx, node, local_inputs, axes_of):
    return [ctx.identity(local_inputs[0])]


@register("IdentityN")
class IdentityN(FactorRule):
  """Several values passed through at once (custom gradients): each output keeps its own input's layout."""

  priority = 0

  def factors(self, node):
    labels = tuple(tuple(f"t{k}d{i}" for i in range(_rank(o))) for k, o in enumerate(node.outputs))
    return Factors(labels, labels)

  def partition(self, ctx, node):
    # Each value is independent of the others: it travels in its own completed layout (a mesh axis may split
    # several of them), where one set of factors would let only the first value keep its split.
    targets = [ctx.target(k) for k in range(len(node.outputs))]
    outs = ctx.clone(node, {k: ctx.operand(k, t) for k, t in enumerate(targets)})
    for k, t in enumerate(targets):
      ctx.set_output(k, outs[k], t)


@register("BiasAdd", "BiasAddV1")
class BiasAdd(FactorRule):
  """value + bias broadcast along the channel dim (last for NHWC, 1 for NCHW)."""

  priority = 0
  stacked = "bias_add"

  def factors(self, node):
    rank = len(node.outputs[0].shape)
    labels = tuple(f"d{i}" for i in range(rank))
    channel = 1 if node.attr("data_format") in (b"NCHW", "NCHW") else rank - 1
    return Factors((labels, (labels[channel],)), (labels,))


@register("BiasAddGrad")
class BiasAddGrad(FactorRule):
  """d_bias[c] = sum over every other dim of d_out: those dims are summed factors."""

  def factors(self, node):
    rank = len(node.input_shape(0))
    channel = 1 if node.attr("data_format") in (b"NCHW", "NCHW") else rank - 1
    labels = tuple("c" if i == channel else f"r{i}" for i in range(rank))
    return Factors((labels,), (("c",),))


@register("NoOp")
class NoOp(Rule):
  """A control-dependency anchor: cloned with its control inputs."""

  priority = 0

  def partition(self, ctx, node):
    ctx.clone(node, {})
