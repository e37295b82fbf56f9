"""Matrix products: MatMul and BatchMatMul as factor rules ("b m k, b k n -> b m n", k reduced).

Batch and non-contracting dims pass their split through; a split contracting dim gives partial sums
combined by one all-reduce over the mesh axes that split it (operands masked with 0 where uneven).
"""

from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.registry import register


@register("MatMul")
class MatMul(FactorRule):
  """[m,k]@[k,n] with optional transposes: k is reduced, m and n pass through."""

  stacked = "matmul"

  prefer_larger_operand = True

  def factors(self, node):
    a = ("k", "m") if node.attr("transpose_a") else ("m", "k")
    b = ("n", "k") if node.attr("transpose_b") else ("k", "n")
    return Factors((a, b), (("m", "n"),))


@register("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
class BatchMatMul(FactorRule):
  """Batched matmul with broadcast batch dims: batch factors pass through, k is reduced."""

  def stacked_form(self, op_type):
    return None if op_type == "BatchMatMul" else "broadcasting"   # (v1 takes equal batch dims only)

  prefer_larger_operand = True

  def factors(self, node):
    x_shape, y_shape = node.input_shape(0), node.input_shape(1)
    out_shape = node.outputs[0].shape
    nb = len(out_shape) - 2

    def batch(shape):
      r = len(shape) - 2
      return tuple(None if (shape[i] == 1 and out_shape[nb - r + i] != 1) else f"b{nb - r + i}" for i in range(r))

    x = batch(x_shape) + (("k", "m") if node.attr("adj_x") else ("m", "k"))
    y = batch(y_shape) + (("n", "k") if node.attr("adj_y") else ("k", "n"))
    out = tuple(f"b{i}" for i in range(nb)) + ("m", "n")
    return Factors((x, y), (out,))
