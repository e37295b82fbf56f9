"""`gs.pipeline`: pipeline parallelism expressed as sharding (GSPMD paper, section 3.3; Lingvo/Praxis style).

Homogeneous stages are one computation vectorized over a leading *stage* dim: the stage weights are stacked
[S, ...], the activations in flight are a buffer [S, microbatch, ...] (row s: what stage s computed last), and
one loop iteration runs every stage at once on its row. Splitting the stage dim over a mesh axis gives each
device its stage's weights and row; the loop's only cross-stage data movement is the shift that hands row s to
stage s + 1, a rotation of the buffer along the stage dim, which the partitioner turns into one
collective-permute of one stage's buffer (the `Roll` rule). Nothing here is special to the partitioner: it is
ordinary TF (a While, a Roll, selects), annotated, so completion, partitioning, gradients (the While's
gradient is the pipelined backward pass) and the optimizer treat it like any other program, and the same
function run by a plain tf.function is the unpartitioned pipeline.

Schedule (R circular repeats, M microbatches, S stages; a stage *slot* is (repeat r, stage s), layer order
r*S + s): item k = r*M + m (microbatch m in repeat r) enters stage 0 at iteration k and stage s at k + s;
T = R*M + S - 1 iterations run everything, and (S-1)/T of the stage-iterations are the bubble. What leaves the
last stage reaches stage 0 by the same rotation one iteration later and is kept there, indexed by microbatch:
it is the stage-0 input of the next repeat of that microbatch (read M - S + 1 iterations later, hence M >= S
when R > 1) and, after the last repeat, the pipeline's output. Injection, collection and each stage's choice of
its repeat's weights are selects against the iteration counter, which keep every tensor's stage dim split
(a dynamic slice's gradient would be a Pad read at run time, which cannot stay split).
"""

import itertools
import numbers

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.annotations import current_mesh, PipelineSpec, record_schedule, shard
from tf_gspmd._layout.mesh import P
from tf_gspmd._layout.schedule import Schedule
from tf_gspmd.errors import InputError, SpecError

_names = itertools.count()


def stack_stages(layer_weights, stages, repeats=1, what="layer weights"):
  """Stacked per-layer weights [L, ...] -> stage weights for `gs.pipeline`.

  Each leaf of `layer_weights` (a nest of arrays or tensors) has the layer dim first. Returns leaves
  [S, L/S, ...] (repeats = 1) or [S, R, L/(S*R), ...]: entry [s, r] holds the layers of stage slot r*S + s, so a
  device holding row s of the stage dim holds the non-adjacent slots s, s + S, ... (the circular schedule's
  placement). Raises SpecError when L is not a multiple of S*R.
  """
  _check_counts(stages=stages, repeats=repeats)

  def one(w):
    w = tf.convert_to_tensor(w) if not isinstance(w, np.ndarray) else w
    shape = list(w.shape)
    n = shape[0]
    if n is None or n % (stages * repeats):
      raise SpecError(f"{n} layers cannot be divided into {stages} stages x {repeats} circular repeat(s): dim 0 of "
                      f"{what} {shape} must be a multiple of {stages * repeats}; change the number of layers, "
                      "--pipeline_stages or --circular_repeats", node=what)
    per = n // (stages * repeats)
    if repeats == 1:
      return _reshape(w, [stages, per] + shape[1:])
    return _swap01(_reshape(w, [repeats, stages, per] + shape[1:]))

  return tf.nest.map_structure(one, layer_weights)


def unstack_stages(stage_weights, repeats=1):
  """The inverse of `stack_stages`: stage weights -> [L, ...] in layer order."""
  _check_counts(repeats=repeats)

  def one(w):
    shape = list(w.shape)
    if repeats > 1:
      w = _swap01(w)
      return _reshape(w, [shape[0] * shape[1] * shape[2]] + shape[3:])
    return _reshape(w, [shape[0] * shape[1]] + shape[2:])

  return tf.nest.map_structure(one, stage_weights)


def _check_counts(**counts):
  """SpecError naming the argument for a count of stages or repeats that is not a whole number of 1 or more."""
  for name, value in counts.items():
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
      raise SpecError(f"{name}={value!r}: give the number of pipeline {name}, a whole number of 1 or more",
                      node=name)


def _reshape(w, shape):
  return np.reshape(w, shape) if isinstance(w, np.ndarray) else tf.reshape(w, shape)


def _swap01(w):
  if isinstance(w, np.ndarray):
    return np.swapaxes(w, 0, 1)
  return tf.transpose(w, [1, 0] + list(range(2, w.shape.rank)))


def _open(rank, *pinned):
  """P with the given leading entries pinned and the other dims left to completion."""
  return P(*pinned, *([P.UNCONSTRAINED] * (rank - len(pinned))))


