"""`gs.variable`: a tf.Variable created sharded, shard by shard, from an initializer whose values depend only on
(seed, element index); shape-only inside `gs.plan_scope()`."""

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd import initializers
from tf_gspmd._layout.mesh import Mesh
from tf_gspmd._layout.plan_scope import in_plan_scope, shape_only_variable
from tf_gspmd._layout.sharding import to_sharding
from tf_gspmd.errors import InputError, SpecError
from tf_gspmd.runtime import state as _state


def _variable_shape(shape, what):
  """`shape` as a tuple of sizes; an int n is (n,), as tf.zeros(n) takes it. InputError for anything else."""
  if isinstance(shape, tf.TensorShape):
    shape = shape.as_list() if shape.rank is not None else None
  elif isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
    shape = (shape,)
  sizes = tuple(shape) if isinstance(shape, (tuple, list, np.ndarray)) else None
  if sizes is None or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in sizes):
    raise InputError(f"{what}: shape {shape!r} is not a shape; give every dimension's size as a whole number >= 0, "
                     f"e.g. shape=(1024, 512) (an int n means (n,))")
  return tuple(int(n) for n in sizes)


def _check_initializer(init, dtype, what):
  """InputError when `init` cannot give values of `dtype`: random values cast to an integer or bool type (mostly
  zeros), or a constant the type cannot hold (TF refuses such a tf.Variable)."""
  if not (dtype.is_floating or dtype.is_complex or dtype.is_integer or dtype.is_bool):
    raise InputError(f"{what}: dtype {dtype.name} is not a number type; give a floating, complex, integer or bool "
                     f"dtype")
  if dtype.is_floating or dtype.is_complex:
    return
  if isinstance(init, (initializers.Uniform, initializers.Normal, initializers.VarianceScaling)):
    raise InputError(f"{what}: initializer {type(init).__name__} draws real numbers, which dtype {dtype.name} would "
                     f"truncate (mostly to 0); give a floating dtype (e.g. dtype=tf.float32), or a constant "
                     f"initializer (e.g. 0 or gs.initializers.Constant(3)) for {dtype.name}")
  if isinstance(init, initializers.Constant):
    v = init.value
    fits = v in (0, 1) if dtype.is_bool else float(v).is_integer() and dtype.min <= v <= dtype.max
    if not fits:
      raise InputError(f"{what}: constant initializer {v!r} is not a {dtype.name} value; give a value the dtype "
                       f"holds, or a floating dtype (e.g. dtype=tf.float32)")


def variable(initializer, shape, dtype=tf.float32, *, mesh, spec, name=None, trainable=True, seed=0):
  """A tf.Variable created sharded, shard by shard: its full value never exists unless read eagerly.

  Args:
    initializer: a `tf_gspmd.initializers` initializer, a Keras initializer (object or name), or a number. A random
      one (uniform, normal, variance scaling) needs a floating or complex dtype; a constant, one the dtype holds.
    shape: the global shape, a sequence of sizes (an int n means (n,), as for tf.zeros); dtype: the element type.
    mesh: the `gs.Mesh` whose devices hold the shards; spec: its layout (`P(...)` or `Sharding`; `P()` replicates).
    name, trainable: as for tf.Variable. seed: used when the initializer has none.

  Values depend only on (seed, element index): the same on every mesh and layout (see `tf_gspmd.initializers`).
  A gs.function that captures the variable uses it in place when it wants this layout. Inside `gs.plan_scope()`
  the variable is shape-only, like every variable created there: no value is computed and nothing is allocated;
  its layout is kept for lowering.

  Raises InputError (a shape, mesh, dtype or initializer that is not one, or does not fit) or SpecError (no spec,
  or one that does not fit the shape or mesh), naming the argument and the fix.
  """
  what = f"gs.variable {name!r}" if name else "gs.variable"
  shape = _variable_shape(shape, what)
  try:
    dtype = tf.as_dtype(dtype)
  except TypeError as e:
    raise InputError(f"{what}: dtype {dtype!r} is not a TF dtype ({e}); give e.g. dtype=tf.float32") from e
  if not isinstance(mesh, Mesh):
    raise InputError(f"{what}: mesh={mesh!r} is not a gs.Mesh; give the mesh whose devices hold the shards, e.g. "
                     f"mesh=gs.Mesh((2, 4), ('data', 'model'))")
  if spec is None:
    raise SpecError(f"{what}: spec=None; give its layout on {mesh}, one entry per dimension of shape "
                    f"{list(shape)}: e.g. spec=gs.P({', '.join(repr(a) for a in mesh.axis_names[:len(shape)])}), or "
                    f"spec=gs.P() to replicate it")
  init = initializers.get(initializer, seed)
  _check_initializer(init, dtype, what)
  sharding = to_sharding(spec, mesh, rank=len(shape), what=name or "variable")
  if in_plan_scope():   # no value and no devices: the mesh may be larger than this machine's
    v = shape_only_variable(shape, dtype, name=name, trainable=trainable)
    _state.record_plan(v, sharding)
    return v
  v = _compat.uninitialized_variable(shape, dtype, name=name, trainable=trainable)
  # pylint: disable-next=protected-access
  v._gspmd_init = lambda p, starts, lengths: init.chunked(shape, starts, lengths, dtype)
  _state.manage(v, sharding, mesh.resolve_devices(), what=name)
  return v
