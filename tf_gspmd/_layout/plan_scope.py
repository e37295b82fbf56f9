"""`gs.plan_scope()`: variables that have a shape and a dtype but no value, for planning models no host holds.

A plan (`gs.function(...).lower(*specs)`) needs the shapes, dtypes and layouts of a step's variables, never their
values. Inside `plan_scope()` every tf.Variable created -- by user code, Keras layers and optimizers (their
variables are tf.Variables on the TensorFlow backend), `tf.Module`s -- is created shape-only: a resource handle
with nothing allocated behind it. An initializer given as a callable is traced, not run, to learn the shape and
dtype it would give; a value given directly (a NumPy array) only lends its shape and dtype. So a 128-billion
parameter Keras model and its Adam slots are built in a few MB and lowered for any mesh.

A shape-only variable has no value to read: an eager read raises InputError naming it, a traced read outside a
gs.function (a plain tf.function) fails when it runs, and calling a gs.function that captures one raises
InputError (lowering it is what the scope is for). `gs.variable` inside the scope is shape-only too, and a layout
given to a shape-only variable (`gs.variable`'s spec, a Keras layout map) is recorded, nothing stored: lowering
pins it as it pins a stored variable's.
"""

import contextlib
import threading

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd._layout.annotations import current_mesh
from tf_gspmd.errors import InputError

_local = threading.local()
_classes = {}


class _ShapeOnly(_compat.ReadHook):
  """Mixin of a shape-only variable: only a gs.function's trace may read it (the read is a symbol there)."""

  def _gspmd_before_read(self):
    if current_mesh() is not None:   # a gs.function's trace: the read is a symbol, lowering never runs it
      return []
    message = (f"variable {self.name!r} was created inside gs.plan_scope(): it has a shape {self.shape} and no "
               f"value; only a gs.function's lowering may read it (create it outside the scope to compute with it)")
    if tf.executing_eagerly():
      raise InputError(message)
    # Another trace (Keras infers a layer's output shape by tracing it; a plain tf.function): it may be traced,
    # and fails if it runs.
    return [tf.debugging.Assert(tf.constant(False), [message], name="gspmd_shape_only_read")]


def in_plan_scope():
  """Whether the current thread is inside `plan_scope()`."""
  return getattr(_local, "depth", 0) > 0


def is_shape_only(v):
  """Whether variable `v` (a tf.Variable, or a Keras variable's storage) was created by `plan_scope()`."""
  inner = _compat.keras_inner_variable(v) if not _compat.is_resource_variable(v) else v
  return isinstance(inner, _ShapeOnly)


def _spec_of(initial_value, dtype, shape):
  """(shape, dtype) a variable created from `initial_value` would have, computing no value."""
  if callable(initial_value):
    if shape is not None and tf.TensorShape(shape).is_fully_defined() and dtype is not None:
      return tf.TensorShape(shape), tf.as_dtype(dtype)
    # Traced, not run: the output's static shape and dtype, whatever size the value would be.
    out = tf.function(initial_value, autograph=False).get_concrete_function().structured_outputs
    if isinstance(out, tf.Variable) or not hasattr(out, "shape"):
      out = tf.convert_to_tensor(out)
    return out.shape, tf.as_dtype(dtype or out.dtype)
  if isinstance(initial_value, (tf.Tensor, tf.Variable, np.ndarray)) or hasattr(initial_value, "shape"):
    return tf.TensorShape(initial_value.shape), tf.as_dtype(dtype or initial_value.dtype)
  value = tf.convert_to_tensor(initial_value, dtype=dtype)   # a Python number or list: small, and typed as TF types it
  return value.shape, value.dtype


def _creator(next_creator, **kwargs):  # pylint: disable=unused-argument
  shape, dtype = _spec_of(kwargs.get("initial_value"), kwargs.get("dtype"), kwargs.get("shape"))
  if not shape.is_fully_defined():
    raise tf.errors.InvalidArgumentError(
        None, None, f"gs.plan_scope(): variable {kwargs.get('name')!r} has shape {shape}, not fully defined; "
        f"give tf.Variable a `shape` (a plan needs every variable's size)")
  return shape_only_variable(tuple(shape.as_list()), dtype.base_dtype, name=kwargs.get("name"),
                             trainable=kwargs.get("trainable", True) is not False)


def shape_only_variable(shape, dtype, name=None, trainable=True):
  """A tf.Variable of `shape` and `dtype` with no value (nothing allocated): what `plan_scope()` creates, also for
  `gs.variable` (whose value, computed shard by shard, would otherwise be computed and thrown away)."""
  v = _compat.uninitialized_variable(tuple(shape), tf.as_dtype(dtype), name=name, trainable=trainable)
  cls = type(v)
  if cls not in _classes:
    _classes[cls] = type(f"ShapeOnly{cls.__name__}", (_ShapeOnly, cls), {"__module__": cls.__module__})
  v.__class__ = _classes[cls]
  return v


@contextlib.contextmanager
def plan_scope():
  """Within it, tf.Variables (Keras's and optimizers' included) are created with a shape and no value.

  Example:
    >>> with gs.plan_scope():
    ...   model = build_keras_model(cfg)          # 128B parameters: nothing allocated
    ...   optimizer.build(model.trainable_variables)
    >>> gs.function(step, mesh=mesh, in_shardings=...).lower(*specs).report
  """
  _local.depth = getattr(_local, "depth", 0) + 1
  try:
    with tf.variable_creator_scope(_creator):
      yield
  finally:
    _local.depth -= 1
