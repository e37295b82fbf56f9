"""The memory accounting: one set of rules for the bytes one device holds, applied to the plan and to the program.

The rules (`Buffers` applies them to one graph, given the bytes of each tensor), in the spirit of XLA's buffer
assignment without its reuse of freed memory for other shapes (TF's allocator returns freed blocks to a pool; the
count is of what is live, not of what the pool has grown to):

* Order: TF's executor runs an op as soon as its inputs are ready; the count runs the graph in one such order,
  the stable topological order of `GraphView.order` (deterministic; another valid order can peak elsewhere, which
  is why this is an estimate).
* Buffers: an op allocates its outputs when it runs; a buffer is freed once the last op reading it (through any
  of its aliases) ran. The peak is taken when an op's outputs are allocated and its inputs are still live (an
  op reads its inputs while it writes its outputs), so an op's result and its operands count together.
* Bytes: a tensor takes one device's shard of it at its layout, padding included (`shard_bytes`); in the
  per-device program that is its static shape.
* Live throughout: the arguments (held by the caller), the variables (each device's shard; a resource handle
  itself is free), the constants (a Const kernel keeps its whole tensor for the graph's lifetime, whatever its
  layout; a splat constant partitioning emits as a Fill of the device's shard is an activation instead) and the
  results (from when they are computed to the end). A node nothing reads and without effect does not run.
* Aliases: Identity, XlaSharding, Reshape, ExpandDims, Squeeze, Bitcast, StopGradient and the like forward their
  input's buffer and allocate nothing. ReadVariableOp forwards the variable's buffer too: TF's kernel hands out the
  variable's tensor, not a copy (copy-on-write after a later write is not counted).
* Control flow: a While/If/function call runs its body on the op's inputs (already live) and produces its
  outputs. Its body's own peak (the body counted by these rules, less its parameters; the largest of its
  functions) is added on top of what is live at the op: one iteration's temporaries.
* Lists kept for the backward: a TensorList a While returns after its body grows it by one element per
  iteration (the forward loop's intermediates, which its gradient loop pops) holds trips x element bytes (the
  trip count read off the loop's condition, `loops.trip_count`; a loop of unknown count: one element). Other
  opaque values (variants, strings) count 0 bytes.

Applied twice, the same rules both times:

* The plan's count (`plan_estimate`; `rewriter.sharding.auto.plan_memory`; what `memory_budget` bounds): the global
  program after completion with every tensor at its layout, every control-flow body at the layouts completion
  gave it. It needs no partitioning, so automatic sharding can count a plan before it is emitted.
* The estimate of the emitted per-device program (`rewriter.sharding.device_memory`: the memory pass,
  `report.memory`, an `Account`): the per-device
  GraphDef at its static shapes. It holds the plan plus what partitioning adds -- collective receive buffers,
  per-device tables and the partition id, reshard temporaries and ops computed above their layout -- which the
  Account states as its own line, in parts, next to the plan's count. The plan's tensors live at the per-device
  peak are live together in the plan too, so the estimate is at most the count plus those parts (up to how
  partitioning reorders ops). It can be below the count where partitioning frees a tensor of the plan earlier (a
  reshard reads it right after it is made) and the per-device program peaks lower; the Account then says so.

Automatic sharding prices the same live sets at the layouts it considers (`rewriter.sharding.auto.budget`, through
`Buffers`).

Linear in the graph (walks in topological order and one import of each GraphDef for its shapes).
"""

import dataclasses
import functools
import heapq
import math
from typing import Optional, Tuple

import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.basic import WHOLE_SPLAT_BYTES, splat_value
from tf_gspmd.rewriter.sharding import completion
from tf_gspmd.rewriter.graph import loops
from tf_gspmd.rewriter.collectives.vocabulary import TF_COLLECTIVE_OPS
from tf_gspmd.rewriter.graph.graph_view import GraphView, is_control, normalize, ref, split_ref
from tf_gspmd.rewriter.program import variable_shard
from tf_gspmd.rewriter.report import shape_text

