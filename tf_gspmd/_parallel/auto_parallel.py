"""`gs.auto_parallel`: a training step planned at both of Alpa's levels and run as an MPMD pipeline.

`auto_parallel(loss_fn, params, *batch, mesh=..., microbatches=...)` plans the step with `gs.plan_stages`
(operators clustered into layers, stages and submeshes by Alpa's stage program, each stage's intra-operator plan
by the automatic-sharding program) and runs the plan with `gs.mpmd_pipeline`: stage k is the part of the traced
forward that the plan gives it (`StagePlan.stage_function(k)`), a `gs.Stage` on a `gs.Mesh` over the planned
device positions of `mesh`, laid out as its logical mesh, its parameters in their planned layouts.

Boundaries. The data arguments travel as one packed tensor [rows, features] (each argument reshaped to [rows, -1],
all of one dtype): the first stage receives it as its batch and the last as its targets. Between stages k and k+1
travels everything later stages read that stages <= k made (and data arguments the middle stages read) as a tuple
of tensors, each in its own dtype, resharded from the layout the plan gives it in stage k into the layout the plan
gives it in stage k+1 (only the receivers' slices cross); gradients come back for the floating-point ones. A
stage passes on the tensors it received that later stages read.

Over several processes every process plans the same step (the same arguments and calibration; checked) with stages
cut within a mesh row, one process's devices, and runs its own stages (`stage_state`).

The pipeline combines the microbatches' losses and gradients as the step's loss combines the batch rows: their
mean for a mean over the rows, their sum for a sum, as proven from the step's graph
(`rewriter.stages.microbatch_loss`); a loss not proven to be one of them is refused (InputError) unless
microbatches=1. Parameters are `params`' leaves; a step that reads captured tf.Variables is refused (InputError):
a Keras model is planned with its own variables and optimizer by `gs.auto_parallel(model, x, y, ...)`
(`planned_model`).

Training state. Each parameter has a home: the submesh of the first stage that reads it, in the layout the plan
gives it there (`homes`). `place(params)` puts host values there (each device receives its tile), and the step,
`sgd` and `adam` keep them there: the step reads a placed parameter in place (a later stage that reads it too gets
its slice device to device, gs.reshard), returns each gradient on its parameter's home (the gradients of several
readers added on the home devices), and each stage's update (SGD, or Adam with both moments in the parameters'
layouts) is one gs.function on its submesh. The loss is the one value a step brings to the host.
"""

import dataclasses
import itertools
import time
from typing import Any, Dict, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import cluster as _cluster
from tf_gspmd._function import function as gs_function, parse_bytes
from tf_gspmd._layout.mesh import Mesh, P
from tf_gspmd._parallel.mpmd import Stage, mpmd_pipeline
from tf_gspmd._parallel.planned_model import PlannedModel, is_keras_model
from tf_gspmd._parallel.stage_programs import leaf_paths
from tf_gspmd._parallel.stage_state import (StageState, TrainingState, agree, check_rows, shared_loss,
                                            to_tensor as _to_tensor)
from tf_gspmd._parallel.stages import check_mesh, plan_stages
from tf_gspmd.errors import AutoShardingError, InputError
from tf_gspmd.rewriter.stages import microbatch_loss
from tf_gspmd.rewriter.stages.calibrate import call_times
from tf_gspmd.runtime.sharded_tensor import ShardedTensor

_STEPS = itertools.count()   # (every process creates its planned steps in the same order: their keys agree)
_EXACT_IN_FLOAT64 = (tf.int8, tf.int16, tf.int32, tf.uint8, tf.uint16, tf.uint32, tf.bool)


@dataclasses.dataclass(frozen=True)
class _Boundary:
  """What travels from one stage to the next: `refs` (plan tensor names, data argument names), each tensor in its
  own dtype, from its layout in the sending stage (`out_shardings`, a P each, or None where that stage does not
  lay it out: completion decides) into its layout in the receiving stage (`in_shardings`)."""

  refs: Tuple[str, ...]
  specs: Tuple[tf.TensorSpec, ...]
  out_shardings: Tuple[Any, ...]
  in_shardings: Tuple[Any, ...]


