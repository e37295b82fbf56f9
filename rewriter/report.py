"""The partition report: every collective the per-device program performs, with its cause.

Each record is one *logical* collective (what the partitioner needed: kind, dtype, per-device shape, bytes)
together with the ops the collectives backend emitted for it, described from the tensors they were built on:
their op type, the dtype and per-device shape they carry, and the bytes they send. The two differ where TF's
collectives cannot carry a dtype at its width, where a collective is emulated (reduce-scatter as all-to-all),
and where the combine pass merged several independent collectives into one op (the records then share it;
`combined` lists each merged op).

Bytes are per device (`shared` convention): the per-device *result* of an all-gather; the per-device
*operand* of all-reduce, reduce-scatter, all-to-all and collective-permute. `bytes_per_device()` counts the
emitted ops (what the program sends), `logical_bytes_per_device()` the logical collectives.

Loops: a record knows the While loops it runs in (`loops`, outer first, each with its trip count where
`rewriter.graph.loops` reads it statically). The totals are per step: a record inside loops of known trip counts
counts their product of times (`times`); inside a loop whose trip count is unknown it counts once per run of
that loop, and the report says so ("per iteration of loop X (trip count unknown)"). `per_iteration=True` gives
the totals with every record once: one iteration of every loop, the program's ops as emitted.
"""

import collections
import contextlib
import dataclasses
import threading
import types
from typing import Any, Mapping, Optional, Tuple

from tf_gspmd._layout.mesh import axes_text
from tf_gspmd.errors import InputError, PartitionError

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
LARGE_GATHER_BYTES = 1 << 20


def shape_text(shape):
  """`shape` as "8,128,256" (None dims as "None"); "?" for a shape of unknown rank (None)."""
  return "?" if shape is None else ",".join(str(s) for s in shape)


@dataclasses.dataclass(frozen=True, eq=False)
class Groups:
  """The groups of a collective op's devices: per mesh position the index of its group (`of`), and each group's
  member positions (`members`) in the order of its group key -- TF's runtime rank order; a transfer's sender, then
  its receiver. One object serves every op over the same groups, so a mesh of thousands of devices is held once."""

  of: Tuple[int, ...]
  members: Tuple[Tuple[int, ...], ...]

  def of_position(self, p):
    """The member positions of position `p`'s group."""
    return self.members[self.of[p]]


@dataclasses.dataclass(frozen=True)
class Emitted:
  """A collective op of the per-device program, described from the tensors it was built on.

  `bytes` is what a device sends through the op, in the report's convention (an all-gather: its per-device
  result; a receive sends nothing). Where devices send different amounts through it (a collective-permute's
  members without a receiver send a token), `device_bytes` has each device's and `bytes` is the most.
  """

  kind: str                        # what the op itself does: all-reduce, all-gather, all-to-all, collective-permute
  axes: Tuple[str, ...]            # the mesh axes its groups span
  reduction: Optional[str]         # an all-reduce's merge op ("Add", "Max", ...), else None
  name: str                        # the node in the per-device program
  op: str                          # its TF op type
  dtype: str                       # the dtype it carries
  shape: Tuple[int, ...]           # per-device shape it carries (an all-gather: its result)
  group_size: int
  bytes: int
  device_bytes: Optional[Tuple[int, ...]] = None   # bytes by device id, where devices differ
  cross_process: bool = False      # its groups join devices of different processes (network, not host links)
  level: Optional[str] = None      # of a collective built in two levels: "within" each process or "across" them
  # Who takes part: its groups (`Groups`), its instance key, and for a transfer's receive the name of its send.
  groups: Any = dataclasses.field(default=None, compare=False, repr=False)
  instance_key: Optional[int] = dataclasses.field(default=None, compare=False, repr=False)
  partner: Optional[str] = dataclasses.field(default=None, compare=False, repr=False)

  def __str__(self):
    sent = f"{self.bytes:,} B"
    if self.device_bytes is not None:
      sent = ", ".join(f"{b:,} B from {k} device(s)" for b, k in sorted(collections.Counter(self.device_bytes).items(),
                                                                             reverse=True))
    where = ", across processes" if self.cross_process else ", within each process" if self.level else ""
    return f"{self.op} {self.dtype}[{shape_text(self.shape)}] (group {self.group_size}{where}), {sent}"


