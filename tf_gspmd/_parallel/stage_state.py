"""The training state of a `gs.auto_parallel` step on its stage meshes, its updates there, and what the processes
of a step over several processes agree on (rows, plan, loss).

Each parameter has a home: the submesh of the first stage that reads it, in the layout the plan gives it there.
`StageState.place` puts host values there (each device receives its tile). The step reads a placed parameter in
place (a later stage that reads it too gets its slice device to device, `gs.reshard`) and returns each gradient on
its parameter's home (the gradients of several readers added on the home devices); `sgd` and `Adam` update each
stage's parameters by one gs.function on its submesh, Adam's moments in the parameters' layouts. Nothing of the
state moves to the host.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import cluster as _cluster
from tf_gspmd._function import function as gs_function
from tf_gspmd._layout.mesh import P
from tf_gspmd._layout.sharding import to_sharding
from tf_gspmd.errors import InputError
from tf_gspmd.initializers import get as initializers_get
from tf_gspmd.runtime.cross_mesh import reshard, tile_extent
from tf_gspmd.runtime.parallel import local as parallel_local
from tf_gspmd.runtime.sharded_tensor import ShardedTensor, from_process_local_data, padded


def to_tensor(value):
  """A host value or tensor as a tf.Tensor (a ShardedTensor assembled on the host)."""
  if isinstance(value, ShardedTensor):
    return tf.constant(value.numpy())
  return tf.convert_to_tensor(value)


def check_rows(mesh, name):
  """Over several processes: each row of `mesh` (its last axis) must be one process's devices, so that a stage cut
  within a row runs in one process; InputError naming a row that spans processes."""
  devices, cols = mesh.resolve_devices(), mesh.shape[-1]
  for r in range(len(devices) // cols):
    owners = sorted({_cluster.process_of(d) for d in devices[r * cols:(r + 1) * cols]})
    if len(owners) > 1:
      raise InputError(f"row {r} of the {mesh.shape} mesh (its last axis) spans processes {owners}: over several "
                       "processes each row must be one process's devices, so that every stage runs in one process; "
                       "give a mesh of (processes, devices per process)", node=name)


def _exchange(name):
  """The processes' key-value exchange of the planned step `name`."""
  return _cluster.Exchange(f"the planned step {name!r}", f"its stages cannot go on: {_cluster.RESTART}")


def agree(key, plan, name):
  """Over several processes: checks through the cluster's key-value store (under `key`) that every process planned
  the same stages (each runs its own stages of one plan); InputError when they differ."""
  mine = "; ".join(f"layers {s.layers} on {s.devices} as {s.mesh.shape}: " + ", ".join(
      f"{n} {sh.spec}" for n, sh in s.parameters) for s in plan.stages)
  k = _cluster.process_index()
  ex = _exchange(name)
  ex.publish(f"{key}/plan/{k}", mine, "sharing its plan")
  plans = [ex.lookup(f"{key}/plan/{j}", j, "sharing its plan") for j in range(_cluster.process_count())]
  if len(set(plans)) > 1:
    other = next(j for j, p in enumerate(plans) if p != mine)
    raise InputError(f"gs.auto_parallel planned different stages in process {k} and process {other} ({mine!r} "
                     f"against {plans[other]!r}): every process must plan the same step; give every process the "
                     "same calibration=... (profile=False) and the same arguments", node=name)


def shared_loss(key, loss, last_mesh, dtype, name):
  """The step's loss in every process: the process of the last stage (on `last_mesh`; its `loss` is not None)
  shares it under `key` through the cluster's key-value store."""
  if loss is not None:
    _exchange(name).publish(key, repr(float(loss)), "sharing its loss")
    return loss
  owner = _cluster.process_of(last_mesh.resolve_devices()[0])
  return np.array(float(_exchange(name).lookup(key, owner, "sharing its loss")), dtype.as_numpy_dtype)


