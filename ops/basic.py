"""Graph plumbing: function parameters, constants, identities, sharding annotations, bias add."""

from tf_gspmd._sharding import Sharding
from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.registry import Rule, register


def _rank(info):
  """Dims a passed-through value's layout has: a TensorList handle's are its elements'."""
  return len(info.value_shape) if info.is_list else len(info.shape or ())


@register("Placeholder")
class Parameter(Rule):
  """A function argument: arrives in the layout the caller's data has (scattered or already sharded)."""

  priority = 0

  def partition(self, ctx, node):
    ctx.parameter(node)


@register("Const")
class Constant(Rule):
  """A constant is materialised whole and sliced locally when its users want it split (no communication)."""

  priority = 0

  def partition(self, ctx, node):
    (value,) = ctx.clone(node, {})
    ctx.set_output(0, value, Sharding(ctx.mesh))


@register("Identity", "XlaSharding", "EnsureShape")
class IdentityLike(FactorRule):
  """Identity, TF's XlaSharding annotation op, EnsureShape: the value passes through unchanged."""

  priority = 0

  data = (0,)

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
