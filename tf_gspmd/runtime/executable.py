"""Runs a per-device program on every mesh device concurrently.

TF's collectives deadlock when several logical devices run them inside one tf.function; TF's
ParallelDevice (DTensor's runtime) instead runs one function per component device on its own thread, which
is what an SPMD program needs. The per-device GraphDef becomes one concrete function (no retracing); the
partition id is a packed per-device input. On CPU devices the lowering also holds the program of every device of
this process as one graph (`DeviceProgram.in_process`, the in_process pass), without collectives in one process and
with one TF collective per collective across processes otherwise: then a step is one call of that function with
every local device's arguments and variable handles, and results keep per-device tensors.
"""

import contextlib
import itertools
import threading
import time

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import cluster as _cluster
from tf_gspmd._platform import compat as _compat
from tf_gspmd._layout.plan_scope import is_shape_only
from tf_gspmd.errors import InputError
from tf_gspmd.runtime import checks as _checks
from tf_gspmd.runtime import host_writes
from tf_gspmd.runtime import parallel
from tf_gspmd.runtime import state as _state
from tf_gspmd.runtime.sharded_tensor import ShardedTensor, shard_host_value

def _function_from_graph_def(graph_def, inputs, outputs):
  """A concrete function of `graph_def` from tensors `inputs` (its Placeholders) to `outputs` (tensor names; op
  names are side effects that must run: the function returns one extra scalar that depends on them), imported
  once into the function's graph: no Python tracing of the program and no copy of it op by op."""
  nodes = {n.name: n for n in graph_def.node}
  specs = []
  for name in inputs:
    attr = nodes[name.split(":")[0]].attr
    shape = tf.TensorShape(attr["shape"].shape) if "shape" in attr else tf.TensorShape(None)
    specs.append(tf.TensorSpec(shape, tf.as_dtype(attr["dtype"].type)))
  tensors = [n for n in outputs if ":" in n]
  side_effects = [n for n in outputs if ":" not in n]
  fed = {"^" + name.split(":")[0] for name in inputs}
  if any(i in fed for n in graph_def.node for i in n.input):   # control edges from inputs: the argument is there
    graph_def = _without_control_inputs(graph_def, fed)

  def body(*args):
    got = tf.graph_util.import_graph_def(graph_def, input_map=dict(zip(inputs, args)),
                                         return_elements=tensors + side_effects, name="program")
    results = list(got[:len(tensors)])
    if side_effects:
      with tf.control_dependencies(got[len(tensors):]):
        results.append(tf.constant(0, name="side_effects_done"))
    return results

  return tf.compat.v1.wrap_function(body, specs)


def _past_identities(graph_def, tensors):
  """`tensors` with each result Identity (the partitioner names every result with one) replaced by what it
  passes on: the function returns that tensor, and each device runs one op fewer per result (a training step
  returns every updated weight and optimizer slot)."""
  nodes = {n.name: n for n in graph_def.node}
  out = []
  for t in tensors:
    name, _, index = t.rpartition(":")
    node = nodes.get(name)
    if index == "0" and node is not None and node.op == "Identity" and len(node.input) == 1 and \
        not node.input[0].startswith("^"):
      source = node.input[0]
      t = source if ":" in source else source + ":0"
    out.append(t)
  return out


def _without_control_inputs(graph_def, control):
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(graph_def)
  for n in out.node:
    if any(i in control for i in n.input):
      kept = [i for i in n.input if i not in control]
      del n.input[:]
      n.input.extend(kept)
  return out


def _process_lost(error, timeout):
  """A step error of a mesh that spans processes, as the process that stopped answering (named by TF's message
  when it says so)."""
  return _cluster.process_lost(
      error, "the step", f"the step's collectives were aborted and this process cannot run collectives again: "
      f"{_cluster.RESTART}", unnamed=f"a process of the mesh (no collective finished within "
      f"collective_timeout={timeout} s, or TF reported the peer gone)")


class _Deadlines:
  """One daemon thread for the process that aborts every pending collective when a running step passes its
  deadline (started on first use; a step arms a deadline and disarms it when it returns)."""

  def __init__(self):
    self._cv = threading.Condition()
    self._due = {}        # token -> (monotonic deadline, timeout)
    self._tokens = itertools.count()
    self._thread = None

  def arm(self, timeout):
    with self._cv:
      token = next(self._tokens)
      self._due[token] = (time.monotonic() + timeout, timeout)
      if self._thread is None:
        self._thread = threading.Thread(target=self._watch, name="tf_gspmd_collective_deadline", daemon=True)
        self._thread.start()
      self._cv.notify()
      return token

  def disarm(self, token):
    with self._cv:
      self._due.pop(token, None)

  def _watch(self):
    while True:
      with self._cv:
        while not self._due:
          self._cv.wait()
        token, (due, timeout) = min(self._due.items(), key=lambda kv: kv[1][0])
        left = due - time.monotonic()
        if left > 0:
          self._cv.wait(left)
          continue
        del self._due[token]
      _compat.abort_collectives(
          tf.errors.DEADLINE_EXCEEDED, f"tf_gspmd: the per-device program did not finish within {timeout} s "
          "(collective_timeout): its collectives were aborted; restart the process to run collectives again")


