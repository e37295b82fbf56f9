"""`gs.auto_parallel` of a Keras model as it is: its own variables and optimizer, their state on the stage meshes.

`gs.auto_parallel(model, x, y, optimizer=..., loss=..., mesh=..., microbatches=...)` plans the model's forward
and loss (`model.stateless_call` over its trainable variables, then `loss(y, y_pred)`) as `auto_parallel` plans a
functional step. Each trainable variable is then stored on its home stage's submesh in the layout the plan gives
it there (`StageState.homes`; `runtime/state.manage`: each device holds its tile), and the optimizer's slots are
stored as their variables are. A call `step(x, y)` reads every variable's tiles where they are, runs the planned
pipeline, and applies the optimizer's update per stage as one gs.function on the stage's submesh that captures
that stage's variables and slots (Keras's own update rule, `update_step`, clipping and weight decay per variable);
the optimizer's step count advances once per step. The loss is the one value the step brings to the host.

The variables keep their Python identity: `v.numpy()` reads the current value, and a `tf.train.Checkpoint` of the
model and optimizer saves each variable's tiles as slices of one standard checkpoint, which a plain model of the
same architecture restores.
"""

import importlib

import tensorflow as tf

from tf_gspmd._function import function as gs_function
from tf_gspmd._layout.mesh import P
from tf_gspmd._layout.sharding import to_sharding
from tf_gspmd._platform import cluster as _cluster
from tf_gspmd._platform import compat as _compat
from tf_gspmd.errors import InputError
from tf_gspmd.runtime import state as _state
from tf_gspmd.runtime.sharded_tensor import ShardedTensor


def is_keras_model(obj):
  """Whether `obj` is a Keras model (what `gs.auto_parallel` plans with its own variables and optimizer)."""
  return callable(getattr(obj, "stateless_call", None)) and hasattr(obj, "trainable_variables")


def _check_optimizer(optimizer, name):
  """The optimizer settings a per-stage update cannot honour are refused (InputError)."""
  if optimizer is None or not callable(getattr(optimizer, "update_step", None)):
    raise InputError(f"gs.auto_parallel of Keras model {name!r} needs optimizer=a Keras optimizer (it runs the "
                     f"optimizer's update on each stage's devices; or the model compiled with one); got {optimizer!r}",
                     node="optimizer")
  if getattr(optimizer, "built", False):
    raise InputError(f"the optimizer of {name!r} is built already (its slots exist whole, on the host): give "
                     "gs.auto_parallel an optimizer that has not run yet, which it builds with each slot on its "
                     "variable's stage; restore a saved optimizer state into it after planning (tf.train.Checkpoint)",
                     node="optimizer")
  for attr, why in (("global_clipnorm", "clips by the norm over all variables, which live on different stages"),
                    ("use_ema", "keeps moving averages this update does not maintain"),
                    ("gradient_accumulation_steps", "accumulates gradients across calls"),
                    ("inner_optimizer", "scales the loss (a LossScaleOptimizer)")):
    if getattr(optimizer, attr, None):
      raise InputError(f"the optimizer of {name!r} sets {attr} ({getattr(optimizer, attr)!r}), which "
                       f"{why}: gs.auto_parallel updates each stage's variables on its own devices; use clipnorm "
                       f"or clipvalue (per variable) instead, or no {attr}", node="optimizer")


def _compiled(model, optimizer, loss):
  """(optimizer, loss): those given, else the ones `model.compile` was given (a loss by name as Keras's)."""
  if optimizer is None:
    optimizer = getattr(model, "optimizer", None)
  if loss is None:
    loss = getattr(model, "loss", None)
    if isinstance(loss, str):   # (Keras's function of that name averaged over its entries, as compile does)
      import keras  # pylint: disable=g-import-not-at-top
      per_entry = keras.losses.get(loss)
      loss = lambda y_true, y_pred: keras.ops.mean(per_entry(y_true, y_pred))  # noqa: E731
  return optimizer, loss


def _stored_value(storage):
  """The variable of `storage` as a ShardedTensor of its tiles, each read on its own device (an eager write since
  the last step copied in first)."""
  with storage.lock:
    storage.before_step()
    comps = []
    for p, comp in zip(storage.positions, storage.components):
      with tf.device(storage.devices[p]):
        comps.append(comp.read_value())
  return ShardedTensor(comps, storage.sharding, storage.shape, storage.dtype, devices=storage.devices,
                       positions=storage.positions)


