"""The rule registry: one rule per op type, lookup is the only path, double registration fails."""

import pytest

from tf_gspmd import ops
from tf_gspmd.ops import registry


def test_lookup_and_fallback():
  assert ops.lookup("MatMul").name == "MatMul"
  assert ops.lookup("AddV2").name == "Elementwise"
  assert ops.lookup("NoSuchOp") is None
  assert ops.FALLBACK.name == "Fallback"


def test_register_twice_fails():
  with pytest.raises(ValueError, match="already has the rule"):
    @registry.register("MatMul")
    class Again(registry.Rule):  # pylint: disable=unused-variable
      pass


def test_covered_op_families():
  have = set(ops.registered_ops())
  assert {"MatMul", "BatchMatMulV2", "BiasAdd", "Sum", "Mean", "Max", "Identity", "Cast", "Const",
          "Placeholder", "AddV2", "Mul", "Erf", "Tanh", "SelectV2", "XlaSharding"} <= have