@dataclasses.dataclass(frozen=True)
class LiveBuffer:
  """A buffer live at the estimated peak: the op that allocated it and its size on one device."""

  op: str
  op_type: str
  dtype: str
  shape: Optional[Tuple[Optional[int], ...]]   # None: a tensor of unknown rank
  bytes: int

  def __str__(self):
    return f"{self.op} ({self.op_type}) {self.dtype}[{shape_text(self.shape)}] {self.bytes:,} B"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Peak bytes one device holds while running the per-device program (`rewriter.sharding.device_memory`).

  `peak_bytes` = arguments + state + constants + activations, all at the peak; `collective_bytes` is the part of
  the activations that collectives produced (their receive buffers). `at` is the op running at the peak and
  `largest` the largest buffers live there (up to five).
  """

  peak_bytes: int
  argument_bytes: int
  state_bytes: int
  constant_bytes: int
  activation_bytes: int
  collective_bytes: int
  at: str
  largest: Tuple[LiveBuffer, ...] = ()

  def __str__(self):
    largest = "; ".join(str(b) for b in self.largest)
    return (f"peak memory {self.peak_bytes:,} B per device (estimate): arguments {self.argument_bytes:,} + variables "
            f"{self.state_bytes:,} + constants {self.constant_bytes:,} + live activations {self.activation_bytes:,} "
            f"(collective buffers {self.collective_bytes:,}) at {self.at}"
            + (f"; largest: {largest}" if largest else ""))


# Ops whose output k is their input k's buffer (IdentityN: every output; the others: output 0).
ALIASING_OPS = frozenset({"Identity", "IdentityN", "XlaSharding", "Reshape", "ExpandDims", "Squeeze", "Bitcast",
                          "StopGradient", "PreventGradient", "EnsureShape", "CheckNumerics", "ReadVariableOp"})
CONSTANT_OPS = frozenset({"Const", "HostConst"})
CALL_OPS = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase", "PartitionedCall",
                      "StatefulPartitionedCall"})
WHILE_OPS = frozenset({"While", "StatelessWhile"})
_OPAQUE = (tf.resource, tf.variant, tf.string)
LARGEST = 5


def shard_elements(shape, sharding=None):
  """Elements of one device's shard of a tensor of `shape` laid out as `sharding` (None: whole), padding
  included."""
  shape = tuple(int(d) for d in shape)
  if sharding is not None and shape:
    shape = sharding.tiled(len(shape)).shard_shape(shape)
  return math.prod(shape)


def shard_bytes(shape, dtype, sharding=None):
  """Bytes one device holds of a tensor of `shape` and `dtype` laid out as `sharding` (None: whole); 0 for an
  opaque value or an unknown shape."""
  if shape is None or dtype is None or dtype in _OPAQUE:
    return 0
  return shard_elements(shape, sharding) * dtype.size


def _static_bytes(dtype, shape):
  """Bytes of a tensor of static `shape`; 0 when opaque, None when its shape is not fully known."""
  if dtype in _OPAQUE:
    return 0
  if shape is None or any(d is None for d in shape):
    return None
  return math.prod(shape) * dtype.size


def _runs(order, results, kept):
  """The nodes of `order` that run and hold memory: those the results or a stateful op read (TF prunes the
  others; what is only a control input of a stateless op, such as a constant, holds nothing the program keeps),
  and the Placeholders of `kept` (arguments and variables the caller holds either way)."""
  if not results:   # (a graph without results: every node counts)
    return list(order)
  by_name = {nd.name: nd for nd in order}
  stack = [split_ref(r)[0] for r in results] + [nd.name for nd in order if nd.name in kept or _stateful(nd.op)]
  live = set()
  while stack:
    name = stack.pop()
    if name in live or name not in by_name:
      continue
    live.add(name)
    nd = by_name[name]
    stack.extend(split_ref(i[1:] if is_control(i) else i)[0] for i in nd.input
                 if not is_control(i) or _stateful(nd.op))
  return [nd for nd in order if nd.name in live]


@functools.lru_cache(maxsize=None)
def _stateful(op_type):
  op_def = _compat.op_def(op_type)
  return op_def is not None and op_def.is_stateful and op_type != "NoOp"


class Buffers:
  """One graph's buffers under the rules: who allocates what and of which kind, how many bytes, how many reads
  each buffer has, which ones never die.

  `outputs`: {node name: [(dtype, static shape or None)]}; `arguments`: Placeholder names; `variables`:
  {Placeholder name: bytes of the variable (shard) behind it}; `results`: refs; `sizes`: {ref: bytes} overriding
  the static bytes; `shapes`: {ref: shape} where the static one is not known (a gather's first dim); `fallback`:
  {ref: bytes} of a tensor whose static shape is not known otherwise (a list element popped in a loop body);
  `fills`: constants that are computed where used instead (splats partitioning emits as Fills of the shard).
  """

  def __init__(self, graph_def, outputs, arguments=(), variables=None, results=(), sizes=None, shapes=None,
               fallback=None, fills=()):
    variables, sizes, shapes, arguments = variables or {}, sizes or {}, shapes or {}, set(arguments)
    fallback = fallback or {}
    self.library = graph_def.library
    self.order = _runs(GraphView(graph_def).order(), results, arguments | set(variables))
    self.types = {nd.name: nd.op for nd in self.order}
    self.outputs = outputs
    self.handles = {}       # buffer -> (shape, dtype) of the variable behind a resource handle
    self.buffer = {}        # tensor ref -> the ref of the buffer it is (itself, or what it aliases)
    self.aliases = {}       # buffer ref -> the other refs that are it
    self.size = {}          # buffer ref -> bytes
    self.kind = {}          # buffer ref -> "argument", "state", "constant" or "activation"
    self.shape = {}         # buffer ref -> its shape, for listing
    self.reads = {}         # buffer ref -> number of op inputs reading it
    unsized = set()
    for nd in self.order:
      inputs = [self.buffer[normalize(i)] for i in nd.input if not is_control(i)]
      for b in inputs:
        self.reads[b] = self.reads.get(b, 0) + 1
      for k, (dtype, shape) in enumerate(outputs[nd.name]):
        r = ref(nd.name, k)
        if nd.op in ALIASING_OPS and k < len(inputs) and (k == 0 or nd.op == "IdentityN"):
          b = self.buffer[r] = inputs[k]
          self.aliases.setdefault(b, []).append(r)
          if b in unsized and _static_bytes(dtype, shape):   # e.g. the static reshape after a gather
            self.size[b], self.shape[b] = _static_bytes(dtype, shape), shape
            unsized.discard(b)
          continue
        self.buffer[r] = r
        self.shape[r] = tuple(shapes[r]) if r in shapes else shape
        nbytes = sizes.get(r, _static_bytes(dtype, self.shape[r]))
        if nbytes is None:
          nbytes = fallback.get(r)
        if nbytes is None:
          unsized.add(r)
        self.size[r] = nbytes or 0
        if nd.name in variables:
          self.kind[r], self.size[r] = "state", variables[nd.name]
        elif nd.name in arguments:
          self.kind[r] = "argument"
        else:
          self.kind[r] = "constant" if nd.op in CONSTANT_OPS and nd.name not in fills else "activation"
    self.pinned = {b for b, kind in self.kind.items() if kind != "activation"} | {self.buffer[normalize(r)]
                                                                                  for r in results}

  def dtype(self, r):
    name, k = split_ref(r)
    return self.outputs[name][k][0]

  def static_shape(self, r):
    """The static shape of tensor `r` (what a gather carries where TF does not know it), or None."""
    name, k = split_ref(r)
    shape = self.outputs[name][k][1]
    if (shape is None or None in shape) and r in self.shape:
      shape = self.shape[r]
    return None if shape is None or None in shape else tuple(shape)

  def op_type(self, r):
    return self.types[split_ref(r)[0]]

  def persistent(self, kind, size=None):
    size = self.size if size is None else size
    return sum(size[b] for b, k in self.kind.items() if k == kind)

  def _live(self, inner, size):
    """Per op in run order: (index, node, {buffer: bytes} of the activations live while it runs, their bytes plus
    those of its bodies in `inner`, {call node: bytes})."""
    left = dict(self.reads)
    live, live_bytes = {}, 0
    for step, nd in enumerate(self.order):
      mine = [r for r in (ref(nd.name, k) for k in range(len(self.outputs[nd.name])))
              if self.kind.get(r) == "activation"]
      for r in mine:
        live[r] = size[r]
        live_bytes += size[r]
      yield step, nd, live, live_bytes + inner.get(nd.name, 0)
      for i in nd.input:
        if is_control(i):
          continue
        b = self.buffer[normalize(i)]
        left[b] -= 1
        if not left[b] and b in live and b not in self.pinned:
          live_bytes -= live.pop(b)
      for r in mine:
        if not self.reads.get(r) and r not in self.pinned:
          live_bytes -= live.pop(r)

  def walk(self, inner, size=None, stop=None):
    """Without `stop`: the index of the op at which the activations (and the bodies of `inner`, {call node:
    bytes}) peak. With it: {buffer: bytes} of the activations live at that op."""
    best, best_at = -1, 0
    for step, _, live, total in self._live(inner, self.size if size is None else size):
      if step == stop:
        return dict(live)
      if total > best:
        best, best_at = total, step
    return best_at

  def timeline(self, inner):
    """[(op name, op type, bytes of the activations live while it runs, its bodies' included)] in run order."""
    return [(nd.name, nd.op, total) for _, nd, _, total in self._live(inner, self.size)]

  def estimate(self, inner, size=None):
    """(MemoryEstimate at the peak, the live activations there, the peak's op index)."""
    size = self.size if size is None else size
    if not self.order:
      return MemoryEstimate(0, 0, 0, 0, 0, 0, "-"), {}, None
    stop = self.walk(inner, size)
    live = self.walk(inner, size, stop)
    nd = self.order[stop]
    extra = inner.get(nd.name, 0)
    buffers = [LiveBuffer(split_ref(r)[0], self.op_type(r), self.dtype(r).name, self.shape.get(r), b)
               for r, b in heapq.nlargest(LARGEST, live.items(), key=lambda kv: (kv[1], kv[0]))]
    if extra:   # a control-flow op's bodies, as one buffer
      buffers = sorted(buffers + [LiveBuffer(nd.name, f"{nd.op} body", "-", (), extra)],
                       key=lambda b: -b.bytes)[:LARGEST]
    parts = [self.persistent(k, size) for k in ("argument", "state", "constant")]
    activations = sum(live.values()) + extra
    collective = sum(b for r, b in live.items() if self.op_type(r) in TF_COLLECTIVE_OPS)
    return MemoryEstimate(peak_bytes=sum(parts) + activations, argument_bytes=parts[0], state_bytes=parts[1],
                          constant_bytes=parts[2], activation_bytes=activations, collective_bytes=collective,
                          at=f"{nd.name} ({nd.op})", largest=tuple(buffers)), live, stop


# ----------------------------------------------------------------------------------------------------------
# A program at its layouts (the plan's count)


def ir_outputs(ir):
  """{node name: [(dtype, static shape)]} of a graph_ir.Graph, as `Buffers` takes them."""
  return {n.name: [(info.dtype, info.shape) for info in n.outputs] for n in ir.nodes}


def loop_results(library, node):
  """Per loop variable of While `node`: what its body returns for it, past identities -- "pushed" (a list grown by
  one element), "kept" (the parameter itself: the variable is loop-invariant) or None (computed)."""
  fdef = next((f for f in library.function if f.signature.name == node.attr("body").name), None)
  if fdef is None:
    return []
  nodes = {n.name: n for n in fdef.node_def}
  params = [a.name for a in fdef.signature.input_arg]
  out = []
  for k, arg in enumerate(fdef.signature.output_arg):
    t, what = fdef.ret[arg.name], None
    for _ in range(16):
      if t.split(":")[0] == (params[k] if k < len(params) else None):
        what = "kept"
        break
      nd = nodes.get(t.split(":")[0])
      if nd is None or nd.op not in ("Identity", "TensorListPushBack"):
        break
      if nd.op == "TensorListPushBack":
        what = "pushed"
        break
      t = nd.input[0]
    out.append(what)
  return out


def _pushed(library, node):
  """Indices of the loop variables of While `node` its body grows by one element per iteration."""
  return {k for k, what in enumerate(loop_results(library, node)) if what == "pushed"}


def kept_lists(ir, layout):
  """{ref: bytes} of the lists the While nodes of `ir` keep: trips x element at `layout(ref)` (None: whole)."""
  out = {}
  for node in ir.nodes:
    if node.op not in WHILE_OPS:
      continue
    pushed = [k for k in sorted(_pushed(ir.graph_def.library, node))
              if k < len(node.outputs) and node.outputs[k].is_list]
    if not pushed:
      continue
    n, at_most = loops.trip_count(ir, node.name)
    trips = n if n is not None else (at_most if at_most is not None else 1)
    for k in pushed:
      info = node.outputs[k]
      out[node.ref(k)] = trips * shard_bytes(info.value_shape, info.value_dtype, layout(node.ref(k)))
  return out


def fills(ir, layout):
  """Names of the splat constants of `ir` that partitioning emits as Fills of each device's shard where they are
  used (ops/basic.py's Constant rule: split, or replicated above WHOLE_SPLAT_BYTES), at `layout(ref)` (None: not
  known yet -- every splat, as if split): computed like activations, not held as constants."""
  out = set()
  for node in ir.nodes:
    if node.op != "Const" or not node.outputs[0].partitionable:
      continue
    info, s = node.outputs[0], layout(node.ref(0))
    if s is not None and (s.is_maximal or s.is_replicated and
                          math.prod(info.shape) * info.dtype.size <= WHOLE_SPLAT_BYTES):
      continue
    if splat_value(node.attr("value")) is not None:
      out.add(node.name)
  return out


def _completed_bodies(program, node):
  """(attribute, completed body Program) of control-flow node `node`, for the layouts partitioning gives them."""
  mesh, sh = program.mesh, program.shardings
  shapes = [node.input_info(i).shape for i in range(len(node.inputs))]
  outs = [sh.get(node.ref(o)) or Sharding(mesh) for o in range(len(node.outputs))]
  if node.op in WHILE_OPS:
    keys = [("body", shapes, outs, outs), ("cond", shapes, outs, [Sharding(mesh)])]
  elif node.op in ("If", "StatelessIf"):
    arrive = [sh.get(r) or Sharding(mesh) for r in node.inputs[1:]]
    keys = [(a, shapes[1:], arrive, outs) for a in ("then_branch", "else_branch")]
  elif node.op in ("PartitionedCall", "StatefulPartitionedCall"):
    keys = [("f", shapes, [sh.get(r) or Sharding(mesh) for r in node.inputs], outs)]
  else:
    return []
  found = []
  for attr, arg_shapes, params, results in keys:
    try:
      found.append((attr, completion.body_program(program, node.attr(attr).name, arg_shapes, params, results)))
    except Exception:  # pylint: disable=broad-except
      continue   # (not completed for these layouts: the body is not counted)
  return found


class Layouts:
  """A completed program's tensors at their layouts: bytes per device of each (`size`), of the lists its loops
  keep (`lists`, included in `size`), of its variables, and the same for its control-flow bodies
  (`bodies[(node, attribute)]`)."""

  def __init__(self, program):
    ir, sh = program.ir, program.shardings or {}
    self.program = program
    self.names = {node.name for node in ir.nodes}
    self.size, self.lists = {}, {}
    self.fills = fills(ir, sh.get)
    for node in ir.nodes:   # (a constant other than a Fill is held whole: sliced where used split)
      held = node.op in CONSTANT_OPS and node.name not in self.fills
      for k, info in enumerate(node.outputs):
        if info.partitionable:
          self.size[node.ref(k)] = shard_bytes(info.shape, info.dtype, None if held else sh.get(node.ref(k)))
    self.lists = kept_lists(ir, sh.get)
    self.size.update(self.lists)
    self.variables = {}
    for name in program.variable_names:
      shard = variable_shard(program, name)
      if shard is not None:
        self.variables[name] = math.prod(shard[0]) * shard[1].size
    self.bodies = {(node.name, attr): Layouts(sub) for node in ir.nodes if node.op in CALL_OPS
                   for attr, sub in _completed_bodies(program, node)}
    self._count = None

  def count(self):
    """MemoryEstimate of the program at its layouts (bodies at theirs)."""
    if self._count is None:
      program = self.program
      prog = Buffers(program.ir.graph_def, ir_outputs(program.ir), program.input_names, self.variables,
                      program.output_refs, self.size, fills=self.fills)
      inner = {nd.name: self.inner(nd.name) for nd in prog.order if nd.op in CALL_OPS}
      self._count = prog.estimate(inner)[0]
    return self._count

  def inner(self, name):
    """Bytes the bodies of control-flow node `name` hold above their parameters (the largest of them)."""
    return max([body.above_parameters() for (n, _), body in self.bodies.items() if n == name] or [0])

  def above_parameters(self):
    est = self.count()
    return est.peak_bytes - est.argument_bytes


def plan_estimate(program):
  """The plan's count: MemoryEstimate of a completed program's global graph with every tensor at its layout
  (what `memory_budget` bounds; the per-device program holds this plus what partitioning adds)."""
  return Layouts(program).count()