class PlannedModel:
  """A Keras model's training step planned by `gs.auto_parallel` (see the module docstring).

  Attributes:
    step: the AutoParallel of the model's forward and loss (`step.plan`, `step.describe()`, `step.homes`).
    model, optimizer: the user's; variables: the model's trainable variables, in the plan's parameter order.
  """

  def __init__(self, model, optimizer, loss, batch, profile, plan):
    """`plan(loss_fn, param_specs, *batch)` -> the AutoParallel of the step."""
    name = getattr(model, "name", "the model")
    optimizer, loss = _compiled(model, optimizer, loss)
    if profile:
      raise InputError(f"gs.auto_parallel of Keras model {name!r} prices its stages by the calibration: profile=True "
                       "is for a functional step (params given as values); give profile=None or False", node="profile")
    if loss is None or not callable(loss):
      raise InputError(f"gs.auto_parallel of Keras model {name!r} needs loss=a Keras loss or a function "
                       "loss(y_true, y_pred) -> the batch's scalar loss (or the model compiled with one)", node="loss")
    if len(batch) != 2:
      raise InputError(f"gs.auto_parallel of Keras model {name!r} takes the batch as (x, y); got {len(batch)} "
                       "argument(s)", node=name)
    if model.non_trainable_variables:
      raise InputError(f"Keras model {name!r} has non-trainable variables "
                       f"({[v.path for v in model.non_trainable_variables][:3]}...), which a training step updates "
                       "as it runs (BatchNormalization's moving statistics): gs.auto_parallel plans models whose "
                       "state is their trainable variables; use LayerNormalization, or gs.function with a layout",
                       node=name)
    _check_optimizer(optimizer, name)
    if _cluster.process_count() > 1:   # (a variable of another process's stage would read stale here)
      raise InputError(f"gs.auto_parallel of Keras model {name!r} runs in one process: over several processes each "
                       "would hold stale copies of the variables other processes' stages train; plan the functional "
                       "form (gs.auto_parallel(loss_fn, params, ...), step.place, step.adam), which runs there",
                       node=name)
    self.model, self.optimizer = model, optimizer
    self.variables = list(model.trainable_variables)

    def loss_fn(params, x, y):
      y_pred, _ = model.stateless_call(list(params), [], x, training=True)
      return loss(y, y_pred)

    loss_fn.__name__ = name
    specs = [tf.TensorSpec(_compat.keras_variable_shape_dtype(v)[0], v.dtype) for v in self.variables]
    self.step = plan(loss_fn, specs, *batch)
    state = self.step.state
    for n, v in zip(state.param_names, self.variables):
      if n in state.homes:
        self._store(v, *state.homes[n])
    importlib.import_module("tf_gspmd.keras")   # (its hook creates each slot stored as its variable is)
    optimizer.build(self.variables)
    self._updates = {}

  def _store(self, v, k, spec):
    """Variable `v` stored on stage k's submesh in layout `spec` (each device its tile)."""
    mesh = self.step.state.meshes[k]
    shape, _ = _compat.keras_variable_shape_dtype(v)
    _state.manage(_compat.keras_inner_variable(v), to_sharding(spec, mesh, rank=len(shape), what=v.path),
                         mesh.resolve_devices(), what=v.path, stacked=False)

  def _update(self, k):
    """The optimizer's update of the variables that live with stage k, one gs.function on its submesh capturing
    them and their slots: (*gradients in the planned layouts) -> ()."""
    if k not in self._updates:
      state, opt = self.step.state, self.optimizer
      names = [n for n in state.param_names if state.homes.get(n, (None,))[0] == k]
      variables = [self.variables[state.param_names.index(n)] for n in names]

      def update(*grads):
        grads = opt._clip_gradients(list(grads))   # pylint: disable=protected-access  (per variable)
        opt._apply_weight_decay(variables)   # pylint: disable=protected-access
        for g, v in zip(grads, variables):
          opt.update_step(g, v, opt.learning_rate)
          if getattr(v, "constraint", None) is not None:
            v.assign(v.constraint(v))
        return tf.zeros([])

      update.__name__ = f"{opt.name}_update_stage_{k}"
      self._updates[k] = (names, gs_function(update, mesh=state.meshes[k],
                                             in_shardings=tuple(state.homes[n][1] for n in names),
                                             out_shardings=P(), exchange=self.step.exchange))
    return self._updates[k]

  def __str__(self):
    return self.step.describe()

  def __call__(self, x, y):
    """One training step on batch (x, y): the loss (a host scalar); the variables and slots updated in place."""
    state = self.step.state
    # (each variable's current storage: a program run as one graph may have restacked it; read by no stage: whole)
    params = [_stored_value(_state.storage_of(_compat.keras_inner_variable(v))) if n in state.homes
              else tf.convert_to_tensor(v) for n, v in zip(state.param_names, self.variables)]
    loss, grads = self.step(params, x, y)
    grad = dict(zip(state.param_names, grads))
    for k in state.stages():
      names, fn = self._update(k)
      fn(*[grad[n] for n in names])
    self.optimizer.iterations.assign_add(1)
    return loss
