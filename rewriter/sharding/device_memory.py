"""The estimate of the emitted per-device program (the memory pass: `report.memory`, an `Account`), by the rules of
`rewriter.sharding.memory` applied to the per-device GraphDef at its static shapes; and the program's memory over
its run (`timeline`).

It holds the plan's count (`memory.plan_estimate`) plus what partitioning adds -- collective receive buffers,
per-device tables and the partition id, reshard temporaries and ops computed above their layout -- which the Account
states as its own line, in parts, next to the plan's count.
"""

import dataclasses
import math
from typing import Optional

import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.rewriter.collectives.vocabulary import TF_COLLECTIVE_OPS
from tf_gspmd.rewriter.graph import functions
from tf_gspmd.rewriter.graph.graph_view import is_control, normalize, ref, split_ref
from tf_gspmd.rewriter.graph.tables import HELPER_SCOPE as HELPER
from tf_gspmd.rewriter.program import variable_shard
from tf_gspmd.rewriter.sharding.memory import CALL_OPS, Buffers, Layouts, MemoryEstimate

_BODY_ATTRS = ("body", "cond", "then_branch", "else_branch", "f")
_NONE = (0, 0, 0)   # bytes partitioning added: (collective buffers, tables and partition id, other)


def _static_shape(t):
  """The static shape of tensor `t` as a tuple (None for unknown dims), or None when its rank is unknown."""
  return None if t.shape.rank is None else tuple(t.shape.as_list())


def _bodies(nd):
  """(attribute, function name) of each function a control-flow NodeDef runs."""
  out = [(a, nd.attr[a].func.name) for a in _BODY_ATTRS if a in nd.attr and nd.attr[a].func.name]
  if "branches" in nd.attr:
    out += [(f"branches/{k}", f.name) for k, f in enumerate(nd.attr["branches"].list.func)]
  return out


def _add(*parts):
  return tuple(sum(p[k] for p in parts) for k in range(3))



def _imported(graph_def, handles):
  """`graph_def` imported for its shapes. A GraphDef does not carry what a resource placeholder's variable holds,
  so the placeholders of `handles` ({name: (shape, dtype)}) are fed by placeholders that say it: variable reads
  get their static shapes, and so does what is computed from them."""
  graph = tf.Graph()
  with graph.as_default():
    feeds = {}
    for k, (name, (shape, dtype)) in enumerate(sorted(handles.items())):
      handle = tf.compat.v1.placeholder(tf.resource, [], name=f"gspmd_memory/handle_{k}")
      _compat.set_resource_shape(handle, tf.TensorShape(shape), dtype)
      feeds[ref(name)] = handle
    tf.graph_util.import_graph_def(graph_def, input_map=feeds or None, name="")
  return graph


def _device_program(graph_def, arguments, variables, results, handles, layouts=None, shapes=None):
  """The `Buffers` of a per-device GraphDef at its static shapes (`variables`: {name: (shape, dtype)}); the
  lists its loops keep and a tensor of unknown static shape take their bytes from `layouts` (the program at
  its layouts), when given."""
  graph = _imported(graph_def, handles)
  outputs = {op.name: [(t.dtype, _static_shape(t)) for t in op.outputs] for op in graph.get_operations()}
  prog = Buffers(graph_def, outputs, arguments,
                  {n: math.prod(s) * d.size for n, (s, d) in variables.items()}, results,
                  layouts.lists if layouts is not None else None, shapes,
                  layouts.size if layouts is not None else None)
  prog.handles = {ref(name): value for name, value in handles.items()}
  return prog


