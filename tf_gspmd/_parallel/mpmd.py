"""`gs.mpmd_pipeline`: a pipeline of different stages on different submeshes (MPMD, as Alpa's runtime).

Each stage is its own program: a `gs.function` partitioned over the stage's submesh, from the stage's
parameters and the activations of the previous stage to its activations (the last stage: to the loss).
Between stages, activations (forward) and their gradients (backward) move by cross-mesh resharding
(`runtime.cross_mesh`): each device of the receiving submesh gets exactly its slice.

Backward by recomputation (GPipe's rematerialization): a stage keeps only the input of each microbatch it has run
forward and not yet backward; its backward program runs the stage's forward again under a GradientTape and
returns the parameter gradients (added to the microbatches' sum so far, on the stage's devices, laid out like the
parameters) and the gradient of its input. So the activations alive in a stage are counted in microbatch
inputs, and a stage's backward costs one more forward.

Schedules (per stage, the order its program runs microbatches): "gpipe": every forward, then every backward;
"1f1b": stage i runs min(S - i - 1, B) forwards (warm-up), then alternates one forward and one backward, then
the remaining backwards, so at most S - i microbatch inputs are alive in stage i (B of them under GPipe).

Stages run concurrently: one dispatch thread per stage runs its stage's order, each step waiting for the
activation (or gradient) it needs from the neighbouring stage; the submeshes must then be disjoint.
`concurrent=False` runs the same per-stage orders from one thread (a step is taken by the first stage, in stage
order, whose next input is ready), where submeshes may share devices.

Across processes (`gs.initialize`): every process builds the same pipeline and calls it with the same
arguments; each runs the stages whose submeshes are its own devices (a stage's submesh lies in one process).
At a boundary between processes the activations and gradients go as point-to-point sends of the receivers'
slices (the sender does not wait for them), and the sending stage must declare its `out_sharding`, the layout
both processes plan the move from. The loss is returned in the process of the last stage (None elsewhere), and
each process gets the gradients of its own stages (None for the others).
"""

import dataclasses
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import cluster as _cluster
from tf_gspmd._layout.mesh import Mesh, P
from tf_gspmd._layout.schedule import Schedule
from tf_gspmd._layout.sharding import to_sharding
from tf_gspmd.errors import InputError, MeshError, ShardingError
from tf_gspmd._parallel.stage_programs import (StagePrograms, count as _count, describe as _describe, floating,
                                               layouts_up_to, paths as _paths)
from tf_gspmd.runtime import cross_mesh
from tf_gspmd.runtime.sharded_tensor import ShardedTensor