@dataclasses.dataclass(frozen=True)
class Loop:
  """A While loop a collective runs in: the While node, how many times its body runs per run of the loop when
  that is known statically (`rewriter.graph.loops`), else None and a static bound where one is known."""

  name: str                       # the While node (named in the graph or body that holds it)
  trips: Optional[int]            # runs of its body per run of the loop; None: not known statically
  at_most: Optional[int] = None   # where `trips` is unknown: a static bound on it (maximum_iterations), or None
  condition: bool = False         # the collective sits in the loop's condition, which runs trips + 1 times

  @property
  def runs(self):
    """How many times the collective runs per run of the loop (None: unknown)."""
    return None if self.trips is None else self.trips + int(self.condition)

  @property
  def where(self):
    return f"loop {self.name}" + (" (its condition)" if self.condition else "")

  def __str__(self):
    if self.runs is not None:
      return f"{self.where} × {self.runs}"
    bound = f", at most {self.at_most + int(self.condition)}" if self.at_most is not None else ""
    return f"per iteration of {self.where} (trip count unknown{bound})"


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
  """One logical collective: kind, dtype, per-device shape, bytes, group size, mesh axes, cause, emitted ops."""

  kind: str
  dtype: str
  shape: Tuple[int, ...]
  bytes: int
  group_size: int
  axes: Tuple[str, ...]
  source: str           # the op that needed it
  reason: str           # why
  ops: Tuple[Emitted, ...] = ()   # the ops emitted for it (shared with other records once combined)
  note: str = ""        # how the emitted ops carry it, where that is not plain
  within: Tuple[str, ...] = ()   # the control-flow nodes (While, If, call) whose bodies hold its ops, outer first
  loops: Tuple[Loop, ...] = ()   # the While loops it runs in, outer first

  @property
  def times(self):
    """How many times it runs per step: the product of its loops' runs, a loop of unknown trip count as 1."""
    out = 1
    for loop in self.loops:
      out *= 1 if loop.runs is None else loop.runs
    return out

  @property
  def loops_text(self):
    """' × N (loop X)' for a record inside loops, ' per iteration of loop X (trip count unknown)' inside a loop of
    unknown trip count, '' outside any."""
    known = [loop for loop in self.loops if loop.runs is not None]
    if not known:
      return "".join(f" {loop}" for loop in self.loops)
    parts = "; ".join(loop.where if len(known) == 1 and loop.runs is not None else str(loop) for loop in self.loops)
    return f" × {self.times:,} ({parts})"

  @property
  def differs(self):
    """Whether the emitted ops send something else than the logical collective (other ops, dtype or size)."""
    senders = [op for op in self.ops if op.bytes]
    return bool(self.note) or len(senders) != 1 or (senders[0].dtype, senders[0].bytes) != (self.dtype, self.bytes)

  @property
  def cross_process(self):
    """Whether its emitted ops join devices of different processes."""
    return any(op.cross_process for op in self.ops)

  def __str__(self):
    where = ", across processes" if self.cross_process else ""
    return (f"{self.kind} {self.dtype}[{shape_text(self.shape)}] over {axes_text(self.axes) or '-'} "
            f"(group {self.group_size}{where}), {self.bytes:,} B/device{self.loops_text} - {self.source}: "
            f"{self.reason}")


