"""The abstract values of `microbatch_loss`'s proof (see its docstring) and the constants it evaluates: a tensor
that depends on the batch size only, such as the count of entries a loss divides its sum by, is evaluated from
constants and static shapes in each of the two graphs."""

import dataclasses
from typing import Tuple

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Value:
  """An abstract value of a tensor (see microbatch_loss's docstring)."""

  kind: str                                   # "free", "nconst", "row", "sum" or "top"
  dim: int = 0                                # row: the dim of the batch rows
  k: int = 1                                  # row: entries of that dim per batch row
  c: Tuple[float, float] = (1.0, 1.0)         # sum: its scale at the microbatch's rows and at the batch's
  affine: bool = False                        # sum: plus a term free of the batch
  why: str = ""                               # top: the node and the reason


FREE, NCONST = Value("free"), Value("nconst")


def top(op, why):
  return Value("top", why=f"{op.name} ({op.type}) {why}")


def row(d, k):
  return Value("row", dim=int(d), k=int(k))


def shape(t):
  return tuple(t.shape.as_list()) if t.shape.rank is not None else None


def static(t):
  v = tf.get_static_value(t)
  return None if v is None else np.asarray(v)


_FOLD = {"Prod": np.prod, "Sum": np.sum, "Mul": np.multiply, "RealDiv": np.true_divide, "Div": np.true_divide,
         "Identity": lambda x: x}


def folded(t, depth=8):
  """The value of `t` when it follows from constants and static shapes (a batch-size value: a count of entries
  as a loss divides by it), else None."""
  v = static(t)
  if v is not None or depth == 0:
    return v
  op = t.op
  if op.type == "Cast":
    v = folded(op.inputs[0], depth - 1)
    return None if v is None else v.astype(op.get_attr("DstT").as_numpy_dtype)
  if op.type in ("Prod", "Sum"):
    x, axes = folded(op.inputs[0], depth - 1), static(op.inputs[1])
    return None if x is None or axes is None else np.asarray(
        _FOLD[op.type](x, axis=tuple(np.atleast_1d(axes)), keepdims=op.get_attr("keep_dims")))
  if op.type in _FOLD:
    args = [folded(i, depth - 1) for i in op.inputs]
    return None if any(a is None for a in args) else np.asarray(_FOLD[op.type](*args))
  return None