def _add(a, b):
  """a + b of two ShardedTensors of one layout on one mesh, each device adding its own tiles."""
  comps = []
  for x, y in zip(a.components, b.components):
    with tf.device(x.device):
      comps.append(x + y)
  return ShardedTensor(comps, a.sharding, a.shape, a.dtype, devices=a._mesh_devices,  # pylint: disable=protected-access
                       positions=a.positions)


class StageState:
  """Where the parameters `param_names` of a planned step live, and their updates.

  Over several processes each process holds the state of its own stages (their submeshes are its devices): a
  parameter whose home is in another process is None here, and its update runs there.

  Attributes:
    homes: {parameter name: (stage index, P)}: the first stage that reads it and the layout it reads it in (a
      parameter no stage reads has none).
    meshes: each stage's submesh; stage_specs: per stage, {parameter name: P} of the parameters it reads; local:
      per stage, whether this process runs it.
  """

  def __init__(self, param_names, param_specs, meshes, stage_specs, exchange):
    self.param_names, self.param_specs = tuple(param_names), dict(param_specs)
    self.meshes, self.stage_specs, self.exchange = list(meshes), stage_specs, exchange
    self.local = [all(_cluster.is_local(d) for d in m.resolve_devices()) for m in self.meshes]
    self.homes = {}
    for k, specs in enumerate(stage_specs):
      for name, spec in specs.items():
        self.homes.setdefault(name, (k, spec))
        home = self.homes[name][0]
        if _cluster.process_of(self.meshes[home].resolve_devices()[0]) != \
            _cluster.process_of(self.meshes[k].resolve_devices()[0]):
          raise InputError(f"parameter {name!r} is read by stages {home} and {k}, which run in different processes: "
                           "a parameter is shared by stages of one process only; keep its readers on one host (a "
                           "mesh row) or untie it", node=name)
    self._updates = {}

  def at_home(self, name, value):
    """`value` (a parameter's value or gradient) as a ShardedTensor on its home stage's submesh in the planned
    layout: in place when it is one, moved there device to device when it is elsewhere (gs.reshard), placed from
    the host otherwise."""
    k, spec = self.homes[name]
    mesh = self.meshes[k]
    if not self.local[k]:
      return None   # (held by the process that runs stage k)
    if isinstance(value, ShardedTensor):
      same = value.sharding == to_sharding(spec, mesh, rank=len(value.shape), what=name)
      return value if same else reshard(value, mesh, spec)
    return from_process_local_data(to_tensor(value).numpy(), mesh, spec)   # (this process holds the whole submesh)

  def for_stage(self, k, name, value):
    """What stage k reads for parameter `name`: a ShardedTensor laid out as stage k reads it (moved device to
    device from its home when the parameter lives with another stage); a host value as it is (the stage's program
    places it; a stage of another process: the parameter's TensorSpec)."""
    if not self.local[k]:
      return self.param_specs[name]
    if not isinstance(value, ShardedTensor):
      return to_tensor(value)
    spec = self.stage_specs[k][name]
    if value.sharding == to_sharding(spec, self.meshes[k], rank=len(value.shape), what=name):
      return value
    return reshard(value, self.meshes[k], spec)

  def gradient(self, name, grads):
    """The gradient of parameter `name` on its home from its readers' `grads` (the home stage's first, laid out
    as the parameter): the others moved there and added on the home devices."""
    total = grads[0]
    for g in grads[1:]:
      total = _add(total, self.at_home(name, g))
    return total

  def place(self, params):
    """`params` (host values) on the devices: each leaf a ShardedTensor on its home stage's submesh in the planned
    layout (each device receives its tile only); what `sgd` and `Adam` return and the step reads in place."""
    leaves = tf.nest.flatten(params)
    return tf.nest.pack_sequence_as(params, [self.at_home(n, v) if n in self.homes else v
                                             for n, v in zip(self.param_names, leaves)])

  def initialize(self, initializers):
    """The parameters (a list in `param_names`' order) created on their homes tile by tile from `initializers`
    (one per parameter, each a gs.initializers Initializer or what `gs.initializers.get` takes: values from (seed,
    global index) alone). Each device of a home builds its own tile: no device and no host holds a parameter it
    does not hold in the plan; the values equal `place` of each initializer's whole value."""
    flat = list(initializers)
    if len(flat) != len(self.param_names):
      raise InputError(f"initialize takes one initializer per parameter ({len(self.param_names)}) or one for all; "
                       f"got {len(flat)}", node="initializers")
    out = []
    for n, init in zip(self.param_names, flat):
      init, spec = initializers_get(init), self.param_specs[n]
      shape = tuple(spec.shape.as_list())
      if n not in self.homes:   # (read by no stage: its whole value, on the host)
        out.append(init(shape, spec.dtype))
        continue
      k, layout = self.homes[n]
      if not self.local[k]:
        out.append(None)   # (held by the process that runs stage k)
        continue
      mesh = self.meshes[k]
      sharding, devices = to_sharding(layout, mesh, rank=len(shape), what=n), mesh.resolve_devices()
      positions, tile = parallel_local(devices).positions, sharding.shard_shape(shape)
      comps = []
      for p in positions:
        starts, lengths = tile_extent(sharding, shape, p)
        with tf.device(devices[p]):
          comps.append(padded(init.chunked(shape, starts, lengths, spec.dtype), tile))
      out.append(ShardedTensor(comps, sharding, shape, spec.dtype, devices=devices, positions=positions))
    return out

  def stages(self):
    """The stages of this process that are home to some parameter."""
    return sorted({k for k, _ in self.homes.values() if self.local[k]})

  def update_function(self, k, kind):
    """(names, program): the update of the parameters that live with stage k as one gs.function on the stage's
    submesh, everything in the parameters' planned layouts. `kind` "sgd": (lr, *params, *grads) -> params;
    "adam": (alpha, b1, b2, eps, *params, *grads, *m, *v) -> (*params, *m, *v); "adam_first": Adam's first step,
    whose moments start at zero (no moments taken)."""
    key = (k, kind)
    if key in self._updates:
      return self._updates[key]
    names = [n for n in self.param_names if self.homes.get(n, (None,))[0] == k]
    specs = tuple(self.homes[n][1] for n in names)
    n = len(names)

    def sgd(lr, *args):
      return tuple(p - tf.cast(lr, p.dtype) * tf.cast(g, p.dtype) for p, g in zip(args[:n], args[n:]))

    def adam(alpha, b1, b2, eps, *args):
      ps, gs_ = args[:n], [tf.cast(g, p.dtype) for g, p in zip(args[n:2 * n], args[:n])]
      if kind == "adam_first":
        ms = [g * tf.cast(1.0 - b1, g.dtype) for g in gs_]
        vs = [tf.square(g) * tf.cast(1.0 - b2, g.dtype) for g in gs_]
      else:
        ms = [m + (g - m) * tf.cast(1.0 - b1, g.dtype) for m, g in zip(args[2 * n:3 * n], gs_)]
        vs = [v + (tf.square(g) - v) * tf.cast(1.0 - b2, g.dtype) for v, g in zip(args[3 * n:], gs_)]
      new = [p - m * tf.cast(alpha, p.dtype) / (tf.sqrt(v) + tf.cast(eps, p.dtype)) for p, m, v in zip(ps, ms, vs)]
      return tuple(new) + tuple(ms) + tuple(vs)

    if kind == "sgd":
      fn, ins, outs = sgd, (P(),) + specs * 2, specs
    else:
      fn, ins, outs = adam, (P(),) * 4 + specs * (2 if kind == "adam_first" else 4), specs * 3
    fn.__name__ = f"{kind}_update_stage_{k}"
    self._updates[key] = (names, gs_function(fn, mesh=self.meshes[k], in_shardings=ins, out_shardings=outs,
                                             exchange=self.exchange))
    return self._updates[key]

  def sgd(self, params, grads, lr):
    """params - lr * grads on each stage's submesh, one program per stage, in `params`' structure: each parameter
    a ShardedTensor on its home stage's devices in the planned layout (a parameter no stage reads is returned as
    it is)."""
    value = dict(zip(self.param_names, tf.nest.flatten(params)))
    grad = dict(zip(self.param_names, tf.nest.flatten(grads)))
    for k in self.stages():
      names, fn = self.update_function(k, "sgd")
      new = fn(tf.constant(lr, tf.float32), *[self.at_home(n, value[n]) for n in names],
               *[self.at_home(n, grad[n]) for n in names])
      value.update(zip(names, new))
    return tf.nest.pack_sequence_as(params, [value[n] for n in self.param_names])