def body_bytes(prog, nd, cache, layouts):
  """(bytes, bytes partitioning added) a call node's bodies hold above their parameters at their static shapes:
  the largest of its functions (`layouts`: the program's own at its layouts, for the lists and what was added)."""
  names = {f.signature.name: f for f in prog.library.function}
  refs = [normalize(i) for i in nd.input if not is_control(i)]
  best = (0, _NONE)
  for attr, fname in _bodies(nd):
    if fname not in names:
      continue
    n = len(names[fname].signature.input_arg)
    args = refs[len(refs) - n:]
    arg_shapes = tuple(prog.static_shape(r) for r in args)
    # (a handle's reads alias its buffer: only an argument that is itself a handle carries one into the body)
    carried = tuple(prog.handles.get(prog.buffer[r]) if prog.dtype(r) == tf.resource else None for r in args)
    child = layouts.bodies.get((nd.name, attr)) if layouts is not None else None
    key = (fname, arg_shapes, carried, id(child))
    if key not in cache:
      gd, params, results = functions.body_graph_def(prog.library, fname, arg_shapes)
      body = _device_program(gd, params, {}, results, {p: h for p, h in zip(params, carried) if h is not None},
                             child)
      est, added = _device_estimate(body, cache, child)
      cache[key] = (est.peak_bytes - est.argument_bytes, added)
    best = max(best, cache[key], key=lambda v: v[0])
  return best


def _device_estimate(prog, cache, layouts):
  """(MemoryEstimate of a per-device program, (collective, tables, other) bytes partitioning added at its peak,
  judged against the program at its layouts; all `_NONE` without them)."""
  calls = {nd.name: body_bytes(prog, nd, cache, layouts) for nd in prog.order if nd.op in CALL_OPS}
  est, live, stop = prog.estimate({name: v[0] for name, v in calls.items()})
  if layouts is None or stop is None:
    return est, _NONE
  plan, names = layouts.size, layouts.names

  def planned(b, renamed=True):   # a tensor of the plan at its layout's bytes (or, renamed, a new name)
    refs = [b] + prog.aliases.get(b, [])
    return any(plan.get(r) == prog.size[b] for r in refs) or renamed and not any(
        split_ref(r)[0] in names or HELPER in split_ref(r)[0] or split_ref(r)[0].startswith(HELPER[1:])
        for r in refs)

  collective = tables = other = 0
  for b, kind in prog.kind.items():
    if kind in ("argument", "constant") and not planned(b, renamed=False):
      tables += prog.size[b]
  for b, nbytes in live.items():
    if prog.op_type(b) in TF_COLLECTIVE_OPS:
      collective += nbytes
    elif not planned(b):
      other += nbytes
  inner = calls.get(prog.order[stop].name, (0, _NONE))[1]
  return est, _add((collective, tables, other), inner)


@dataclasses.dataclass(frozen=True)
class Account(MemoryEstimate):
  """The per-device program's estimate (the MemoryEstimate fields) and the plan's count it is made of: `plan`, the
  global program at its layouts (`plan_estimate`: what `memory_budget` bounds), plus what partitioning adds; at its
  peak `added_collective_bytes` of collective receive buffers, `added_table_bytes` of per-device tables and partition
  id and `added_other_bytes` of reshard temporaries and ops computed at more than their layout are live.
  `difference_bytes` = peak_bytes - plan.peak_bytes is that sum less the plan's bytes not live at the per-device peak
  (`plan_bytes_elsewhere`); negative only where partitioning made the program hold less than the plan (said so)."""

  plan: Optional[MemoryEstimate] = None
  added_collective_bytes: int = 0
  added_table_bytes: int = 0
  added_other_bytes: int = 0
  budget: Optional[int] = None

  @property
  def added_bytes(self):
    return self.added_collective_bytes + self.added_table_bytes + self.added_other_bytes

  @property
  def difference_bytes(self):
    return self.peak_bytes - self.plan.peak_bytes

  def plan_bytes_elsewhere(self):
    """The last term of "partitioning adds" (added_bytes - difference_bytes) as a sum, never "less" a negative."""
    rest = self.added_bytes - self.difference_bytes
    return f"less {rest:,} of the plan's bytes not live there" if rest >= 0 else \
        f"plus {-rest:,} of the plan's own tensors above the plan's peak (more are live there than at the plan's)"

  def __str__(self):
    p, d = self.plan, self.difference_bytes
    lines = [f"the plan at its layouts (what memory_budget bounds): {p.peak_bytes:,} = arguments "
             f"{p.argument_bytes:,} + variables {p.state_bytes:,} + constants {p.constant_bytes:,} + live "
             f"activations {p.activation_bytes:,} at {p.at}",
             f"partitioning adds: {d:+,} = collective buffers {self.added_collective_bytes:,} + per-device tables "
             f"and partition id {self.added_table_bytes:,} + reshard temporaries and ops above their layout "
             f"{self.added_other_bytes:,} live at the per-device peak, {self.plan_bytes_elsewhere()}"
             + (" (the per-device program holds less than the plan's count)" if d < 0 else "")]
    if self.budget is not None:
      over = p.peak_bytes - self.budget
      lines.append(f"memory_budget {self.budget:,}: the plan's count is "
                   + (f"within it ({-over:,} to spare)" if over <= 0 else f"OVER it by {over:,}"))
    return MemoryEstimate.__str__(self) + "".join(f"\n  {line}" for line in lines)