def pipeline(stage_fn, stage_weights, inputs, *, microbatches, stage_axis="stage", circular_repeats=1,
             vectorize=True, mesh=None, name=None):
  """Runs `inputs` through S (or S*R) homogeneous stages as a GSPMD pipeline; returns the last stage's output.

  Call it inside a `gs.function` (or a plain tf.function: then it is the same pipeline, unpartitioned). The
  stage dim of the weights, of the activation buffer and of every op of the loop is split over `stage_axis`;
  each loop iteration's cross-stage communication is one collective-permute of one stage's activations. Other
  mesh axes split the batch and the model dims inside each stage as the weights' and inputs' annotations say.

  Args:
    stage_fn: stage_fn(weights, x) -> y, with y shaped like x. With `vectorize` (default) it is written for ONE
      stage slot (weights without the stage dims, x one microbatch [B/M, ...]) and is vectorized over the
      stage dim by `tf.vectorized_map` (annotations inside it are not carried through the vectorization; annotate
      the stage weights instead). With vectorize=False it must already be batched over a leading stage dim:
      weights [S, ...], x [S, B/M, ...] -> [S, B/M, ...] (row s computed with weights row s); its own
      annotations then apply.
    stage_weights: a nest of tensors (or captured variables' values), each [S, ...] when circular_repeats is
      1, else [S, R, ...] with entry [s, r] the weights of stage slot r*S + s (see `stack_stages`). S must be a
      multiple of the stage axis size; device k then holds rows k*S/n .. of the stage dim.
    inputs: the global batch [B, ...]; B must be a multiple of `microbatches`. Microbatch m is the rows
      m, m + M, m + 2M, ... (so a batch split over a data axis splits every microbatch alike); the result
      has the rows in the order of `inputs`.
    microbatches: M, the number of microbatches.
    stage_axis: the mesh axis the stage dim is split over.
    circular_repeats: R; each device runs R non-adjacent stage slots (s, s + S, ...), M >= S needed when R > 1.
    vectorize: see `stage_fn`.
    mesh: the mesh (default: the enclosing gs.function's); checked to have `stage_axis`.
    name: a name for the pipeline's ops and its line in the report.

  Returns:
    The output of the last stage slot for every row of `inputs`, shaped like `inputs`.

  Raises:
    SpecError: the mesh has no `stage_axis`, or S is not a multiple of its size.
    InputError: B is not a multiple of M, the stage weights disagree on S (or R), or R > 1 with M < S.
  """
  mesh = mesh or current_mesh()
  repeats = int(circular_repeats)
  m_count = int(microbatches)
  name = name or f"gspmd_pipeline_{next(_names)}"
  weights, x, stages = _pipeline_arguments(stage_weights, inputs, mesh, stage_axis, m_count, repeats, name)
  loop = _PipelineLoop(stage_fn, stage_weights, weights, x, stages=stages, microbatches=m_count, repeats=repeats,
                       stage_axis=stage_axis, vectorize=vectorize, name=name)
  out = loop.run()
  record_schedule(loop.schedule())
  return out


def _pipeline_arguments(stage_weights, inputs, mesh, stage_axis, m_count, repeats, name):
  """`pipeline`'s arguments as tensors, checked: (the stage weights, flattened; the inputs; S, the number of stages).

  Raises the SpecError and InputError `pipeline` documents.
  """
  weights = [tf.convert_to_tensor(w) for w in tf.nest.flatten(stage_weights)]
  if not weights:
    raise InputError("gs.pipeline needs at least one stage weight (a tensor with the stage dim first)", node=name)
  x = tf.convert_to_tensor(inputs)
  if repeats < 1 or m_count < 1:
    raise InputError(f"microbatches ({m_count}) and circular_repeats ({repeats}) must be at least 1", node=name)
  stages = _stage_count(weights, repeats, name)
  if mesh is not None:
    if stage_axis not in mesh.axis_names:
      raise SpecError(f"the mesh has no stage axis {stage_axis!r} (axes {mesh.axis_names}): give the mesh an axis "
                      f"for the pipeline stages or pass stage_axis= one of {mesh.axis_names}", node=name)
    n = mesh.axis_size(stage_axis)
    if stages % n:
      raise SpecError(f"dim 0 of the stage weights ({stages} stages) is not a multiple of the size {n} of mesh axis "
                      f"{stage_axis!r}: use a multiple of {n} stages", node=name)
  batch = x.shape.as_list()
  if not batch or batch[0] is None or batch[0] % m_count:
    raise InputError(f"dim 0 of the pipeline's inputs {batch} (the batch) cannot be divided into {m_count} "
                     f"microbatches: use a batch that is a multiple of {m_count} or another number of microbatches",
                     node=name)
  if repeats > 1 and m_count < stages:
    raise InputError(f"a circular pipeline needs at least as many microbatches as stages (M={m_count} < S={stages}): "
                     "what leaves the last stage feeds stage 0 again M - S + 1 iterations later", node=name)
  return weights, x, stages


