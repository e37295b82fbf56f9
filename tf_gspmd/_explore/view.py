"""What the plan's pictures show, read once off a lowering (`PlanView.of`): the global graph with every tensor's
layout and why completion chose it, the per-device program with its collectives (kind, mesh axes, group, bytes and
the global op each serves), the per-device memory over the program's run with its peak, the layouts of the
arguments, variables and results as tile grids, the bytes per layer, and the warnings (ops without a rule,
involuntary gathers, uneven padding). The page (`page.py`) and Model Explorer (`explorer.py`) draw the same view.

Nothing here is sized by the model: a view holds names, shapes, layouts and counts, not values, so the paper's
128B plan makes a view of its graph's size.
"""

import collections
import dataclasses
from typing import Optional, Tuple

from tf_gspmd._visualize import tile_grid
from tf_gspmd.rewriter.graph.graph_view import is_control, normalize, public_key, split_ref

# A colour per mesh axis (by its index); a tensor split over several axes takes its first one's.
AXIS_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f")
REPLICATED = "#d0d0d0"
WARNING = "#e15759"
GRADIENT_SCOPES = ("gradient_tape", "gradients")
TOP_LEVEL = "(top level)"


def axis_colour(mesh, axes):
  """The colour of a layout split over `axes` (mesh axis names); grey when it is replicated."""
  return AXIS_COLOURS[mesh.axis_names.index(axes[0]) % len(AXIS_COLOURS)] if axes else REPLICATED


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One output of a global op: its shape, layout and why completion chose the layout."""
  ref: str
  shape: Optional[Tuple[Optional[int], ...]]
  dtype: str
  sharding: str
  axes: Tuple[str, ...]        # the mesh axes it is split over, in dim order
  why: str
  uneven: bool                 # a split dim is not a multiple of its shards: the last shards are padded


@dataclasses.dataclass(frozen=True)
class Op:
  """A node of a graph drawn: its inputs as (node, output index), its layer path (namespace)."""
  name: str
  op: str
  namespace: str
  inputs: Tuple[Tuple[str, int], ...]
  outputs: Tuple[Tensor, ...] = ()


@dataclasses.dataclass(frozen=True)
class Collective:
  """A collective op of the per-device program and the logical collective it carries."""
  name: str                    # the op in the per-device program (or the control-flow node whose body holds it)
  kind: str
  op: str
  dtype: str
  shape: Tuple[int, ...]
  axes: Tuple[str, ...]
  group_size: int
  bytes: int                   # per device, per run
  times: int                   # runs per step
  source: str                  # the global op it serves
  reason: str
  inside: str = ""             # the control-flow node whose body holds it, where it is in one
  shares: Tuple[Tuple[str, int], ...] = ()   # (op served, its bytes of `bytes`) for each op a combined one serves

  @property
  def step_bytes(self):
    return self.bytes * self.times

  @property
  def label(self):
    return f"{self.kind} {self.bytes:,} B"


@dataclasses.dataclass(frozen=True)
class PlanWarning:
  kind: str                    # "no rule", "involuntary gather", "uneven padding", "plan"
  node: str                    # the global op it is about ("" when none)
  text: str


@dataclasses.dataclass(frozen=True)
class Tiles:
  """A tensor's layout as tiles of its dims 0 and 1 (`_visualize.tile_grid`)."""
  name: str
  role: str                    # "argument", "variable" or "result"
  shape: Tuple[int, ...]
  sharding: str
  axes: Tuple[str, ...]
  rows: int
  cols: int
  cells: dict                  # {(row, col): mesh positions}
  bounds: list                 # [row ranges, column ranges]


@dataclasses.dataclass(frozen=True)
class Memory:
  """Bytes one device holds over the per-device program's run: `held` throughout (arguments, variables,
  constants) plus the activations live at each op of `timeline` [(op, op type, bytes)]; `peak` its index."""
  held: int
  timeline: Tuple[Tuple[str, str, int], ...]
  peak: int

  @property
  def peak_bytes(self):
    return self.held + self.timeline[self.peak][2] if self.timeline else self.held


@dataclasses.dataclass(frozen=True)
class PlanView:
  title: str
  mesh: object
  global_ops: Tuple[Op, ...]
  device_ops: Tuple[Op, ...]
  collectives: Tuple[Collective, ...]
  warnings: Tuple[PlanWarning, ...]
  memory: Optional[Memory]
  tiles: Tuple[Tiles, ...]

  @staticmethod
  def of(lowered, title=None):
    """The view of a `Lowered` (tf_gspmd's partition: its global graph, report and per-device program)."""
    program = lowered.program
    mesh = program.mesh
    global_ops = tuple(_global_ops(program))
    collectives = tuple(_collectives(program.report))
    device = tuple(_ops(program.local_graph_def))
    memory = None
    if program.report.memory_timeline is not None:
      held, timeline = program.report.memory_timeline
      peak = max(range(len(timeline)), key=lambda k: timeline[k][2]) if timeline else 0
      memory = Memory(held, tuple(timeline), peak)
    name = getattr(program.fn, "__name__", "function")
    return PlanView(title=title or f"{name} on mesh {mesh}", mesh=mesh, global_ops=global_ops, device_ops=device,
                    collectives=collectives, warnings=tuple(_warnings(program.report, global_ops)), memory=memory,
                    tiles=tuple(_tiles(program)))

  def collectives_of(self):
    """{per-device op name: [Collective]} (a combined op or a loop carries several)."""
    out = collections.defaultdict(list)
    for c in self.collectives:
      out[c.name].append(c)
    return dict(out)

  def layers(self):
    """[(layer, bytes per device per step)] of the collectives, by the layer of the op each serves (a combined op's
    bytes shared out among the ops it serves), in program order of first appearance."""
    names = {op.name for op in self.global_ops}
    depth = _layer_depth([(source, b * c.times) for c in self.collectives for source, b in c.shares])
    out = {}
    for c in self.collectives:
      for source, nbytes in c.shares:
        key = layer_of(source, depth)
        if key in names:   # the gradient of an op outside every scope: gradient_tape/<op>/...
          key = TOP_LEVEL
        out[key] = out.get(key, 0) + nbytes * c.times
    return list(out.items())

  @property
  def step_bytes(self):
    return sum(c.step_bytes for c in self.collectives)