def _spec_of(value, what):
  if isinstance(value, tf.TensorSpec):
    return value
  if isinstance(value, ShardedTensor):
    return tf.TensorSpec(value.shape, value.dtype)
  try:
    t = tf.convert_to_tensor(value)
  except (TypeError, ValueError) as e:
    raise InputError(f"{what} is {type(value).__name__}: give a tensor, an array or a tf.TensorSpec ({e})",
                     node=what) from None
  return tf.TensorSpec(t.shape, t.dtype)


def _dense_gradient(p):
  """`p`, its gradient made dense at `p`'s static shape (a gather through a stage function's call gives sparse
  gradients whose dense shape is known only at run time)."""
  shape = p.shape

  @tf.custom_gradient
  def identity(x):
    def grad(g):
      if isinstance(g, tf.IndexedSlices):
        g = tf.math.unsorted_segment_sum(g.values, g.indices, shape[0])
      return tf.reshape(tf.convert_to_tensor(g), shape)
    return tf.identity(x), grad

  return identity(p) if shape.rank else p


def _pack_dtype(specs, what):
  floats = [s.dtype for s in specs if s.dtype.is_floating]
  others = [s.dtype for s in specs if not s.dtype.is_floating]
  bad = [d for d in others if d not in _EXACT_IN_FLOAT64]
  if bad:
    raise InputError(f"{what} carries {bad[0].name} values, which a packed float64 boundary cannot hold exactly; "
                     "keep them in int32 (or move the op that makes them into the stage that reads them)", node=what)
  if others:
    return tf.float64
  return max(floats, key=lambda d: d.size) if floats else tf.float64