@dataclasses.dataclass(frozen=True)
class Combination:
  """Independent collectives that the combine pass merged into one op: the op's kind, how many ops it replaces,
  the bytes it sends per device (the sum of theirs) and the kinds of the logical collectives it carries (an
  all-to-all also carries reduce-scatters, which are emitted as all-to-alls)."""

  kind: str
  members: int
  bytes: int
  carries: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class StateRecord:
  """One variable the program keeps on the devices: its layout and its bytes per device."""

  name: str
  shape: Tuple[int, ...]
  sharding: str
  bytes_per_device: int   # the shard, padding included
  global_bytes: int
  role: str               # "weight" (read by the computation) or "update state" (optimizer slots, counters)


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
  """A `gs.pipeline`'s schedule as partitioned: S stage slots per repeat over `stage_axis`, M microbatches, R
  circular repeats, S*R... run in R*M + S - 1 loop iterations of which (S-1)/(R*M+S-1) is bubble; what one shift
  sends per device (the loop's collective-permutes of the stage buffer) and the activation buffers a device
  holds (the stage buffer, the stage-0 collection buffer, the microbatched input).

  Its bytes are per iteration: a step runs the forward loop `iterations` times (and its gradient loop as many),
  so a step's forward shifts send `iterations` * `shift_bytes` per device, which is what the report's per-step
  totals count for them (their records' `times`)."""

  name: str
  stage_axis: str
  schedule: Any                     # its `Schedule` (tf_gspmd/_layout/schedule.py): S, M, R, iterations, bubble
  shift_bytes: int                  # bytes per device of one iteration's shift (forward loop): per iteration
  shift_permutes: int               # collective-permutes per forward iteration (1 for one stage per device)
  loop_stage_collectives: Tuple[str, ...]   # every collective over the stage axis inside the pipeline's loops
  buffer_bytes: Tuple[Tuple[str, int], ...]   # (buffer, bytes per device)

  stages = property(lambda self: self.schedule.stages)
  microbatches = property(lambda self: self.schedule.microbatches)
  repeats = property(lambda self: self.schedule.repeats)
  iterations = property(lambda self: self.schedule.iterations)
  bubble_fraction = property(lambda self: self.schedule.bubble_fraction)

  @property
  def activation_bytes(self):
    """Peak bytes per device of the pipeline's activation buffers (all live across the loop)."""
    return sum(b for _, b in self.buffer_bytes)

  def __str__(self):
    bufs = ", ".join(f"{n} {b:,} B" for n, b in self.buffer_bytes)
    s = self.schedule
    return (f"pipeline {self.name} over {self.stage_axis}: S={s.stages} stages, M={s.microbatches} "
            f"microbatches, R={s.repeats} circular repeat(s), {s.iterations} iterations, bubble fraction "
            f"{s.stages - 1}/{s.iterations} = {s.bubble_fraction:.3f}; shift: {self.shift_permutes} "
            f"collective-permute(s), {self.shift_bytes:,} B/device per iteration; activation buffers "
            f"{self.activation_bytes:,} B/device ({bufs}); collectives over {self.stage_axis} inside its loops: "
            f"{len(self.loop_stage_collectives)}")