SCHEDULES = ("gpipe", "1f1b")
WAIT_SECONDS = 600.0   # a stage waiting longer than this for its neighbour's value fails the step


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage of an MPMD pipeline.

  Attributes:
    fn: fn(params, h) -> activations (a tensor, or any nested structure of tensors: a skip connection's pair, a
      dict; integer tensors, such as a router's indices, travel forward without a gradient), or for the last
      stage fn(params, h, targets) -> scalar loss (or fn(params, h) -> outputs when the pipeline has a
      `loss_fn`). `params` is the tuple of the stage's parameter tensors; `h` is the microbatch (stage 0) or the
      previous stage's activations, in the structure that stage returned them.
    mesh: the stage's submesh (a `gs.Mesh` over some of the devices).
    param_shardings: one `P`/`Sharding` per parameter (None: completion decides), or one for all.
    in_sharding: the layout of `h` on the stage's mesh (default: replicated), one for every tensor of `h` or a
      structure of layouts matching it; each tensor of the previous stage's activations is resharded into its own.
    out_sharding: the layout of the activations the stage returns (default: completion decides), one for every
      tensor or a structure matching them.
    target_sharding: last stage: the layout of the targets (default: completion decides).
    name: for messages (default "stage <i>").
  """

  fn: Callable
  mesh: Mesh
  param_shardings: Any = None
  in_sharding: Any = None
  out_sharding: Any = None
  target_sharding: Any = None
  name: Optional[str] = None

  def __post_init__(self):
    if not callable(self.fn):
      raise InputError(f"Stage(fn, mesh): fn must be the stage's function; got {self.fn!r:.60}", node="fn")
    if not isinstance(self.mesh, Mesh):
      raise MeshError(f"Stage(fn, mesh): mesh must be the stage's gs.Mesh (a submesh of the devices); got "
                      f"{self.mesh!r:.60}", node="mesh")


def schedule_order(schedule, num_stages, microbatches):
  """Per stage, the order its program runs: a list of ("F" | "B", microbatch) for each stage (`Schedule.order`)."""
  if schedule not in SCHEDULES:
    raise InputError(f"schedule={schedule!r}: give one of {SCHEDULES}", node="schedule")
  return Schedule(schedule, num_stages, microbatches).orders()


@dataclasses.dataclass
class RunRecord:
  """What one pipeline step did.

  Attributes:
    order: per stage, the ("F" | "B", microbatch) steps in the order the stage ran them.
    peak_alive: per stage, the most microbatch inputs it held at once (kept from a forward for its backward).
    transfers: the cross-mesh moves' `TransferLog` (activations forward, gradients backward).
    seconds: wall time of the step; busy: per stage, seconds its programs ran (moves to the next stage
      included); spans: per stage, (kind, microbatch, start, end) seconds since the step began.
      sum(busy) / seconds > 1 means stages ran at the same time.
  """

  order: list
  peak_alive: list
  transfers: cross_mesh.TransferLog
  seconds: float = 0.0
  busy: list = dataclasses.field(default_factory=list)
  spans: list = dataclasses.field(default_factory=list)


class _Mailbox:
  """Values handed between stage threads, keyed ("act"|"grad", stage, microbatch); waits fail once the step has
  failed elsewhere or after WAIT_SECONDS."""

  def __init__(self):
    self._values = {}
    self._cv = threading.Condition()
    self.failed = None

  def put(self, key, value):
    with self._cv:
      self._values[key] = value
      self._cv.notify_all()

  def ready(self, key):
    with self._cv:
      return key in self._values

  def take(self, key, what):
    deadline = time.monotonic() + WAIT_SECONDS
    with self._cv:
      while key not in self._values:
        if self.failed is not None:
          raise _Aborted()
        left = deadline - time.monotonic()
        if left <= 0:
          raise InputError(f"{what} waited {WAIT_SECONDS:.0f} s for {key[0]} of microbatch {key[2]} from stage "
                           f"{key[1]}; that stage did not produce it")
        self._cv.wait(min(left, 1.0))
      return self._values.pop(key)

  def fail(self, error):
    with self._cv:
      if self.failed is None:
        self.failed = error
      self._cv.notify_all()


class _Aborted(Exception):
  """A stage thread stops because another stage failed (that error is raised)."""


_first_calls = threading.Lock()   # a program's first call for an argument signature (its lowering) runs alone


class MpmdPipeline:
  """A training step pipelined over stages on submeshes. Create with `gs.mpmd_pipeline`.

  Call it as `loss, grads = pipe(params, batch, targets)`: `params[i]` is the tuple of stage i's parameters
  (arrays, tf.Tensors or ShardedTensors on stage i's mesh); `batch` and `targets` (host values) have the batch
  on dim 0 and are split into the microbatches. Returns the loss (the mean of the microbatch losses, or their sum
  with reduction="sum"; a numpy scalar) and, per stage, the tuple of its parameters' gradients (ShardedTensors on
  its mesh laid out like the parameters): the gradients of that loss. `last_run` is the step's `RunRecord`. Over
  several processes, the loss is None except in the process of the last stage, and a stage that runs in another
  process has None in place of its gradients.
  """

  def __init__(self, stages, microbatches, schedule="1f1b", loss_fn=None, concurrent=True, exchange="auto",
               reduction="mean"):
    stages = tuple(stages)
    if not stages or not all(isinstance(s, Stage) for s in stages):
      raise InputError("mpmd_pipeline needs a non-empty sequence of gs.Stage(fn, mesh, ...)", node="stages")
    if not isinstance(microbatches, int) or microbatches < 1:
      raise InputError(f"microbatches={microbatches!r}: give a positive int", node="microbatches")
    schedule_order(schedule, len(stages), 1)
    if exchange not in ("auto", "collectives"):
      raise InputError(f"exchange={exchange!r}: give 'auto' or 'collectives'", node="exchange")
    if reduction not in ("mean", "sum"):
      raise InputError(f"reduction={reduction!r}: give 'mean' (the batch's loss is the mean of the microbatches' "
                       "losses) or 'sum' (their sum)", node="reduction")
    self.reduction = reduction
    self.stages = stages
    self.microbatches = microbatches
    self.schedule = schedule
    self.loss_fn = loss_fn
    self.concurrent = bool(concurrent)
    self.exchange = exchange
    for i, s in enumerate(stages):
      if not isinstance(s.mesh, Mesh):
        raise MeshError(f"{self._name(i)} has mesh={s.mesh!r}; give each stage a gs.Mesh (its submesh)",
                        node=self._name(i))
    if self.concurrent:
      _check_disjoint(stages, self._name)
    self._local = [_stage_is_local(s.mesh, self._name(i)) for i, s in enumerate(stages)]
    if not self.concurrent and not all(self._local):
      raise InputError("stages in other processes run with concurrent=True only (one dispatch thread per stage)",
                       node="concurrent")
    self._programs = [self._build(i) for i in range(len(stages))]
    self._checked = {}   # argument signature -> each stage's activations (TensorSpec)
    self._seen = set()
    self.last_run = None

  def _name(self, i):
    return self.stages[i].name or f"stage {i}"

  def _build(self, i):
    """The stage's programs: forward, backward (first microbatch), backward adding to the gradients so far."""
    stage, last = self.stages[i], i == len(self.stages) - 1
    loss_fn, scale = self.loss_fn, 1.0 / self.microbatches if self.reduction == "mean" else 1.0

    def run(params, h, targets):
      if not last:
        return stage.fn(params, h)
      return loss_fn(stage.fn(params, h), targets) if loss_fn is not None else stage.fn(params, h, targets)

    def unpack(args, k):   # (params, h packed in its structure, the rest) of a program's flat arguments
      n = len(args) - k - (1 if last else 0)
      leaves = args[n:n + k]
      return tuple(args[:n]), tf.nest.pack_sequence_as(self._in_structure[i], list(leaves)), args[n + k:]

    def structured(*args):   # the activations (or loss) in the structure the stage returns them
      params, h, rest = unpack(args, _count(self._in_structure[i]))
      return run(params, h, rest[0] if last else None)

    def forward(*args):
      y = structured(*args)
      return y if last else tuple(tf.nest.flatten(y))

    def backward(n, accumulate, *args):
      # (gradients flow through the floating-point tensors of the boundaries only: `floating`)
      k, k_out = _count(self._in_structure[i]), 1 if last else sum(floating(self._acts[i]))
      params, leaves = tuple(args[:n]), list(args[n:n + k])
      seeds, acc = list(args[n + k:n + k + k_out]), args[n + k + k_out:] if accumulate else ()
      differentiable = [x for x, f in zip(leaves, floating(self._in_structure[i])) if f] if i > 0 else []
      with tf.GradientTape() as tape:
        tape.watch(params)
        tape.watch(differentiable)
        y = run(params, tf.nest.pack_sequence_as(self._in_structure[i], leaves), seeds[0] if last else None)
        ys = [y * scale] if last else [t for t, f in zip(tf.nest.flatten(y), floating(self._acts[i])) if f]
      sources = list(params) + differentiable
      grads = tape.gradient(ys, sources, output_gradients=None if last else seeds,
                            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      grads_p = [g + a for g, a in zip(grads[:n], acc)] if accumulate else list(grads[:n])
      return tuple(grads_p) + tuple(grads[n:])

    return StagePrograms(forward, backward, structured)

  # ---- checks -------------------------------------------------------------------------------------------
  def _check(self, params, batch, targets):
    """Shapes and boundaries, once per argument signature: InputError naming the stage, tensor and fix."""
    key = (tuple(tuple((tuple(v.shape), str(v.dtype)) for v in p) for p in params), tuple(batch.shape),
           str(batch.dtype), None if targets is None else (tuple(targets.shape), str(targets.dtype)))
    if key in self._checked:
      self._acts, self._in_structure = self._checked[key]
      return
    n, b = len(self.stages), self.microbatches
    if len(params) != n:
      raise InputError(f"params has {len(params)} entries for {n} stages; give one tuple of parameters per stage",
                       node="params")
    rows = batch.shape[0] if batch.shape.rank else None
    if rows is None or rows % b:
      raise InputError(f"the batch of shape {batch.shape.as_list()} does not split into microbatches={b}: dim 0 "
                       f"({rows}) must be a multiple of {b}; change the batch size or the number of microbatches",
                       node="batch")
    if targets is None:
      raise InputError(f"the last stage ({self._name(n - 1)}) needs targets: call pipe(params, batch, targets)",
                       node="targets")
    if not targets.shape.rank or targets.shape[0] != rows:
      raise InputError(f"targets of shape {targets.shape.as_list()} do not match the batch's {rows} rows on dim 0",
                       node="targets")
    h = tf.TensorSpec([rows // b] + batch.shape.as_list()[1:], batch.dtype)
    t = tf.TensorSpec([rows // b] + targets.shape.as_list()[1:], targets.dtype)
    acts, self._in_structure = [], [None] * n
    for i in range(n):
      last = i == n - 1
      if not last and self._local[i] != self._local[i + 1] and self.stages[i].out_sharding is None:
        raise InputError(f"{self._name(i)} and {self._name(i + 1)} run in different processes: give "
                         f"{self._name(i)} an out_sharding (both processes must know the layout its activations "
                         "travel in)", node=self._name(i))
      p_specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in params[i])
      self._check_shardings(i, p_specs, h)
      self._in_structure[i] = h
      try:
        out = tf.function(self._programs[i].structured, autograph=False).get_concrete_function(
            *p_specs, *tf.nest.flatten(h), *((t,) if last else ())).structured_outputs
      except ShardingError:
        raise
      except (TypeError, ValueError, tf.errors.InvalidArgumentError) as e:
        came = "the microbatch" if i == 0 else f"the activations {self._name(i - 1)} returns"
        raise InputError(f"{self._name(i)} cannot run on {came}, {_describe(h)}: {_first_line(e)}; make "
                         f"{self._name(i - 1) if i else 'the batch'}'s output match what {self._name(i)} takes "
                         "(structure, shape and dtype), or move the layer that differs to the other side of the "
                         "boundary", node=self._name(i)) from None
      h = self._checked_output(i, out)
      acts.append(h)
    self._acts = acts
    self._checked[key] = (acts, self._in_structure)

  def _checked_output(self, i, out):
    """The TensorSpecs (in their structure) of what stage i returns; InputError for what a stage cannot return."""
    if i == len(self.stages) - 1:
      if not isinstance(out, tf.Tensor) or out.shape.rank != 0:
        got = f"shape {out.shape.as_list()}" if isinstance(out, tf.Tensor) else type(out).__name__
        raise InputError(f"the last stage ({self._name(i)}) returns {got}; it must return the microbatch's scalar "
                         "loss (reduce it, e.g. tf.reduce_mean), or give loss_fn", node=self._name(i))
      return tf.TensorSpec(out.shape, out.dtype)
    leaves = tf.nest.flatten(out)
    if not leaves or not all(isinstance(t, tf.Tensor) for t in leaves):
      raise InputError(f"{self._name(i)} returns {type(out).__name__}; a stage returns its activations: a tensor or "
                       "a nested structure (tuple, list, dict) of tensors", node=self._name(i))
    if not any(t.dtype.is_floating for t in leaves):
      raise InputError(f"{self._name(i)} returns no floating-point activations ({_describe(out)}); gradients flow "
                       "back through floating-point activations only (integers travel forward without one): end "
                       "the stage after an op with a float result", node=self._name(i))
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), out)

  def _check_shardings(self, i, p_specs, h):
    stage = self.stages[i]
    raw = stage.param_shardings
    if isinstance(raw, (tuple, list)) and not isinstance(raw, P) and len(raw) != len(p_specs):
      raise InputError(f"{self._name(i)} has {len(p_specs)} parameters but {len(raw)} param_shardings; give one "
                       "per parameter (or one for all)", node=self._name(i))
    for path, spec, layout in zip(_paths(h), tf.nest.flatten(h), self._layouts(stage.in_sharding, h, P(), i, "in")):
      try:
        to_sharding(layout, stage.mesh, rank=spec.shape.rank, what=f"{self._name(i)} input{path}")
      except ShardingError as e:
        raise type(e)(f"the boundary into {self._name(i)}: its in_sharding does not fit the {spec.shape.rank}-D "
                      f"activations{path} {spec.shape.as_list()} it receives: {e.message}; give an in_sharding of "
                      "that rank", node=self._name(i)) from None

  def _layouts(self, spec, structure, default, i, which):
    """One layout per tensor of `structure`: `spec` for all (a P, a Sharding, or None: `default`), or a structure
    of them matching `structure` (stage i's `which`_sharding), a layout there standing for every tensor below it."""
    flat = layouts_up_to(structure, spec)
    if flat is None:
      raise InputError(f"{self._name(i)}'s {which}_sharding {spec!r} does not match the structure of its "
                       f"activations {_describe(structure)}: give one layout for all, or one per tensor in that "
                       "structure", node=self._name(i))
    return tuple(default if s is None else s for s in flat)

  def _in_layouts(self, i):
    """The layouts stage i takes each tensor of its input in."""
    return self._layouts(self.stages[i].in_sharding, self._in_structure[i], P(), i, "in")

  # ---- a step -------------------------------------------------------------------------------------------
  def __call__(self, params, batch, targets=None):
    params = [tuple(p) for p in params]
    batch = tf.convert_to_tensor(batch.numpy() if isinstance(batch, ShardedTensor) else batch)
    if targets is not None:
      targets = tf.convert_to_tensor(targets.numpy() if isinstance(targets, ShardedTensor) else targets)
    self._check(params, batch, targets)
    n, b = len(self.stages), self.microbatches
    micro = tf.split(batch, b)
    micro_t = tf.split(targets, b)
    orders = [o if self._is_local(i) else [] for i, o in enumerate(schedule_order(self.schedule, n, b))]
    t0 = time.perf_counter()
    box = _Mailbox()
    record = RunRecord([[] for _ in range(n)], [0] * n, cross_mesh.TransferLog(), busy=[0.0] * n,
                       spans=[[] for _ in range(n)])
    losses, grads = [None] * b, [None] * n
    step = self._step_function(params, micro, micro_t, t0, box, record, losses, grads)
    if self.concurrent:
      self._run_threads(orders, step, box)
    else:
      self._run_sequential(orders, step, box)
    cross_mesh.wait_for_sends()
    record.seconds = time.perf_counter() - t0
    self.last_run = record
    if losses[0] is None:   # the last stage runs in another process
      return None, [None if g is None else tuple(g) for g in grads]
    combine = np.mean if self.reduction == "mean" else np.sum
    loss = combine([np.float64(l.numpy()) for l in losses]).astype(losses[0].dtype.as_numpy_dtype)
    return loss, [None if g is None else tuple(g) for g in grads]

  def _step_function(self, params, micro, micro_t, t0, box, record, losses, grads):
    """step(i, kind, m): stage i runs its forward ("F") or backward ("B") of microbatch m of `micro` (`micro_t`).

    A forward's loss goes to `losses[m]`, a backward's parameter gradients (summed over the microbatches so far) to
    `grads[i]`; activations and gradients travel to the neighbouring stages through `box` (or to other processes),
    and each run is timed (from `t0`) in `record`.
    """
    n = len(self.stages)
    log = _Locked(record.transfers, threading.Lock())
    out_layout = [None] * n   # the layout each stage's forward returned its activations in
    local = [self._is_local(i) for i in range(n)]
    saved_inputs = [{} for _ in range(n)]   # per stage: microbatch -> its input, kept from F for B
    layout_out, pass_on, receive = self._stage_links(box, log, out_layout, local)

    def forward(i, m):   # returns when the stage's computation started
      s, prog, last = self.stages[i], self._programs[i], i == n - 1
      saved = saved_inputs[i]
      h = (micro[m],) if i == 0 else receive("act", i, m, i - 1, layout_out(i - 1) if not local[i - 1] else None,
                                             self._in_layouts(i))
      saved[m] = h
      record.peak_alive[i] = max(record.peak_alive[i], len(saved))
      start = time.perf_counter()
      y = self._call(prog.forward_fn(s, len(params[i]), self.exchange, last, self._in_layouts(i),
                                     None if last else self._layouts(s.out_sharding, self._acts[i], None, i, "out")),
                     params[i] + h + ((micro_t[m],) if last else ()))
      if last:
        losses[m] = y
      else:
        y = tuple(y) if isinstance(y, (tuple, list)) else (y,)
        out_layout[i] = tuple(t.sharding for t in y)
        pass_on("act", i + 1, m, y, self._in_layouts(i + 1))
      return start

    def backward(i, m):   # returns when the stage's computation started
      s, prog, last = self.stages[i], self._programs[i], i == n - 1
      saved = saved_inputs[i]
      seed = (micro_t[m],) if last else receive("grad", i, m, i + 1, self._differentiable(i, self._in_layouts(i + 1)),
                                                self._differentiable(i, layout_out(i)))
      h = saved.pop(m)
      start = time.perf_counter()
      acc = grads[i] is not None
      fn = prog.backward_fn(s, len(params[i]), self.exchange, i > 0, last, acc, self._in_layouts(i),
                            None if last else self._differentiable(i, out_layout[i]),
                            self._differentiable(i - 1, self._in_layouts(i)) if i else ())
      out = self._call(fn, params[i] + h + seed + (tuple(grads[i]) if acc else ()))
      out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
      grads[i] = out[:len(params[i])]
      if i > 0:
        pass_on("grad", i - 1, m, out[len(params[i]):], self._differentiable(i - 1, layout_out(i - 1)))
      return start

    def step(i, kind, m):
      start = forward(i, m) if kind == "F" else backward(i, m)
      end = time.perf_counter()
      record.busy[i] += end - start
      record.spans[i].append((kind, m, start - t0, end - t0))
      record.order[i].append((kind, m))

    return step

  def _stage_links(self, box, log, out_layout, local):
    """(layout_out, pass_on, receive): how activations and gradients move between stages in a step.

    `out_layout[i]` caches stage i's activations' layout, `local[i]` says whether stage i runs in this process;
    moves within it go through `box`, and every cross-mesh move is logged in `log`.
    """
    def layout_out(i):   # stage i's activations' layouts (declared where stage i runs in another process)
      if out_layout[i] is None:
        s = self.stages[i]
        out_layout[i] = tuple(to_sharding(layout, s.mesh, rank=spec.shape.rank) for spec, layout in zip(
            tf.nest.flatten(self._acts[i]), self._layouts(s.out_sharding, self._acts[i], None, i, "out")))
      return out_layout[i]

    def pass_on(kind, j, m, values, layouts):   # to stage j: cross-mesh moves (sends only, to another process)
      if local[j]:
        box.put((kind, j, m), tuple(cross_mesh.reshard(v, self.stages[j].mesh, layout, log=log)
                                    for v, layout in zip(values, layouts)))
      else:
        for v, layout in zip(values, layouts):
          cross_mesh.reshard(v, self.stages[j].mesh, layout, log=log, wait=False)

    def receive(kind, i, m, j, src_layouts, dst_layouts):   # stage i's input from stage j
      if local[j]:
        return box.take((kind, i, m), self._name(i))
      got, acts = [], tf.nest.flatten(self._acts[min(i, j)])
      if kind == "grad":   # (the gradients of the floating-point activations only)
        acts = self._differentiable(min(i, j), acts)
      for act, src, dst in zip(acts, src_layouts, dst_layouts):
        elsewhere = cross_mesh.value_elsewhere(act.shape, act.dtype, self.stages[j].mesh, src)
        # (wait=False: a receive sends nothing, and must not wait for this process's other stages' sends)
        got.append(cross_mesh.reshard(elsewhere, self.stages[i].mesh, dst, log=log, wait=False))
      return tuple(got)

    return layout_out, pass_on, receive

  def _differentiable(self, i, per_tensor):
    """Of `per_tensor` (one entry per tensor of stage i's activations), those of its floating-point tensors: the
    ones gradients flow back through."""
    return tuple(x for x, f in zip(per_tensor, floating(self._acts[i])) if f)

  def _is_local(self, i):
    return self._local[i]

  def _call(self, fn, args):
    """`fn(*args)`; the first call of a signature (which lowers the program) holds a lock, so lowering never
    runs in two stage threads at once."""
    key = (id(fn),) + tuple((tuple(a.shape), str(a.dtype), getattr(a, "sharding", None)) for a in args)
    if key in self._seen:
      return fn(*args)
    with _first_calls:
      out = fn(*args)
    self._seen.add(key)
    return out

  def _run_threads(self, orders, step, box):
    def worker(i):
      try:
        for kind, m in orders[i]:
          step(i, kind, m)
      except _Aborted:
        pass
      except BaseException as e:  # pylint: disable=broad-except
        box.fail(e)

    threads = [threading.Thread(target=worker, args=(i,), name=f"mpmd-{self._name(i)}", daemon=True)
               for i in range(len(orders)) if orders[i]]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    if box.failed is not None:
      raise box.failed

  def _run_sequential(self, orders, step, box):
    n = len(orders)
    pos = [0] * n
    while any(pos[i] < len(orders[i]) for i in range(n)):
      for i in range(n):
        if pos[i] == len(orders[i]):
          continue
        kind, m = orders[i][pos[i]]
        need = (("act", i, m) if kind == "F" and i > 0 else ("grad", i, m) if kind == "B" and i < n - 1 else None)
        if need is None or box.ready(need):
          step(i, kind, m)
          pos[i] += 1
          break
      else:
        raise InputError("the pipeline's per-stage orders wait on each other (no stage can step)")


class _Locked:
  """A TransferLog shared by stage threads: extend under a lock."""

  def __init__(self, log, lock):
    self._log, self._lock = log, lock

  def extend(self, transfers):
    with self._lock:
      self._log.extend(transfers)


def _first_line(error):
  text = getattr(error, "message", None) or str(error)
  return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def _stage_is_local(mesh, name):
  """Whether this process drives the stage's submesh (all of it: True; none: False). A submesh split between
  processes is a MeshError."""
  mine = [_cluster.is_local(d) for d in mesh.resolve_devices()]
  if any(mine) and not all(mine):
    raise MeshError(f"{name}'s submesh {mesh} has devices in several processes; an MPMD stage runs in one "
                    "process: give it devices of one process (stages in different processes exchange their "
                    "activations by cross-mesh sends)", node=name)
  return all(mine)


def _check_disjoint(stages, name):
  """MeshError when two stages' submeshes share a device (stages run concurrently, one thread each)."""
  owner = {}
  for i, s in enumerate(stages):
    for d in s.mesh.resolve_devices():
      if d in owner and owner[d] != i:
        raise MeshError(f"{name(owner[d])} and {name(i)} both use device {d}; stages that run concurrently need "
                        "disjoint submeshes: give each stage its own devices (gs.Mesh(..., devices=[...])), or "
                        "pass concurrent=False to run the stages from one thread", node=name(i))
      owner[d] = i


def mpmd_pipeline(stages: Sequence[Stage], microbatches: int, schedule: str = "1f1b", loss_fn=None,
                  concurrent: bool = True, exchange: str = "auto", reduction: str = "mean"):
  """A training step over different stages on different submeshes, pipelined over microbatches (MPMD).

  Args:
    stages: `gs.Stage(fn, mesh, param_shardings, in_sharding, out_sharding, target_sharding)` per stage, first to
      last; the last stage's fn returns the microbatch's scalar loss (or its outputs, with `loss_fn`).
    microbatches: the number B of microbatches the batch is split into (it must divide the batch).
    schedule: "1f1b" (at most S - i microbatch inputs alive in stage i) or "gpipe" (all forwards, then all
      backwards).
    loss_fn: loss_fn(outputs, targets) -> scalar, applied to the last stage's outputs (optional).
    concurrent: one dispatch thread per stage (submeshes disjoint), or False: one thread for all.
    exchange: the stages' gs.function exchange ("auto" or "collectives").
    reduction: how the microbatches' losses make the batch's: "mean" (a loss that is a mean over the batch rows)
      or "sum" (a sum over them); the gradients are those of that loss.

  Example:
    >>> pipe = gs.mpmd_pipeline([gs.Stage(embed, mesh_a, P(None, "m"), P("d")),
    ...                          gs.Stage(head, mesh_b, P(None, "m"), P("d", None))], microbatches=4)
    >>> loss, grads = pipe([(table,), (w,)], token_ids, labels)
  """
  return MpmdPipeline(stages, microbatches, schedule, loss_fn, concurrent, exchange, reduction)