_DEADLINES = _Deadlines()


class Executable:
  """The imported per-device program of one lowering (a rewriter.program.DeviceProgram), bound to the mesh's
  devices."""

  def __init__(self, program):
    self.program = program
    self.devices = program.devices
    self.local = parallel.local(self.devices)   # this process's devices (all of them in one process)
    self.pd, self.pid = self.local.pd, self.local.pid
    for name, v, _, _ in program.variables:
      if v is None:
        raise InputError("the function captures a resource that is not a tf.Variable (or Keras variable); "
                         "tf_gspmd stores only variables sharded", node=name)
      if is_shape_only(v):
        raise InputError(f"variable {v.name!r} was created inside gs.plan_scope(): it has a shape and no value, so "
                         f"the function can be lowered (`.lower(*specs)`) but not run; create the model outside "
                         f"the scope to run it", node=name)
    self.written = [written for _, _, _, written in program.variables]
    self._fn = None
    self._in_process = None
    self.n_outputs = len(program.outputs)
    # checks the program decides after the step: its verdict is one more output
    self._verdicts = _checks.Verdicts(program.checks, [self.devices[p] for p in self.local.positions],
                                      program.verdict_agreed) if program.checks else None
    self._call_options = None   # the function-call options of every call (see _instantiation)
    self._storages = None   # the storages of the last call
    self._host_writes = host_writes.HostWrites()   # eager writes since the last step, copied into the shards
    # What each call's results are made of, built once (a training step has hundreds of results).
    self._results = [(sharding, tf.TensorShape(shape), tf.as_dtype(dtype))
                     for sharding, shape, dtype in program.results]

  @property
  def fn(self):
    """The per-device program as a concrete function (imported on first use)."""
    if self._fn is None:
      program = self.program
      inputs = [program.partition_id + ":0"] + [n + ":0" for n in program.inputs + program.variable_inputs]
      outputs = _past_identities(program.graph_def, [n + ":0" for n in program.outputs])
      outputs += [program.verdict + ":0"] if program.verdict else []
      # A concrete function straight from the GraphDef (no Python tracing); side-effect ops are control outputs.
      fn = _function_from_graph_def(program.graph_def, inputs, outputs + list(program.side_effects))
      if program.jit == "whole":   # GPU: the per-device program, collectives included, compiled by XLA
        fn = tf.function(fn, jit_compile=True, autograph=False)
      self._fn = fn
    return self._fn

  def _call(self, pid, packed):
    if self.program.jit == "whole":
      return self.fn(pid, *packed)
    # flat call: binding hundreds of arguments to a structured signature costs more than the step
    return _compat.call_flat(self.fn, [pid] + list(packed))

  def place(self, value, sharding, spec, what):
    """An argument as one packed parallel tensor: in place for a matching ShardedTensor (packed once, on its first
    call, and kept with it: a step fed the same value again packs nothing), else scattered (each process takes its
    devices' shards of the global value)."""
    if isinstance(value, ShardedTensor) and value.sharding == sharding:
      if value._packed is None or value._packed[0] is not self.pd:  # pylint: disable=protected-access
        self.components(value, sharding, spec, what)   # checks that it lives on this mesh's devices
      return value.packed_for(self.pd)
    return self.pd.pack(self.components(value, sharding, spec, what))

  def components(self, value, sharding, spec, what, on_devices=True):
    """An argument as this process's per-device tensors (mesh order): a matching ShardedTensor's own, else the
    shards of the global value (host tensors unless `on_devices`)."""
    if isinstance(value, ShardedTensor):
      if value.sharding != sharding:
        raise InputError(f"ShardedTensor {value} is not laid out as {sharding}", node=what)
      if value.positions != self.local.positions or (
          value._mesh_devices != self.devices and tuple(  # pylint: disable=protected-access
              tf.DeviceSpec.from_string(d).to_string() for d in value.devices) != tuple(
                  self.devices[p] for p in self.local.positions)):
        raise InputError(f"ShardedTensor {value} lives on other devices than this mesh's", node=what)
      return value.components
    return self._scatter(value, sharding, spec, on_devices)

  def _scatter(self, value, sharding, spec, on_devices=True):
    """The shards of a global host value, one per local position: one host tensor per distinct tile (devices that
    hold the same tile share it), copied onto each device when `on_devices` (a parallel tensor's components must
    live on their devices; the in-process program takes host tensors and places its arguments itself)."""
    if isinstance(value, tf.Tensor):
      value = value.numpy()
    host = np.asarray(value, dtype=spec.dtype.as_numpy_dtype)
    shape = tuple(spec.shape.as_list())
    positions = self.local.positions
    if sharding.is_maximal or sharding.is_replicated:
      tiles = [()] * len(positions)
    else:
      tiled = sharding.with_rank(len(shape))
      tiles = [tuple(tiled.tile_index(p, d) for d in range(len(shape))) for p in positions]
    made, comps = {}, []
    for p, tile, shard in zip(positions, tiles, shard_host_value(host, sharding, shape, positions)):
      if tile not in made:
        made[tile] = tf.constant(shard)
      if on_devices:
        with tf.device(self.devices[p]):
          comps.append(tf.identity(made[tile]))
      else:
        comps.append(made[tile])
    return comps

  def _instantiation(self):
    """The options every call runs under. When the lowering already ran TF's graph optimizer on the program, TF's
    runtime does not run it again: each call carries one configuration with the optimizer off, made on the first
    call. TF instantiates a function once per configuration a call carries, so every call after the first finds
    the first call's instance (a call under the context's own options would instantiate and optimize it anew)."""
    if not self.program.locally_optimized:
      return contextlib.nullcontext()
    if self._call_options is None:
      self._call_options = _compat.call_options_without_graph_optimizer()
    return _compat.calls_with(self._call_options)

  def run_packed(self, pd, pid, packed):
    """Run the per-device program on the parallel device `pd`, aborting its collectives past the deadline."""
    with self._deadline():
      with tf.device(_compat.parallel_device_name(pd)), self._instantiation():
        return self._call(pid, packed)[:self.n_outputs + (self._verdicts is not None)]

  @contextlib.contextmanager
  def _deadline(self):
    """Aborts the collectives of the step it holds past the program's deadline; an error of a step on a mesh that
    spans processes is the process that stopped answering (ProcessLostError).

    The deadline is kept by one watchdog thread of the process rather than in each collective's own timeout,
    which costs a timer thread per collective per device (thousands per second in a training loop).
    """
    timeout = self.program.collective_timeout
    token = _DEADLINES.arm(timeout)
    try:
      yield
    except tf.errors.OpError as e:
      if self.local.fully_local:
        raise
      raise _process_lost(e, timeout) from e
    finally:
      _DEADLINES.disarm(token)

  def storages(self):
    """The sharded storage of every captured variable (created on first use, in the completed layout)."""
    cached = self._storages
    if cached is not None and all(st._variable()._gspmd_storage is st for st in cached):  # pylint: disable=protected-access
      return cached   # none was laid out anew since the last call
    ip = self.program.in_process   # one graph for every device: the variables it reads in one op stacked
    stacked = ip.stacked if ip is not None else (False,) * len(self.program.variables)
    self._storages = [_state.manage(v, sharding, self.devices, what=name, stacked=kind)
                      for (name, v, sharding, _), kind in zip(self.program.variables, stacked)]
    return self._storages

  def _in_process_fn(self):
    """Every device's program as one multi-device function (`in_process`), imported on first use."""
    if self._in_process is None:
      ip = self.program.in_process
      self._in_process = _function_from_graph_def(ip.graph_def, list(ip.inputs),
                                                  list(ip.outputs) + list(ip.side_effects))
    return self._in_process

  def __call__(self, args):
    program = self.program
    in_process = program.in_process is not None   # one graph for this process's devices
    if in_process:
      flat = [self.components(value, sharding, spec, name, on_devices=False)
              for value, (name, spec, sharding) in zip(args, program.arguments)]
    else:
      flat = [self.place(value, sharding, spec, name) for value, (name, spec, sharding) in zip(args, program.arguments)]
    storages = self.storages()
    positions = self.local.positions
    with _state.holding(storages):   # the variables' shards as one version each, for the whole step
      self._host_writes.before_step(storages)
      if in_process:
        flat = [c for comps in flat for c in comps] + [h for st in storages for h in st.handles()]
        # In one process there are no collectives to time out; across processes TF's, from the first local device.
        with contextlib.nullcontext() if self.local.fully_local else self._deadline(), self._instantiation():
          outs = _compat.call_flat(self._in_process_fn(), flat)
        n = len(positions)
        outs = [dict(components=outs[k * n:(k + 1) * n]) for k in range(self.n_outputs)]
      else:
        flat.extend(st.packed(self.pd) for st in storages)
        if self._verdicts is not None:
          self._verdicts.before_step()
        results = self.run_packed(self.pd, self.pid, flat)
        if self._verdicts is not None:
          self._verdicts.after_step(self.pd.unpack(results.pop()))
        outs = [dict(components=None, packed=(self.pd, out)) for out in results]
      for st, written in zip(storages, self.written):
        st.after_step(written)
    return [ShardedTensor(sharding=sharding, shape=shape, dtype=dtype, devices=self.devices, positions=positions, **out)
            for (sharding, shape, dtype), out in zip(self._results, outs)]
