"""Element-wise ops: every output element depends on the same element of each (broadcast) operand.

Operand dims line up with the output from the right (numpy broadcasting); a broadcast size-1 dim carries
no factor. Sharding passes through unchanged, so no communication beyond aligning operands is needed.
"""

from tf_gspmd.ops.factors import Factors, FactorRule, broadcast_labels, dim_labels, unsplit
from tf_gspmd.ops.registry import register

UNARY = (
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Cast", "Ceil", "CheckNumerics", "Conj", "Cos",
    "Cosh", "Digamma", "Elu", "Erf", "Erfc", "Erfinv", "Exp", "Expm1", "Floor", "Imag", "Inv", "Invert",
    "IsFinite", "IsInf", "IsNan", "LeakyRelu", "Lgamma", "Log", "Log1p", "LogicalNot", "Neg", "OnesLike",
    "PreventGradient", "Real", "Reciprocal", "Relu", "Relu6", "Rint", "Round", "Rsqrt", "Selu", "Sigmoid",
    "Sign", "Sin", "Sinh", "Snapshot", "Softplus", "Softsign", "Sqrt", "Square", "StopGradient", "Tan", "Tanh",
    "ZerosLike", "Ndtri", "BesselI0e", "BesselI1e",
)

BINARY = (
    "Add", "AddV2", "ApproximateEqual", "Atan2", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Div", "DivNoNan",
    "Equal", "FloorDiv", "FloorMod", "Greater", "GreaterEqual", "Igamma", "Igammac", "LeftShift", "Less",
    "LessEqual", "LogicalAnd", "LogicalOr", "Maximum", "Minimum", "Mod", "Mul", "MulNoNan", "NotEqual",
    "Polygamma", "Pow", "RealDiv", "RightShift", "SquaredDifference", "Sub", "TruncateDiv", "TruncateMod",
    "Xdivy", "Xlog1py", "Xlogy", "Zeta",
)

# Activation gradients: element-wise in (gradient, forward value), both of the result's shape.
GRADIENTS = (
    "EluGrad", "InvGrad", "LeakyReluGrad", "ReciprocalGrad", "Relu6Grad", "ReluGrad", "RsqrtGrad",
    "SeluGrad", "SigmoidGrad", "SoftplusGrad", "SoftsignGrad", "SqrtGrad", "TanhGrad",
)

TERNARY = ("SelectV2", "ClipByValue", "Betainc")

# Ops that do not broadcast: every operand of the result's shape; or each of it or a scalar.
_SAME_SHAPE = frozenset(GRADIENTS + ("AddN", "ApproximateEqual"))
_SCALAR_OR_SAME = frozenset(("ClipByValue", "Betainc"))


def _element_shape(info):
  """The shape whose elements line up: a TensorList's element shape, else the tensor's own."""
  return info.value_shape if info.is_list else info.shape


# The element-wise ops linear in their inputs (Rule.linear): sums, differences, negation, copies of the value, and
# SelectV2 in the values it picks between (its condition fixed).
_LINEAR = {"AddN": "all", "AddV2": "all", "Add": "all", "Sub": "all", "Neg": (0,), "Snapshot": (0,),
           "StopGradient": (0,), "PreventGradient": (0,), "CheckNumerics": (0,), "SelectV2": (1, 2)}


@register(*UNARY, *BINARY, *GRADIENTS, *TERNARY, "AddN")
class Elementwise(FactorRule):
  """Same-position ops with broadcasting: the output is split like the operands."""

  priority = 0
  elementwise = True

  def linear_in(self, op_type):
    return _LINEAR.get(op_type)

  def stacked_form(self, op_type):
    if op_type in _SAME_SHAPE:
      return "same_shape"
    return "scalar_or_same" if op_type in _SCALAR_OR_SAME else "broadcasting"

  def factors(self, node):
    # (ZerosLike / OnesLike / AddN of TensorLists, in loop gradients: their elements line up instead)
    out_shape = _element_shape(node.outputs[0])
    ins, out = broadcast_labels(out_shape, [_element_shape(node.input_info(i)) for i in range(len(node.inputs))])
    return Factors(ins, (out,))


@register("Select")
class Select(FactorRule):
  """Select (v1): a rank-1 condition picks whole rows of higher-rank operands (dim 0), else same shapes."""

  priority = 0
  linear = (1, 2)   # (in the values it picks between, its condition fixed)

  def factors(self, node):
    out_shape = node.outputs[0].shape
    out = tuple(f"d{i}" for i in range(len(out_shape)))
    cond_rank = len(node.input_shape(0))
    cond = out[:1] if cond_rank == 1 and len(out) > 1 else out
    return Factors((cond, out, out), (out,))


@register("MatrixBandPart")
class MatrixBandPart(FactorRule):
  """Zeroes a matrix outside a band (tf.linalg.band_part: causal and local-attention masks). Which elements are
  kept depends on their global row and column, so the two matrix dims stay whole; the batch dims pass through."""

  priority = 0

  data = (0,)

  def factors(self, node):
    rank = len(node.outputs[0].shape)
    labels = unsplit(dim_labels(rank), {rank - 2, rank - 1})
    return Factors((labels,), (labels,))