class TrainingState:
  """What a planned step (`AutoParallel`, with its `state` and `_structure`) offers for its training state."""

  @property
  def homes(self):
    """{parameter name: (stage index, P)}: where each parameter lives between steps (`StageState.homes`)."""
    return self.state.homes

  def place(self, params):
    """`params` (host values) on their home stages' devices in the planned layouts (`StageState.place`)."""
    return self.state.place(params)

  def initialize(self, initializers):
    """The parameters created on their home stages' devices, each device building its own tile
    (`StageState.initialize`): `initializers` in `params`' structure, or one for all; returns `params`' structure
    of ShardedTensors, as `place` does, with no whole parameter anywhere it is split."""
    flat = tf.nest.flatten(initializers) if tf.nest.is_nested(initializers) else \
        [initializers] * len(self.state.param_names)
    return tf.nest.pack_sequence_as(self._structure, self.state.initialize(flat))

  def sgd(self, params, grads, lr):
    """params - lr * grads on each stage's submesh, one program per stage (`StageState.sgd`): each parameter
    a ShardedTensor on its home stage's devices in the planned layout; nothing moves to the host."""
    return self.state.sgd(params, grads, lr)

  def adam(self, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """An Adam update for this step's parameters: `opt = step.adam(lr)`, then `params = opt(params, grads)`
    (Keras's Adam). Parameters, gradients and both moments stay on their home stage's devices in the planned
    layouts; each stage's update is one program on its submesh."""
    return Adam(self.state, lr, beta_1, beta_2, epsilon)


class Adam:
  """Keras's Adam over the parameters of a planned step (`AutoParallel.adam`): `params = opt(params, grads)`, each
  stage's update one program on its submesh.

  Attributes:
    iterations: the updates applied; moments: {parameter name: (m, v)}, ShardedTensors on the parameter's home
      stage in its planned layout (empty before the first update).
  """

  def __init__(self, state, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    self.state, self.lr, self.beta_1, self.beta_2, self.epsilon = state, lr, beta_1, beta_2, epsilon
    self.iterations = 0
    self.moments = {}

  def __call__(self, params, grads):
    state = self.state
    value = dict(zip(state.param_names, tf.nest.flatten(params)))
    grad = dict(zip(state.param_names, tf.nest.flatten(grads)))
    if len(value) != len(state.param_names) or len(grad) != len(state.param_names):
      raise InputError(f"Adam updates the step's {len(state.param_names)} parameters; got {len(value)} parameters "
                       f"and {len(grad)} gradients", node="params")
    self.iterations += 1
    b1, b2 = self.beta_1, self.beta_2
    alpha = self.lr * np.sqrt(1.0 - b2 ** self.iterations) / (1.0 - b1 ** self.iterations)
    scalars = [tf.constant(x, tf.float32) for x in (alpha, b1, b2, self.epsilon)]
    first, moments = not self.moments, {}
    for k in state.stages():
      names, fn = state.update_function(k, "adam_first" if first else "adam")
      kept = [] if first else [self.moments[n][0] for n in names] + [self.moments[n][1] for n in names]
      out = fn(*scalars, *[state.at_home(n, value[n]) for n in names], *[state.at_home(n, grad[n]) for n in names],
               *kept)
      m = len(names)
      value.update(zip(names, out[:m]))
      moments.update({n: (a, b) for n, a, b in zip(names, out[m:2 * m], out[2 * m:])})
    self.moments = moments
    return tf.nest.pack_sequence_as(params, [value[n] for n in state.param_names])