class ReportBuilder:
  """What the partition pass collects while it emits the per-device program: collectives as they are built (with
  the reshard in progress, to tell a gather the user asked for from an involuntary one), fallbacks, reshards and
  warnings. `build` makes the program's Report from it; the builder is emission state and never part of it."""

  def __init__(self, strict=False, weight_shapes=None):
    self.strict = strict        # gs.function(strict=True): an involuntary full rematerialization is an error
    # global shape -> name of a captured variable stored split: an all-gather to that shape rematerialises a
    # weight-sized tensor (the weight, its gradient or an optimizer slot) whatever its size
    self.weight_shapes = dict(weight_shapes or {})
    self.collectives = []
    self.fallbacks = []         # (node, op type)
    self.reshards = []          # (op, from, to, steps)
    self.warnings = []
    self.rematerializations = []
    # (tensor, its layout, the layout wanted, whether a sharding the user pinned asked for it) while a reshard emits
    self.resharding = None
    self.within, self.loops = (), ()   # the body being partitioned: its control-flow nodes and its loops

  @contextlib.contextmanager
  def inside(self, node, loop=None):
    """Collectives recorded inside sit in a body of control-flow node `node`; `loop` (a Loop) when that body is
    a While's body or condition."""
    previous = self.within, self.loops
    self.within, self.loops = self.within + (node,), self.loops + ((loop,) if loop is not None else ())
    try:
      yield
    finally:
      self.within, self.loops = previous

  def mark(self):
    """Where the records stand now (for `rewind`)."""
    return tuple(len(x) for x in (self.collectives, self.fallbacks, self.reshards, self.warnings,
                                  self.rematerializations))

  def rewind(self, mark):
    """Drop what was recorded since `mark` (a body partitioned again another way)."""
    for x, n in zip((self.collectives, self.fallbacks, self.reshards, self.warnings, self.rematerializations), mark):
      del x[n:]

  @contextlib.contextmanager
  def resharding_of(self, tensor, have, want, requested):
    """Collectives recorded inside reshard `tensor` from layout `have` to `want`. `requested`: the user pinned
    `want` there (an annotation, in_shardings or out_shardings), so a large gather it takes is what they asked for,
    not one the partitioner fell back to."""
    previous = self.resharding
    self.resharding = (tensor, str(have), str(want), requested)
    try:
      yield
    finally:
      self.resharding = previous

  def warn(self, message):
    self.warnings.append(message)

  def fallback(self, node, op_type):
    self.fallbacks.append((node, op_type))

  def reshard(self, op, src, dst, steps):
    self.reshards.append((op, str(src), str(dst), tuple(steps)))

  def add(self, record):
    """Record a collective. An all-gather that no pinned sharding asked for, of more than LARGE_GATHER_BYTES per
    device or to the full shape of a split variable (a weight, its gradient or slot gathered whole on every
    device, however small), is an *involuntary full rematerialization* (an op's rule could not use the layout
    its operand has, or completion chose a layout the value then has to be gathered into): a warning, or with
    strict=True a PartitionError naming the tensor, its layout and the fix."""
    if self.within:
      record = dataclasses.replace(record, within=self.within, loops=self.loops)
    weight = self.weight_shapes.get(tuple(record.shape)) if record.kind == "all-gather" else None
    if record.kind == "all-gather" and (record.bytes > LARGE_GATHER_BYTES or weight is not None):
      tensor, have, want, requested = self.resharding or (None, None, None, False)
      if requested:
        self.collectives.append(record)
        return
      if self.strict:
        value = f"{record.dtype}[{shape_text(record.shape)}]"
        what = f"{tensor} ({value}), laid out as {have}, is gathered whole into {want}" if tensor else (
            f"{value} is gathered whole")
        what += f", weight-sized (the shape of split variable {weight})" if weight is not None else ""
        raise PartitionError(
            f"strict=True forbids an involuntary full rematerialization: {what} ({record.bytes:,} B per device "
            f"over {axes_text(record.axes)}) because {record.reason}. Fix: annotate the tensor (gs.shard, "
            "in_shardings or out_shardings) with a layout its consumer can use as it is, change the layout of the "
            "values it is computed from so that the op's split dimensions agree, or pass strict=False to accept the "
            "gather",
            node=record.source)
      sized = f" of a weight-sized tensor (the shape of split variable {weight})" if weight is not None else ""
      self.warnings.append(f"involuntary full rematerialization{sized}: {record}")
      self.rematerializations.append(record)
    self.collectives.append(record)

  def build(self, completion_iterations=0, state=()):
    """The Report of what was collected."""
    return Report(collectives=tuple(self.collectives), fallbacks=tuple(self.fallbacks), reshards=tuple(self.reshards),
                  completion_iterations=completion_iterations, warnings=tuple(self.warnings), state=tuple(state),
                  strict=self.strict, rematerializations=tuple(self.rematerializations))


class _Lazy:
  """A value computed on first read (the memory estimate), shared by the reports derived from one another."""

  def __init__(self, fn):
    self._fn, self._value, self._lock = fn, None, threading.Lock()

  def get(self):
    with self._lock:
      if self._fn is not None:
        self._value, self._fn = self._fn(), None
      return self._value