def namespace(name):
  """The layer path of a node (its name's scopes, the op's own name left out)."""
  return name.rpartition("/")[0]


def layer_of(name, depth=1):
  """The first `depth` scopes of a node's name, a gradient scope (gradient_tape/...) dropped so that the forward op
  and its gradient fall into one layer; "(top level)" for an op outside every scope."""
  scopes = name.split("/")[:-1]
  while scopes and scopes[0] in GRADIENT_SCOPES:
    scopes = scopes[1:]
  return "/".join(scopes[:depth]) or TOP_LEVEL


def _layer_depth(shares):
  """1, or deeper while one scope holds more than half of the bytes and splits further (a model's own name scope
  around its layers: `functional_1/l0_attn`, ...). `shares`: [(op, bytes)]."""
  total = sum(b for _, b in shares) or 1
  depth = 1
  while shares and depth < 4:
    by = {}
    for name, b in shares:
      by[layer_of(name, depth)] = by.get(layer_of(name, depth), 0) + b
    top = max(by, key=by.get)
    inner = {layer_of(n, depth + 1) for n, _ in shares if layer_of(n, depth) == top}
    if by[top] * 2 <= total or len(inner) < 2:
      return depth
    depth += 1
  return depth


def _split_axes(sharding):
  return () if sharding.is_maximal else tuple(a for axes in sharding.dims for a in axes)


def _global_ops(program):
  ir, shardings, why = program.ir, program.shardings, program.explanations or {}
  for node in ir.nodes:
    outs = []
    for k, info in enumerate(node.outputs):
      r = node.ref(k)
      s = shardings.get(r)
      if s is None:
        continue
      shape = None if info.shape is None else tuple(info.shape)
      uneven = bool(shape) and not s.is_maximal and any(
          d is not None and d % s.tiles(i) for i, d in enumerate(shape[:s.rank]))
      outs.append(Tensor(public_key(r), shape, info.dtype.name, str(s), _split_axes(s), why.get(r, ""), uneven))
    yield Op(node.name, node.op, namespace(node.name), tuple(split_ref(r) for r in node.inputs), tuple(outs))


def _ops(graph_def):
  for nd in graph_def.node:
    yield Op(nd.name, nd.op, namespace(nd.name),
             tuple(split_ref(normalize(i)) for i in nd.input if not is_control(i)))


def _collectives(report):
  """One Collective per collective op of the per-device program (as the report counts them: a combined op once,
  carrying the ops its records name)."""
  ops = {}
  for record in report.collectives:
    for e in record.ops:
      key = (record.within, e.name)
      if key in ops:
        ops[key][1].append(record)
      else:
        ops[key] = (e, [record])
  for (within, _), (e, records) in ops.items():
    first = records[0]
    sources = list(dict.fromkeys(r.source for r in records))
    logical = sum(r.bytes for r in records) or 1
    shares = tuple((r.source, e.bytes * r.bytes // logical) for r in records)
    yield Collective(name=within[0] if within else e.name, kind=e.kind, op=e.op, dtype=e.dtype,
                     shape=tuple(e.shape), axes=tuple(e.axes), group_size=e.group_size, bytes=e.bytes,
                     times=first.times, source=sources[0], reason=first.reason + (
                         f" (and {len(sources) - 1} more ops' collectives combined into it)" if len(sources) > 1
                         else ""), inside=within[0] if within else "", shares=shares)


def _warnings(report, global_ops):
  out = [PlanWarning("no rule", node, f"op type {op} has no partitioning rule: its operands are replicated and it runs "
                                  f"whole on every device") for node, op in report.fallbacks]
  out += [PlanWarning("involuntary gather", c.source, str(c)) for c in report.rematerializations]
  flagged = {c.source for c in report.rematerializations}
  out += [PlanWarning("plan", "", w) for w in report.warnings if not any(s and s in w for s in flagged)]
  uneven = {t.ref for op in global_ops for t in op.outputs if t.uneven}
  for op in global_ops:
    if any(public_key(f"{src}:{k}") in uneven for src, k in op.inputs):
      continue   # padded where its operand already was: the warning is the operand's
    for t in op.outputs:
      if t.uneven:
        out.append(PlanWarning("uneven padding", op.name, f"{t.ref} {list(t.shape)} laid out {t.sharding}: a split dim "
                                                       f"is not a multiple of its shards, the last shards are padded"))
  return out


def _tiles(program):
  mesh = program.mesh
  entries = [(name, "argument", tuple(spec.shape.as_list()), s) for name, spec, s in
             zip(program.input_names, program.arg_specs, program.param_shardings)]
  entries += [(getattr(v, "name", name), "variable", tuple(v.shape.as_list()), s) for name, v, s in
              zip(program.variable_names, program.variables, program.variable_shardings)]
  entries += [(f"result {k}", "result", tuple(shape), s) for k, (s, shape, _) in enumerate(program.output_specs)]
  for name, role, shape, s in entries:
    if s is None or any(d is None for d in shape):
      continue
    rows, cols, cells, bounds = tile_grid(s, shape)
    yield Tiles(name, role, shape, str(s), _split_axes(s) if s.mesh is mesh else (), rows, cols, cells, bounds)