def _stage_count(weights, repeats, name):
  """S, from the stage weights' leading dims [S] (or [S, R] when circular), which must all be equal and known."""
  lead = 2 if repeats > 1 else 1
  want = None
  for k, w in enumerate(weights):
    shape = w.shape.as_list()
    if len(shape) < lead or None in shape[:lead]:
      raise InputError(f"stage weight {k} ({w.name if hasattr(w, 'graph') else 'tensor'}) has shape {shape}; stage "
                       f"weights need leading dims {'[S, R]' if repeats > 1 else '[S]'} (gs.stack_stages builds them)",
                       node=name)
    want = want or shape[:lead]
    if shape[:lead] != want:
      raise InputError(f"stage weight {k} has leading dims {shape[:lead]} but stage weight 0 has {want}: every stage "
                       f"weight needs the same {'[S, R]' if repeats > 1 else '[S]'} leading dims", node=name)
  stages = want[0]
  if repeats > 1 and want[1] != repeats:
    raise InputError(f"circular_repeats={repeats} but dim 1 of the stage weights is {want[1]}: give weights "
                     f"[S, R, ...] (gs.stack_stages(w, S, repeats={repeats}))", node=name)
  return stages


class _PipelineLoop:
  """The loop of one `pipeline` call: its stage-split tensors, one iteration's steps and the final collection.

  Constructing it creates the loop's inputs in the pipeline's name scope (the weights laid out, the microbatches,
  the state buffer [S, mb, ...] and the buffer [S, M, mb, ...] that collects what leaves the last stage), then the
  masks that pick stage 0 and a microbatch; `run` builds the loop.
  """

  def __init__(self, stage_fn, stage_weights, weights, x, *, stages, microbatches, repeats, stage_axis, vectorize,
               name):
    self.stage_fn = stage_fn
    self.stage_weights = stage_weights   # the nest stage_fn takes its weights in
    self.stages = stages
    self.m_count = microbatches
    self.repeats = repeats
    self.stage_axis = stage_axis
    self.vectorize = vectorize
    self.name = name
    self.dtype = x.dtype
    self.batch = x.shape.as_list()
    self.mb = self.batch[0] // microbatches
    self.feature = self.batch[1:]
    self.rank = len(self.batch) + 1          # rank of the state buffer [S, mb, ...]
    self.total = repeats * microbatches
    self.iterations = self.total + stages - 1
    with tf.name_scope(name) as scope:
      self.scope = scope
      self.weights, self.xs, self.initial = self._loop_inputs(weights, x)
    self.stage_ids = np.arange(stages, dtype=np.int32)
    self.first_stage = tf.reshape(tf.constant(self.stage_ids == 0), [stages] + [1] * (self.rank - 1))
    self.slots = tf.constant(np.arange(microbatches, dtype=np.int32))
    self.shift_name = f"{name}_shift"

  def _loop_inputs(self, weights, x):
    """(the weights split on the stage dim, the microbatches [S, M, mb, ...], (the state, the collection buffer))."""
    stages, m_count, mb, feature, rank, name = self.stages, self.m_count, self.mb, self.feature, self.rank, self.name
    lead = 2 if self.repeats > 1 else 1
    weights = [shard(w, _open(w.shape.rank, self.stage_axis, *([None] * (lead - 1)))) for w in weights]
    # Microbatch m = rows m, m + M, ...: the batch's split (dim 0) lands on the microbatch rows, not on M.
    xs = tf.reshape(x, [mb, m_count] + feature)
    xs = tf.transpose(xs, [1, 0] + list(range(2, rank)))
    # One copy per stage row (each device its own, built locally): the injection reads it with stage-split ops,
    # so its gradient accumulates split over the loop and is summed over the stages once, after it.
    xs = shard(tf.broadcast_to(xs[None], [stages, m_count, mb] + feature), _open(rank + 1, self.stage_axis, None),
               name=f"{name}_microbatches")
    state = shard(tf.zeros([stages, mb] + feature, x.dtype), _open(rank, self.stage_axis), name=f"{name}_state")
    buf = shard(tf.zeros([stages, m_count, mb] + feature, x.dtype), _open(rank + 1, self.stage_axis, None),
                name=f"{name}_collected")
    return weights, xs, (state, buf)

  def collect(self, i, state, buf):
    """Shift the buffer by one stage; stage 0 keeps what left the last stage (item i - S) in its microbatch slot."""
    stages, m_count, rank, first_stage, slots = self.stages, self.m_count, self.rank, self.first_stage, self.slots
    rotated = shard(tf.roll(state, 1, 0, name=self.shift_name), _open(rank, self.stage_axis))
    j = i - stages
    take = tf.logical_and(j >= 0, j < self.total)
    mask = tf.logical_and(tf.reshape(tf.logical_and(first_stage, take), [stages, 1] + [1] * (rank - 1)),
                          tf.reshape(tf.equal(slots, tf.math.floormod(j, m_count)), [1, m_count] + [1] * (rank - 1)))
    buf = shard(tf.where(mask, rotated[:, None], buf), _open(rank + 1, self.stage_axis, None))
    return rotated, buf

  def stage_inputs(self, i, rotated, buf):
    """Row 0: microbatch i mod M, fresh in repeat 0, else its output of the previous repeat; other rows: rotated."""
    m0 = tf.math.floormod(i, self.m_count)
    pick = tf.equal(self.slots, m0)
    pick = tf.reshape(pick, [1, self.m_count] + [1] * (self.rank - 1))
    fresh = tf.reduce_sum(tf.where(pick, self.xs, tf.zeros([], self.dtype)), 1)
    again = tf.reduce_sum(tf.where(pick, buf, tf.zeros([], self.dtype)), 1)
    feed = tf.where(i < self.m_count, fresh, again)
    return shard(tf.where(self.first_stage, feed, rotated), _open(self.rank, self.stage_axis))

  def stage_weights_at(self, i):
    """Each stage's weights for the repeat its current item is in: slot (clip((i - s) // M), s)."""
    if self.repeats == 1:
      return self.weights
    rep = tf.clip_by_value(tf.math.floordiv(i - self.stage_ids, self.m_count), 0, self.repeats - 1)
    out = []
    for w in self.weights:
      r = tf.reshape(rep, [self.stages] + [1] * (w.shape.rank - 2))
      cur = w[:, 0]
      for k in range(1, self.repeats):
        cur = tf.where(tf.equal(r, k), w[:, k], cur)
      out.append(shard(cur, _open(cur.shape.rank, self.stage_axis)))
    return out

  def run_stages(self, ws, h):
    if not self.vectorize:
      return self.stage_fn(tf.nest.pack_sequence_as(self.stage_weights, ws), h)

    def one(args):
      w, xb = args
      return self.stage_fn(tf.nest.pack_sequence_as(self.stage_weights, w), xb)

    return tf.vectorized_map(one, (ws, h), fallback_to_while_loop=False)

  def body(self, i, state, buf):
    rotated, buf = self.collect(i, state, buf)
    h = self.stage_inputs(i, rotated, buf)
    y = self.run_stages(self.stage_weights_at(i), h)
    if y.shape.as_list() != h.shape.as_list() or y.dtype != h.dtype:
      raise InputError(f"the stage function must return its input's shape and dtype ({h.dtype.name}{h.shape.as_list()}"
                       f" across the stages); it returned {y.dtype.name}{y.shape.as_list()}", node=self.name)
    return i + 1, shard(y, _open(self.rank, self.stage_axis)), buf

  def run(self):
    """The loop and the final collection, in the pipeline's name scope: the last stage's output, shaped like the
    inputs."""
    iterations, stages, rank = self.iterations, self.stages, self.rank
    with tf.name_scope(self.scope):
      # maximum_iterations bounds the gradient loop's accumulators, which XLA needs to compile the loop's gradient
      _, state, buf = tf.while_loop(lambda i, *_: i < iterations, self.body, (tf.constant(0),) + self.initial,
                                    maximum_iterations=iterations, name=f"{self.name}_loop")
      _, buf = self.collect(tf.constant(iterations), state, buf)   # the last item reaches stage 0 after the loop
      out = tf.reduce_sum(tf.where(tf.reshape(self.first_stage, [stages, 1] + [1] * (rank - 1)), buf,
                                   tf.zeros([], self.dtype)), 0)
      return tf.reshape(tf.transpose(out, [1, 0] + list(range(2, rank))), self.batch, name="output")

  def schedule(self):
    """The pipeline's line in the report: its schedule and its buffers."""
    name, stages, m_count, mb, feature = self.name, self.stages, self.m_count, self.mb, self.feature
    itemsize = self.dtype.size
    return PipelineSpec(
        name=name, stage_axis=self.stage_axis, schedule=Schedule("circular", stages, m_count, self.repeats),
        shift=self.shift_name,
        buffers=((f"{name}_state", tuple([stages, mb] + feature), itemsize),
                 (f"{name}_collected", tuple([stages, m_count, mb] + feature), itemsize),
                 (f"{name}_microbatches", tuple([stages, m_count, mb] + feature), itemsize)))