def estimate(graph_def, arguments=(), variables=None, outputs=(), known=None):
  """The MemoryEstimate of a GraphDef whose tensors all have static shapes.

  Args:
    graph_def: the program (with the library of its control-flow bodies).
    arguments: names of its argument Placeholders (live throughout).
    variables: {resource Placeholder name: (shape, dtype) of the variable (shard) behind it} (live throughout).
    outputs: refs ("node:index") of its results (live from when they are computed).
    known: {ref: shape} of tensors whose static shape TF does not infer (a CollectiveGatherV2's first dimension);
      a tensor without a static shape otherwise takes the size of a statically shaped alias of it (the Reshape
      that follows a gather), or counts 0.
  """
  if not graph_def.node:
    return MemoryEstimate(0, 0, 0, 0, 0, 0, "-")
  variables = dict(variables or {})
  known = {r: tuple(s) for r, s in (known or {}).items()}
  prog = _device_program(graph_def, arguments, variables, [normalize(r) for r in outputs], variables, shapes=known)
  return _device_estimate(prog, {}, None)[0]


def _per_device(program):
  """(the `Buffers` of a partitioned program's per-device program, the program at its layouts)."""
  layouts = Layouts(program)
  variables = {name: variable_shard(program, name) for name in program.local_variables}
  variables = {name: shard for name, shard in variables.items() if shard is not None}
  arguments = list(program.local_inputs) + ([program.partition_id] if program.partition_id else [])
  known = {ref(name): tuple(e.shape) for name, e in program.report.emitted().items()}   # what a collective carries
  return _device_program(program.local_graph_def, arguments, variables,
                         [normalize(r) for r in program.local_outputs], variables, layouts, known), layouts


def timeline(program, per_device=None):
  """A partitioned program's memory per device over its run: (bytes of its arguments, variables and constants, held
  throughout; `Buffers.timeline` of its per-device program, its control-flow bodies counted as in `account`).
  `per_device`: `_per_device(program)` when already made."""
  prog, layouts = per_device or _per_device(program)
  cache = {}
  inner = {nd.name: body_bytes(prog, nd, cache, layouts)[0] for nd in prog.order if nd.op in CALL_OPS}
  return sum(prog.persistent(k) for k in ("argument", "state", "constant")), prog.timeline(inner)


def account(program, per_device=None):
  """The Account of a partitioned program: its per-device program's estimate, the plan's count, and what
  partitioning adds. `per_device`: `_per_device(program)` when already made."""
  prog, layouts = per_device or _per_device(program)
  est, added = _device_estimate(prog, {}, layouts)
  auto = program.options.auto if program.auto_plan is not None else None
  return Account(**{f.name: getattr(est, f.name) for f in dataclasses.fields(MemoryEstimate)}, plan=layouts.count(),
                 added_collective_bytes=added[0], added_table_bytes=added[1], added_other_bytes=added[2],
                 budget=getattr(auto, "memory_budget", None))


def run(program):
  """Pass: the per-device program's estimated peak memory and the plan's count, as `report.memory` (an Account,
  computed when first read: a step that only runs never pays for the simulation)."""
  if not program.local_graph_def.node:
    return program.replace(report=program.report.with_memory(lambda: MemoryEstimate(0, 0, 0, 0, 0, 0, "-")))
  made = []

  def per_device():   # the per-device program imported once, for whichever of the two is read first
    if not made:
      made.append(_per_device(program))
    return made[0]
  return program.replace(report=program.report.with_memory(lambda: account(program, per_device()),
                                                           lambda: timeline(program, per_device())))