class AutoParallel(TrainingState):
  """A training step planned by `gs.auto_parallel`. Call it as `loss, grads = step(params, *batch)`.

  Attributes:
    plan: the StagePlan run (print it: stages, submeshes, layouts, predicted step time, runner-ups); pipelined_plan
      and intra_plan: the pipelined one and the one without a pipeline (None when not priced), the faster run.
    pipeline: the gs.MpmdPipeline running it; stages: its gs.Stage objects.
    param_names: the readable name of each leaf of `params` (tf.nest order); boundaries: what travels between
      consecutive stages; exchange: the stages' gs.functions' ("auto" or "collectives").
    last_seconds: wall time of the last call; loss_reduction: "mean" or "sum", how the microbatches' losses (and
      gradients) combine into the batch's, as proven from the step's graph (`rewriter.stages.microbatch_loss`).
    profiled_rounds: how many plans had their stages timed (`profile`); whole_timings: {layout: seconds} of the
      step without a pipeline as timed, whole_layouts: the layouts `intra_plan` holds ("planned",
      "whole-step automatic" or "data parallel"). `select(plan)` runs the other plan.
  """

  def __init__(self, loss_fn, param_specs, batch_specs, mesh, microbatches, memory_budget, layers, schedule,
               exchange, calibration, plan_kwargs, intra_candidate=True, profile_values=None, profile_rounds=5):
    if _cluster.process_count() > 1:   # (stages within one row: one process's devices)
      check_rows(mesh, getattr(loss_fn, "__name__", "the step"))
      plan_kwargs = dict(plan_kwargs, max_stage_rows=1)   # each stage within one process's row
      intra_candidate = False
    self._key = f"tf_gspmd_auto_parallel_{next(_STEPS)}"
    self._calls = 0
    self._structure = param_specs
    self.microbatches = int(microbatches)
    if self.microbatches < 1:
      raise InputError(f"microbatches={microbatches!r}: give a positive int", node="microbatches")
    flat_params = tf.nest.flatten(param_specs)
    self.param_names = tuple(f"0/{p}" if p else "0" for p in leaf_paths(param_specs))
    self._batch_specs = tuple(batch_specs)
    if not batch_specs:
      raise InputError("auto_parallel needs the step's batch arguments after params (their shapes and dtypes)",
                       node=getattr(loss_fn, "__name__", "the step"))
    rows = batch_specs[0].shape[0] if batch_specs[0].shape.rank else None
    for k, s in enumerate(batch_specs):
      if not s.shape.rank or s.shape[0] != rows or rows % self.microbatches:
        raise InputError(f"batch argument {k + 1} has shape {s.shape.as_list()}: every batch argument needs the "
                         f"batch ({rows} rows) on dim 0, a multiple of microbatches={self.microbatches}",
                         node=str(k + 1))
    micro = [tf.TensorSpec([rows // self.microbatches] + s.shape.as_list()[1:], s.dtype) for s in batch_specs]
    # ("mean" or "sum": how the microbatches' losses make the batch's; refused when neither is proven)
    self.loss_reduction = microbatch_loss.reduction(loss_fn, param_specs, self._batch_specs, self.microbatches)
    self.data_names = tuple(str(k + 1) for k in range(len(batch_specs)))
    self._data_specs = dict(zip(self.data_names, micro))
    if layers is None:
      layers = 8
    self._micro_specs, self._pipe_microbatches = micro, self.microbatches
    self._loss_fn, self._whole = loss_fn, None
    self._devices = mesh.resolve_devices()
    self._schedule, self.exchange, self._flat_specs = schedule, exchange, flat_params
    self.last_seconds = None
    self.profiled_rounds = 0
    self.plan = self.pipeline = None
    self._built = {}   # id(plan) -> (plan, its runtime's attributes): the plans built so far (`select`)

    def pipelined(measured, only=False):
      return plan_stages(loss_fn, param_specs, *micro, mesh=mesh, layers=layers, microbatches=self._pipe_microbatches,
                         memory_budget=memory_budget, calibration=calibration, measured=measured,
                         measured_only=only, **plan_kwargs)

    def intra():   # the alternative without a pipeline: one stage on the whole mesh, the whole batch
      try:
        return plan_stages(loss_fn, param_specs, *batch_specs, mesh=mesh, layers=layers, microbatches=1,
                           memory_budget=memory_budget, calibration=calibration,
                           **dict(plan_kwargs, max_stages=1, whole_mesh=True))
      except AutoShardingError:
        return None   # (the whole batch's activations do not fit the budget)

    self.pipelined_plan = pipelined(None)
    self.intra_plan = intra() if intra_candidate and self.microbatches > 1 else None
    self.whole_layouts, self.whole_timings, self._whole_fn = "planned", {}, None
    if profile_values is not None:
      self._profile(pipelined, profile_values, profile_rounds, memory_budget)
    whole = self.intra_plan
    if _cluster.process_count() > 1:
      agree(self._key, self.pipelined_plan, getattr(loss_fn, "__name__", "the step"))
    self.select(whole if whole is not None and whole.predicted_seconds < self.pipelined_plan.predicted_seconds
                else self.pipelined_plan)
    self._built = {k: v for k, v in self._built.items() if v[0] in (self.pipelined_plan, self.intra_plan)}

  _RUNTIME = ("microbatches", "_data_specs", "_fns", "_loss_ref", "_stage_params", "boundaries", "_data_dtype",
              "stages", "pipeline", "_whole", "state")

  def select(self, plan):
    """Runs `plan` from now on: `step.pipelined_plan` or `step.intra_plan`, e.g. to time the plan the planner
    turned down (each plan's runtime is built once and kept: switching back and forth lowers nothing again)."""
    current = self.plan
    if current is plan:
      return
    if current is not None:
      self._built[id(current)] = (current, {k: getattr(self, k) for k in self._RUNTIME})
    kept = self._built.get(id(plan))
    if kept is not None and kept[0] is plan:
      self.plan = plan
      for k, v in kept[1].items():
        setattr(self, k, v)
      return
    whole = plan is self.intra_plan and plan is not self.pipelined_plan
    self.plan = plan
    self.microbatches = 1 if whole else self._pipe_microbatches
    self._data_specs = dict(zip(self.data_names, self._batch_specs if whole else self._micro_specs))
    self._build(self._flat_specs, self._schedule, self.exchange)
    self._whole = self._whole_step() if whole else None

  def _whole_step(self):
    """The plan without a pipeline as one gs.function on the whole mesh: the loss and every gradient in one
    program, the parameters and the batch in the plan's layouts (no microbatches, no recomputed forward)."""
    if self._whole_fn is not None and self._whole_fn[0] is self.plan:
      return self._whole_fn[1]   # (the one `_time_whole` timed)
    return self._grad_function(self.stages[0].mesh, self._planned_shardings(self.plan.stages[0]))

  def _planned_shardings(self, stage):
    """The P of every parameter leaf, then of every batch argument, as the plan's `stage` lays them out."""
    planned, entering = dict(stage.parameters), dict(stage.inputs)
    return (tuple(planned[n].spec if n in planned else P() for n in self.param_names) +
            tuple(entering[d].spec if d in entering else P() for d in self.data_names))

  def _grad_function(self, mesh, in_shardings):
    """gs.function of (loss, gradient per parameter leaf) of the whole batch on `mesh`; the gradients leave in
    their parameters' layouts."""
    loss_fn, structure, n = self._loss_fn, self._structure, len(self.param_names)

    def step(*args):
      flat = list(args[:n])
      with tf.GradientTape() as tape:
        tape.watch(flat)
        value = loss_fn(tf.nest.pack_sequence_as(structure, flat), *args[n:])
      grads = tape.gradient(value, flat)
      return (value,) + tuple(tf.zeros_like(p) if g is None else tf.convert_to_tensor(g)
                              for g, p in zip(grads, flat))

    step.__name__ = getattr(loss_fn, "__name__", "step")
    outs = None if in_shardings == "auto" else (P(),) + tuple(in_shardings[:n])
    return gs_function(step, mesh=mesh, in_shardings=in_shardings, out_shardings=outs, exchange=self.exchange)

  def _profile(self, pipelined, values, rounds, memory_budget):
    """Alpa's profiling, on the plans the model chooses: each round runs the stages of the current pipelined
    plan alone, one at a time, on their submeshes, records their latency per microbatch and plans again with
    those in place of the model's figures (`stages.with_measured`), until the pipelined plan's stages are all
    measured or `rounds` have run; then the best plan of measured stages alone is kept. The step without a
    pipeline is timed too (`_time_whole`)."""
    params, batch = values
    measured = {}
    for _ in range(rounds):
      plan = self.pipelined_plan
      if all(s.measured for s in plan.stages):
        break
      self.select(plan)
      for s, seconds in zip(plan.stages, self._stage_seconds(params, batch)):
        measured[s.key] = seconds
      self.profiled_rounds += 1
      self.pipelined_plan = pipelined(dict(measured))
    if not all(s.measured for s in self.pipelined_plan.stages):
      self.pipelined_plan = pipelined(dict(measured), only=True)
    if self.intra_plan is not None:
      self._time_whole(params, batch, memory_budget)

  def _time_whole(self, params, batch, memory_budget):
    """The step without a pipeline, timed in three layouts on the whole mesh: the planned one (the layers'
    intra-operator plans), the whole step's own automatic plan (`in_shardings="auto"`: one integer program over
    forward and backward) and data parallel (the batch split over every device, parameters replicated); the
    fastest that fits `memory_budget` (its per-device program's estimated peak) becomes `intra_plan`, its
    layouts and measured step in place of the planned ones (`whole_layouts` names it)."""
    plan = self.intra_plan
    stage = plan.stages[0]
    mesh = Mesh(stage.mesh.shape, stage.mesh.axis_names, devices=[self._devices[p] for p in stage.devices])
    leaves, data = tf.nest.flatten(params), list(batch)
    split = P(tuple(mesh.axis_names))
    variants = [("planned", self._planned_shardings(stage)),
                ("whole-step automatic", "auto"),
                ("data parallel", (P(),) * len(leaves) + (split,) * len(data))]
    budget = parse_bytes(memory_budget, "memory_budget")
    self.whole_timings, best = {}, None
    for name, shardings in variants:
      f = self._grad_function(mesh, shardings)
      low = f.lower(*leaves, *data)
      if shardings == "auto":
        # The layouts it chose, pinned: the program timed and run then returns each gradient in its parameter's
        # layout, where the update on the parameter's home reads it in place.
        f = self._grad_function(mesh, tuple(low.in_shardings))
        low = f.lower(*leaves, *data)
      peak = low.report.memory.peak_bytes
      if budget is not None and peak > budget:
        self.whole_timings[name] = None
        continue
      seconds = float(np.median(call_times(lambda f=f: f(*leaves, *data)[0].numpy(), 3)))   # a typical step
      self.whole_timings[name] = seconds
      if best is None or seconds < best[0]:
        best = (seconds, name, f, list(low.in_shardings), peak)
    if best is None:
      return
    seconds, name, f, shardings, peak = best
    n = len(self.param_names)
    timed = dataclasses.replace(stage, parameters=tuple(zip(self.param_names, shardings[:n])),
                                inputs=tuple(zip(self.data_names, shardings[n:])), seconds=seconds, measured=True,
                                memory_bytes=float(peak))
    self.intra_plan = dataclasses.replace(plan, best=dataclasses.replace(plan.best, stages=(timed,),
                                                                         predicted_seconds=seconds))
    self.whole_layouts, self._whole_fn = name, (self.intra_plan, f)

  def _stage_seconds(self, params, batch, repeats=3):
    """Per stage of the built plan, the seconds per microbatch its forward and backward take when it runs alone
    (the pipeline's stages one at a time; the median of `repeats` steps after a first one that lowers them)."""
    pipe = self.pipeline
    pipe.concurrent = False
    try:
      busy = []
      for k in range(repeats + 1):
        self(params, *batch)
        if k:
          busy.append(pipe.last_run.busy)
    finally:
      pipe.concurrent = True
    return [float(b) / self.microbatches for b in np.median(np.array(busy), axis=0)]

  # ---- building ------------------------------------------------------------------------------------------
  def _build(self, flat_params, schedule, exchange):
    plan = self.plan
    n = len(plan.stages)
    param_spec = dict(zip(self.param_names, flat_params))
    program = plan.program
    captured = [v for v in program.variables if v is not None]
    if captured:
      name = captured[0].name.split(":")[0]
      raise InputError(f"the step reads the tf.Variable {name!r}, which is not a leaf of params: gs.auto_parallel "
                       "runs steps of explicit parameters; pass every variable's value in params", node=name)
    self._fns = [plan.stage_function(k) for k in range(n)]
    self._loss_ref = program.output_refs[0]
    self._loss_dtype = program.ir.info(self._loss_ref).dtype
    reads, self._stage_params = [], []
    for k, (stage, fn) in enumerate(zip(plan.stages, self._fns)):
      unknown = [name for name, _ in stage.parameters if name not in param_spec]
      if unknown:
        raise InputError(f"stage {k} trains {unknown[0]!r}, which is not a leaf of params (a captured trainable "
                         "variable?): pass every trained value in params", node=unknown[0])
      self._stage_params.append(tuple(a for a in fn.inputs if a in param_spec))
      reads.append(set(fn.inputs) - set(self._stage_params[-1]))
    made = [set(fn.outputs) for fn in self._fns]
    reads.append({self._loss_ref})   # the end of the pipeline reads the loss
    info = {r: tf.TensorSpec(program.ir.info(r).shape, program.ir.info(r).dtype) for m in made for r in m}
    info.update(self._data_specs)
    layouts = [dict(s.inputs + s.outputs) for s in plan.stages]
    self.boundaries = []
    for k in range(n - 1):
      later = set().union(*reads[k + 1:])
      have = set().union(*made[:k + 1])
      # (the last stage reads the batch arguments from its targets; the middle ones get them passed on)
      refs = sorted((later & have) | {d for d in self.data_names if d in set().union(*reads[k + 1:n - 1])})
      if refs:
        out = [layouts[k].get(r) for r in refs]
        inn = [layouts[k + 1].get(r) for r in refs]   # (None: stage k+1 only passes it on: replicated)
        self.boundaries.append(_Boundary(tuple(refs), tuple(info[r] for r in refs),
                                         tuple(o.spec if o is not None else None for o in out),
                                         tuple(x.spec if x is not None else P() for x in inn)))
      else:
        raise InputError(f"stage {k + 1} and later read nothing that stages 0..{k} make; the plan's stages do not "
                         "chain", node=f"stage {k}")
    self._data_dtype = self._batch_dtype()
    if _cluster.process_count() > 1:   # (a move between processes needs the sender's layout in both)
      self.boundaries = [dataclasses.replace(b, out_shardings=tuple(P() if o is None else o for o in b.out_shardings))
                         for b in self.boundaries]
    self.stages, specs = [], []
    for k, stage in enumerate(plan.stages):
      sub = Mesh(stage.mesh.shape, stage.mesh.axis_names, devices=[self._devices[p] for p in stage.devices])
      lay = dict(stage.parameters)
      shardings = tuple(lay[name].spec if name in lay else P() for name in self._stage_params[k])
      specs.append(dict(zip(self._stage_params[k], shardings)))
      self.stages.append(Stage(self._stage_body(k), sub, param_shardings=shardings,
                               in_sharding=self.boundaries[k - 1].in_shardings if k else P(),
                               out_sharding=self.boundaries[k].out_shardings if k < n - 1 else None,
                               target_sharding=P() if k == n - 1 else None,
                               name=f"stage {k} (layers {stage.layers[0]}-{stage.layers[1]})"))
    self.state = StageState(self.param_names, dict(zip(self.param_names, flat_params)), [s.mesh for s in self.stages],
                            specs, exchange)
    self.pipeline = mpmd_pipeline(self.stages, microbatches=self.microbatches, schedule=schedule, exchange=exchange,
                                  reduction=self.loss_reduction)

  def _batch_dtype(self):
    dtypes = {s.dtype for s in self._batch_specs}
    if len(dtypes) == 1:
      return dtypes.pop()
    return _pack_dtype(self._batch_specs, "the batch arguments")

  def _unpack_data(self, packed):
    out, col = {}, 0
    for name in self.data_names:
      spec = self._data_specs[name]
      width = int(np.prod(spec.shape[1:]))
      out[name] = tf.cast(tf.reshape(packed[:, col:col + width], spec.shape), spec.dtype)
      col += width
    return out

  def _stage_body(self, k):
    n = len(self.plan.stages)
    fn, names = self._fns[k], self._stage_params[k]
    into = self.boundaries[k - 1] if k else None
    onto = self.boundaries[k] if k < n - 1 else None

    def body(params, h, targets=None):
      env = dict(zip(names, [_dense_gradient(p) for p in params]))
      if k == 0:
        env.update(self._unpack_data(h))
      else:
        env.update(zip(into.refs, h))
      if targets is not None:
        env.update(self._unpack_data(targets))
      arguments = {a: env[a] for a in fn.inputs if a in names or a in self.data_names}
      activations = {a: env[a] for a in fn.inputs if a not in arguments}
      env.update(fn(arguments, activations))
      if onto is None:
        return env[self._loss_ref]
      return tuple(env[r] for r in onto.refs)

    if k == n - 1:
      return lambda params, h, targets: body(params, h, targets)
    return lambda params, h: body(params, h)

  # ---- running -------------------------------------------------------------------------------------------
  def pack_batch(self, *batch):
    """The batch arguments as the pipeline's one [rows, features] tensor (each of the shape it was planned for)."""
    if len(batch) != len(self.data_names):
      raise InputError(f"the step takes {len(self.data_names)} batch argument(s); got {len(batch)}", node="batch")
    parts = []
    for name, b, spec in zip(self.data_names, batch, self._batch_specs):
      t = _to_tensor(b)
      if t.shape != spec.shape:
        rows = spec.shape[0]
        raise InputError(f"batch argument {name} has shape {t.shape.as_list()}; the step was planned for "
                         f"{spec.shape.as_list()} (a batch of {rows} rows, microbatches={self.microbatches} of "
                         f"{rows // self.microbatches}): give batches of that shape, or plan the step again with "
                         "gs.auto_parallel for this one", node=name)
      parts.append(tf.reshape(tf.cast(t, self._data_dtype), [t.shape[0], -1]))
    return tf.concat(parts, axis=1)

  def __call__(self, params, *batch):
    """(loss, grads): the batch's loss (a host scalar, the one value the step brings to the host) and its gradient
    per leaf of `params` (same structure), each a ShardedTensor on the submesh of its parameter's home stage
    (`homes`), laid out as planned there; a parameter read by several stages gets the sum of their gradients,
    added on the home stage's devices. A leaf of `params` may be a host value or a ShardedTensor (kept in place
    on its stage's devices when it is laid out as that stage reads it: what `place`, `sgd` and `adam` return)."""
    leaves = tf.nest.flatten(params)
    if len(leaves) != len(self.param_names):
      raise InputError(f"params has {len(leaves)} leaves; the step was planned with {len(self.param_names)}",
                       node="params")
    value = dict(zip(self.param_names, leaves))
    if self._whole is not None:   # (the gs.function takes host values, tensors and ShardedTensors as they are)
      if len(batch) != len(self.data_names):
        raise InputError(f"the step takes {len(self.data_names)} batch argument(s); got {len(batch)}", node="batch")
      start = time.perf_counter()
      state = self.state
      out = self._whole(*[state.for_stage(0, n, value[n]) if n in state.homes else value[n]
                          for n in self.param_names], *batch)
      self.last_seconds = time.perf_counter() - start
      grads = [state.at_home(n, g) if n in state.homes else g for n, g in zip(self.param_names, out[1:])]
      return out[0].numpy(), tf.nest.pack_sequence_as(self._structure, grads)
    packed = self.pack_batch(*batch)
    args = [tuple(self.state.for_stage(k, n, value[n]) for n in names)
            for k, names in enumerate(self._stage_params)]
    start = time.perf_counter()
    loss, grads = self.pipeline(args, packed, packed)
    self.last_seconds = time.perf_counter() - start
    if _cluster.process_count() > 1:
      self._calls += 1
      loss = shared_loss(f"{self._key}/loss/{self._calls}", loss, self.stages[-1].mesh, self._loss_dtype,
                         getattr(self._loss_fn, "__name__", "the step"))
    per: Dict[str, list] = {}
    for names, gs_ in zip(self._stage_params, grads):
      for name, g in zip(names, gs_ or (None,) * len(names)):
        if g is not None:   # (None: the stage runs in another process)
          per.setdefault(name, []).append(g)
    out = []
    for name, p in zip(self.param_names, leaves):
      got = per.get(name)
      if got:
        out.append(self.state.gradient(name, got))
      elif name in self.homes:   # (its stages run in another process)
        out.append(None)
      else:   # (read by no stage)
        out.append(tf.zeros(self._param_spec(name).shape, self._param_spec(name).dtype))
    return loss, tf.nest.pack_sequence_as(self._structure, out)

  def _param_spec(self, name):
    return self._flat_specs[self.param_names.index(name)]

  def describe(self):
    """The plan and how its stages run (submesh devices, boundaries)."""
    lines = [str(self.plan)]
    if self.whole_timings:
      lines.append("steps timed without a pipeline, whole batch: " + ", ".join(
          f"{k} {v * 1e3:.1f} ms" if v is not None else f"{k} over the memory budget"
          for k, v in self.whole_timings.items()))
    if self._whole is not None:
      lines.append(f"runs as one gs.function on the whole mesh, no pipeline ({self.whole_layouts} layouts): "
                   f"{self.stages[0].mesh}")
      return "\n".join(lines)
    lines.append(f"MPMD stages: {self.microbatches} microbatches, their losses and gradients combined by their "
                 f"{self.loss_reduction}")
    for k, s in enumerate(self.stages):
      lines.append(f"  {s.name}: devices {list(s.mesh.resolve_devices())[0]}..{list(s.mesh.resolve_devices())[-1]} "
                   f"as {s.mesh}, {len(self._stage_params[k])} parameter(s)")
      for name, sh in zip(self._stage_params[k], s.param_shardings):
        lines.append(f"      {name}: {sh}")
    for k, b in enumerate(self.boundaries):
      lines.append(f"  stage {k} -> {k + 1}: {len(b.refs)} tensor(s)")
      for r, spec, out, inn in zip(b.refs, b.specs, b.out_shardings, b.in_shardings):
        lines.append(f"      {r}: {spec.dtype.name}{spec.shape.as_list()} {out} -> {inn}")
    return "\n".join(lines)

  def __str__(self):
    return self.describe()


def auto_parallel(loss_fn, params, *batch, mesh, microbatches, memory_budget=None, layers=None, schedule="1f1b",
                  exchange="auto", calibration=None, intra_candidate=True, profile=None, optimizer=None, loss=None,
                  **plan_kwargs):
  """A training step `loss_fn(params, *batch)` planned automatically (stages, submeshes, intra-operator layouts)
  and run as an MPMD pipeline on `mesh`; or a Keras model's, with its own variables and optimizer:
  `step = gs.auto_parallel(model, x, y, optimizer=..., loss=..., mesh=..., microbatches=...)`, then
  `loss = step(x, y)` (a PlannedModel, `planned_model`).

  Args:
    loss_fn: the forward and loss: loss_fn(params, *batch) -> the batch's scalar loss; with microbatches > 1, a
      mean or a sum over the batch rows of per-row terms (+ terms free of the batch, for a mean), which the
      pipeline's microbatches then combine into exactly (others: InputError naming where the proof stops).
    params: the parameters (a nest of tensors/arrays or tf.TensorSpecs): their shapes and dtypes.
    *batch: the batch arguments of ONE step (tensors/arrays/TensorSpecs with the batch on dim 0).
    mesh: the gs.Mesh the stages are cut from (its last axis is a row).
    microbatches: B: the batch is split into B microbatches (the plan is made for one of them).
    memory_budget: bytes per device (int or "16GiB"), or None.
    layers: how many layers the ops are clustered into (default 8).
    schedule: "1f1b" or "gpipe"; exchange: "auto" or "collectives" (the stages' gs.functions).
    calibration: the planner's Calibration (default: this machine's, measured once).
    intra_candidate: also price the step without a pipeline (one stage on the whole mesh, the whole batch in one
      call, `step.intra_plan`) and run that when it is predicted faster than the pipelined plan
      (`step.pipelined_plan`); `step.microbatches` is then 1. False: always the pipelined plan.
    profile: time the chosen plans' stages on their submeshes and plan again with the measured latencies (Alpa
      profiles its stages; see `AutoParallel._profile`): each round runs one step with the stages one at a time,
      up to 5 rounds. Needs `params` and `batch` as values (not TensorSpecs). Default (None): when they are
      values and `calibration` is not given (an explicit Calibration prices the plan with its constants alone).
    optimizer, loss: of a Keras model only: its Keras optimizer, and loss(y_true, y_pred) -> the batch's loss.
    **plan_kwargs: passed on to gs.plan_stages (max_stages, optimizer_slots, ...).

  Returns an AutoParallel: `loss, grads = step(params, *batch)`; `step.plan` the StagePlan; `step.sgd(...)`,
  `step.adam(lr)`.
  """
  if is_keras_model(loss_fn):   # (params: the model's x; its stages priced by the calibration, not profiled)
    kw = dict(mesh=mesh, microbatches=microbatches, memory_budget=memory_budget, layers=layers, schedule=schedule,
              exchange=exchange, calibration=calibration, intra_candidate=intra_candidate, profile=False)
    return PlannedModel(loss_fn, optimizer, loss, (params,) + batch, profile,
                        lambda fn, specs, *xy: auto_parallel(fn, specs, *xy, **kw, **plan_kwargs))
  if optimizer is not None or loss is not None:   # (a functional step computes its loss, step.adam updates)
    raise InputError("optimizer= and loss= are for a Keras model (gs.auto_parallel(model, x, y, ...)); a functional "
                     "step returns gradients (step.adam(lr) updates them)", node="optimizer" if optimizer else "loss")
  check_mesh(mesh, "gs.auto_parallel")
  param_specs = tf.nest.map_structure(lambda v: _spec_of(v, "params"), params)
  batch_specs = tuple(_spec_of(b, f"batch argument {k + 1}") for k, b in enumerate(batch))
  concrete = not any(isinstance(v, tf.TensorSpec) for v in tf.nest.flatten(params) + list(batch))
  if profile and not concrete:
    raise InputError("profile=True times the plan's stages on real values: give params and the batch as tensors "
                     "or arrays, not tf.TensorSpecs (or profile=False)", node="profile")
  if _cluster.process_count() > 1:
    if profile:
      raise InputError("profile=True times each process's stages apart, and the processes could then plan "
                       "differently: over several processes give every process the same calibration=... and "
                       "profile=False", node="profile")
    profile = False
  if profile is None:
    profile = concrete and calibration is None
  return AutoParallel(loss_fn, param_specs, batch_specs, mesh, microbatches, memory_budget, layers, schedule,
                      exchange, calibration, plan_kwargs, intra_candidate,
                      profile_values=(params, batch) if profile else None)