@dataclasses.dataclass(frozen=True)
class Report:
  """The partition report, frozen: the partition pass builds it (ReportBuilder.build); a later pass that adds to it
  returns a new Report (`with_*`), so no pass changes a report another holds."""

  collectives: Tuple[CollectiveRecord, ...] = ()
  fallbacks: Tuple[Tuple[str, str], ...] = ()   # (node, op type)
  reshards: Tuple[Tuple[str, str, str, Tuple[str, ...]], ...] = ()   # (op, from, to, steps)
  completion_iterations: int = 0
  warnings: Tuple[str, ...] = ()
  pass_times: Mapping[str, float] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
  state: Tuple[StateRecord, ...] = ()
  combined: Tuple[Combination, ...] = ()   # the combine pass's merged ops
  strict: bool = False   # gs.function(strict=True): an involuntary full rematerialization is an error
  # the all-gathers flagged as involuntary full rematerializations (each also has a line in `warnings`)
  rematerializations: Tuple[CollectiveRecord, ...] = ()
  pipelines: Tuple[PipelineSchedule, ...] = ()
  constants: Any = None   # backend.constants.Constants: the per-device program's constants (the constants pass)
  planned: Optional[str] = None   # set when another partitioner runs the program: this report is tf_gspmd's plan
  _memory: Optional[_Lazy] = dataclasses.field(default=None, repr=False, compare=False)
  _timeline: Optional[_Lazy] = dataclasses.field(default=None, repr=False, compare=False)
  _page: Any = dataclasses.field(default=None, repr=False, compare=False)   # writes the lowering's HTML page

  # ---- derived reports (the passes after partition) -----------------------------------------------------------
  def with_memory(self, fn, timeline=None):
    """This report with `memory` computed by `fn`, and `memory_timeline` by `timeline`, on first read (the memory
    pass)."""
    return dataclasses.replace(self, _memory=_Lazy(fn), _timeline=timeline and _Lazy(timeline))

  def with_ops_replaced(self, mapping):
    """This report with the records of the program's graph pointed at other ops: `mapping` is {op name: its
    replacement Emitted, or None if removed}. Records inside function bodies keep theirs (the passes that replace
    ops edit the program's graph, not its functions)."""
    records = []
    for c in self.collectives:
      if not c.within and any(op.name in mapping for op in c.ops):
        ops = []
        for op in c.ops:
          new = mapping.get(op.name, op)
          if new is not None and new not in ops:
            ops.append(new)
        c = dataclasses.replace(c, ops=tuple(ops))
      records.append(c)
    return dataclasses.replace(self, collectives=tuple(records))

  def without_bodies_of(self, nodes):
    """This report with the records inside the bodies of the program's control-flow nodes `nodes` (removed from
    the program) left without ops."""
    return dataclasses.replace(self, collectives=tuple(
        dataclasses.replace(c, ops=()) if c.within and c.within[0] in nodes and c.ops else c
        for c in self.collectives))

  def with_combined(self, combined, carriers):
    """This report with the combine pass's merged ops: `combined` Combinations, `carriers` {member op: the op that
    carries it}."""
    return dataclasses.replace(self, combined=self.combined + tuple(combined)).with_ops_replaced(carriers)

  def with_collectives_added(self, records):
    """This report with the collectives a pass after partitioning emitted (CollectiveRecords)."""
    return dataclasses.replace(self, collectives=self.collectives + tuple(records))

  def with_pipelines(self, schedules):
    return dataclasses.replace(self, pipelines=self.pipelines + tuple(schedules))

  def with_constants(self, constants):
    return dataclasses.replace(self, constants=constants)

  def with_page(self, write):
    """This report with `save_html` writing the page of its lowering by `write(path)` (the lowering sets it)."""
    return dataclasses.replace(self, _page=write)

  def with_planned(self, note):
    return dataclasses.replace(self, planned=note)

  def with_pass_times(self, times):
    return dataclasses.replace(self, pass_times=types.MappingProxyType({**self.pass_times, **times}))

  # ---- reading ----------------------------------------------------------------------------------------------
  @property
  def memory(self):
    """The per-device program's estimated peak (the memory pass; None when it did not run)."""
    return None if self._memory is None else self._memory.get()

  @property
  def memory_timeline(self):
    """(bytes held throughout, [(op, op type, activation bytes live while it runs)]) of the per-device program the
    memory pass counted, or None."""
    return None if self._timeline is None else self._timeline.get()

  @property
  def peak_bytes_per_device(self):
    """Estimated peak bytes one device holds during the program (None before the memory pass ran)."""
    return None if self.memory is None else self.memory.peak_bytes

  def emitted(self):
    """{op name: Emitted} of the collective ops of the per-device program's graph (the one record of them); the
    ops inside its functions (loop and branch bodies) are in `emitted_ops()`."""
    return {op.name: op for c in self.collectives if not c.within for op in c.ops}

  def counts(self, per_iteration=False):
    """{kind: number of collectives run per step} for the kinds present: a collective inside loops counts its
    `times`; per_iteration=True counts every collective once."""
    runs = collections.Counter()
    for c in self.collectives:
      runs[c.kind] += 1 if per_iteration else c.times
    return dict(runs)

  def _emitted_runs(self, per_iteration):
    """[(Emitted, how many times it runs per step)] of the program's collective ops, once each (a combined op
    serves several records; an op is named in its graph or function body)."""
    ops = {}
    for c in self.collectives:
      for op in c.ops:
        ops.setdefault((c.within, op.name), (op, 1 if per_iteration else c.times))
    return list(ops.values())

  def emitted_ops(self):
    """The collective ops of the program behind the records, once each, those inside function bodies included."""
    return [op for op, _ in self._emitted_runs(True)]

  def per_iteration_loops(self):
    """{loop name: Loop} of the loops whose trip count is unknown: their collectives count once per run of the
    loop in the totals."""
    unknown = {}
    for c in self.collectives:
      for loop in c.loops:
        if loop.runs is None:
          unknown.setdefault(loop.name, loop)
    return unknown

  def _most_per_device(self, factor, per_iteration):
    """The largest sum over the emitted ops of what one device sends through each, times `factor(op)` and the
    times the op runs per step (once with `per_iteration`)."""
    everyone, by_device = 0, collections.Counter()
    for op, times in self._emitted_runs(per_iteration):
      if op.device_bytes is None:
        everyone += op.bytes * factor(op) * times
      else:
        for p, b in enumerate(op.device_bytes):
          by_device[p] += b * factor(op) * times
    return everyone + max(by_device.values(), default=0)

  def bytes_per_device(self, per_iteration=False):
    """Bytes per device the program's collective ops send per step (the convention above, applied to the emitted
    ops; where devices send different amounts, the device that sends the most). An op inside loops counts its
    record's `times`; per_iteration=True counts every op once (one iteration of every loop)."""
    return self._most_per_device(lambda op: 1, per_iteration)

  def cross_process_bytes_per_device(self, per_iteration=False):
    """Of `bytes_per_device`, what goes through collectives whose groups span processes: the traffic between hosts
    (a network much slower than the links inside one), 0 when the mesh lives in one process."""
    return self._most_per_device(lambda op: 1 if op.cross_process else 0, per_iteration)

  def logical_bytes_per_device(self, per_iteration=False):
    """Bytes per device of the logical collectives per step (each at its own dtype and shape, before combining;
    inside loops times its `times`, unless per_iteration=True)."""
    return sum(c.bytes * (1 if per_iteration else c.times) for c in self.collectives)

  def wire_bytes_per_device(self, per_iteration=False):
    """Bytes each device sends through the emitted ops with bandwidth-optimal (ring) algorithms: an all-reduce of
    B bytes over N devices sends 2B(N-1)/N, an all-gather or all-to-all B(N-1)/N (a reduce-scatter is emitted as
    an all-to-all), a collective-permute B. A reduce-scatter plus an all-gather therefore costs what the
    all-reduce they replace costs. Per step, as `bytes_per_device`."""
    def factor(op):
      share = (op.group_size - 1) / op.group_size if op.group_size else 0.0
      return {"all-reduce": 2 * share, "collective-permute": 1.0}.get(op.kind, share)

    return int(round(self._most_per_device(factor, per_iteration)))

  def combined_text(self):
    """Per kind of op, how many independent ops the combine pass merged into how many."""
    by_kind = collections.defaultdict(list)
    for c in self.combined:
      by_kind[c.kind].append(c)
    lines = []
    for kind in KINDS:
      if by_kind[kind]:
        carries = sorted({k for c in by_kind[kind] for k in c.carries} - {kind})
        what = f" ({' and '.join(k + 's' for k in carries)}' exchanges among them)" if carries else ""
        lines.append(f"{sum(c.members for c in by_kind[kind])} independent {kind}s{what} combined into "
                     f"{len(by_kind[kind])} collective(s)")
    return lines

  def save_html(self, path):
    """Writes the plan as one self-contained HTML page -- warnings, collectives, bytes per layer, memory over the
    step, layouts as tile grids (`tf_gspmd._explore.page`) -- to `path`; returns the path."""
    if self._page is None:
      raise InputError("this report is not a lowering's: draw the report of gs.function(...).lower(...) (its "
                       ".report), which knows the program's graph", node="report")
    return self._page(path)

  def state_bytes(self, role=None):
    """(bytes per device, global bytes) of the variables kept on the devices ("weight", "update state" or all)."""
    rows = [r for r in self.state if role is None or r.role == role]
    return sum(r.bytes_per_device for r in rows), sum(r.global_bytes for r in rows)

  def __str__(self):
    sent, logical = self.bytes_per_device(), self.logical_bytes_per_device()
    crossing = self.cross_process_bytes_per_device()
    looped = any(c.loops for c in self.collectives)
    runs = f", {sum(c.times for c in self.collectives):,} run per step" if looped else ""
    once = f"; {self.bytes_per_device(per_iteration=True):,} with every loop once" if looped else ""
    lines = [f"{len(self.collectives)} collective(s){runs}, {sent:,} bytes per device{' per step' if looped else ''} "
             f"({self.wire_bytes_per_device():,} sent on the wire"
             f"{'' if sent == logical else f'; {logical:,} as logical collectives'}"
             f"{f'; {crossing:,} across processes' if any(op.cross_process for op in self.emitted_ops()) else ''}"
             f"{once}), {len(self.reshards)} reshard(s)"]
    if self.planned:
      lines.insert(0, self.planned)
    for name, loop in self.per_iteration_loops().items():
      inside = sum(1 for c in self.collectives if any(x.name == name for x in c.loops))
      lines.append(f"{dataclasses.replace(loop, condition=False)}: its {inside} collective(s) count once per run of "
                   "the loop")
    for c in self.collectives:
      lines.append("  " + str(c))
      if not c.ops:
        lines.append("    emitted: nothing (the program does not use its result)")
      elif c.differs:
        lines.append("    emitted: " + "; ".join(str(op) for op in c.ops) + (f" - {c.note}" if c.note else ""))
    if self.combined:
      lines.append("emitted: " + "; ".join(self.combined_text()))
    for role in ("weight", "update state"):
      if any(r.role == role for r in self.state):
        local, total = self.state_bytes(role)
        lines.append(f"{role} variables: {local:,} B per device of {total:,} B")
    lines += [str(x) for x in (self.constants, self.memory) if x is not None]
    lines += [str(p) for p in self.pipelines]
    if self.fallbacks:
      lines.append("replicated fallback for: " + ", ".join(f"{n} ({op})" for n, op in self.fallbacks))
    lines += ["warning: " + w for w in self.warnings]
    return "\n".join(lines)
