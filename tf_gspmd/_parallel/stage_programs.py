"""What an MPMD pipeline's stages are made of: each stage's programs (its forward and backward as gs.functions,
one per layout of the values at its boundaries), and the structures of tensors that travel between stages -- one
layout per tensor, their paths for messages."""

import tensorflow as tf

from tf_gspmd._function import function as gs_function
from tf_gspmd._layout.mesh import P
from tf_gspmd._layout.sharding import Sharding


class StagePrograms:
  """A stage's Python bodies and the gs.functions built from them (one per layout of their boundary values)."""

  def __init__(self, forward, backward, structured):
    self.forward = forward
    self.structured = structured   # the forward, its result in the structure the stage returns it
    self._backward = backward
    self._fns = {}

  def forward_fn(self, stage, n, exchange, last, in_layouts, out_layouts):
    """The forward's gs.function: `in_layouts` per tensor of the input, `out_layouts` per tensor of the result."""
    key = ("F", n, in_layouts, out_layouts)
    if key not in self._fns:
      ins = _per_param(stage.param_shardings, n) + tuple(in_layouts)
      if last:
        ins += (stage.target_sharding,)
      out = P() if last else tuple(out_layouts)
      self._fns[key] = gs_function(self.forward, mesh=stage.mesh, in_shardings=ins, out_shardings=out,
                                   exchange=exchange)
    return self._fns[key]

  def backward_fn(self, stage, n, exchange, with_input_grad, last, accumulate, in_layouts, out_layouts,
                  grad_layouts=()):
    """The backward's gs.function: `in_layouts` per tensor of the input, `out_layouts` per floating-point tensor
    of the result (the gradients it is seeded with), `grad_layouts` per floating-point tensor of the input (the
    gradients it returns for them)."""
    key = ("B", n, accumulate, in_layouts, out_layouts, grad_layouts)
    if key not in self._fns:
      p = _per_param(stage.param_shardings, n)
      seed = (stage.target_sharding,) if last else tuple(out_layouts)
      ins = p + tuple(in_layouts) + seed + (p if accumulate else ())
      outs = p + (tuple(grad_layouts) if with_input_grad else ())

      def body(*args):
        return self._backward(n, accumulate, *args)

      self._fns[key] = gs_function(body, mesh=stage.mesh, in_shardings=ins, out_shardings=outs, exchange=exchange)
    return self._fns[key]


def _per_param(shardings, n):
  if isinstance(shardings, (tuple, list)) and not isinstance(shardings, P):
    return tuple(shardings)
  return (shardings,) * n


def layouts_up_to(structure, spec):
  """`spec`'s layouts, one per tensor of `structure` (a layout where `structure` goes on holding one for every
  tensor below); None where `spec` is no structure of layouts matching `structure`."""
  if spec is None or isinstance(spec, (P, Sharding)):
    return [spec] * count(structure)
  if isinstance(structure, dict) and isinstance(spec, dict) and set(spec) == set(structure):
    parts = [layouts_up_to(structure[k], spec[k]) for k in sorted(structure)]
  elif isinstance(structure, (list, tuple)) and isinstance(spec, (list, tuple)) and len(spec) == len(structure):
    parts = [layouts_up_to(s, p) for s, p in zip(structure, spec)]
  else:
    return None
  return None if any(p is None for p in parts) else [x for p in parts for x in p]


def floating(structure):
  """Per tensor of `structure` (tensors or TensorSpecs), whether it is floating-point: whether a gradient flows
  back through it."""
  return [t.dtype.is_floating for t in tf.nest.flatten(structure)]


def count(structure):
  return len(tf.nest.flatten(structure))


def leaf_paths(structure, prefix=""):
  """A readable path per tensor of `structure`, in tf.nest's flattening order ("" for a lone tensor, "0",
  "skip/1")."""
  if isinstance(structure, dict):
    return [p for k in sorted(structure) for p in leaf_paths(structure[k], f"{prefix}{k}/")]
  if isinstance(structure, (list, tuple)):
    return [p for k, v in enumerate(structure) for p in leaf_paths(v, f"{prefix}{k}/")]
  return [prefix.rstrip("/")]


def paths(structure):
  """Per tensor of `structure`, its path for messages ("" for a lone tensor, else " [0]", " [skip/1]")."""
  return [f" [{p}]" if p else "" for p in leaf_paths(structure)]


def describe(structure):
  """`structure`'s TensorSpecs as "float32[4, 8]" (a structure of them: in its brackets)."""
  text = tf.nest.map_structure(lambda t: f"{t.dtype.name}{t.shape.as_list()}", structure)
  return text if isinstance(text, str) else str(text).replace("'", "")
