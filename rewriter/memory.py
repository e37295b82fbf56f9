"""The memory pass: an estimate of the peak bytes one device holds while it runs the per-device program.

In the spirit of XLA's buffer assignment, without its reuse of freed memory for other shapes (TF's allocator
returns freed blocks to a pool; the estimate counts what is live, not what the pool has grown to):

* Order: TF's executor runs an op as soon as its inputs are ready; the estimate runs the GraphDef in one such
  order, the stable topological order of `GraphView.order` (deterministic; another valid order can peak
  elsewhere, which is why this is an estimate).
* Buffers: an op allocates its outputs when it runs; a buffer is freed once the last op reading it (through any
  of its aliases) ran. The peak is taken when an op's outputs are allocated and its inputs are still live (an
  op reads its inputs while it writes its outputs), so an op's result and its operands count together.
* Live throughout: the program's arguments (held by the caller), its variables (the bytes of each device's
  shard, as the report's `state` records count them; a resource handle itself is free), its constants (a Const
  kernel keeps its tensor for the graph's lifetime; the per-device tables partitioning adds are among them)
  and its results (from when they are computed to the end).
* Aliases: Identity, Reshape, ExpandDims, Squeeze, Bitcast, StopGradient and the like forward their input's
  buffer and allocate nothing. ReadVariableOp forwards the variable's buffer too: TF's kernel hands out the
  variable's tensor, not a copy, unless the variable is in copy-on-read mode (which only some distribution
  strategies use); a write while a read of the same variable is still live copies (copy-on-write), which the
  estimate does not count.
* Control flow: a While/If/function call runs its body on the op's inputs (the loop-carried values, already
  live) and produces its outputs. Its body's own peak (the body estimated the same way, minus its parameters)
  is added on top of what is live at the op, approximately: one iteration's temporaries, not the last
  iteration's values still held by the loop while the next one starts.
* Opaque values (variants such as TensorLists, strings) count 0 bytes: their size is not in their shape.

It is linear in the graph (two walks in topological order and one import of the GraphDef for its shapes), so
lowering for thousands of devices stays fast.
"""

import heapq
import math

import tensorflow as tf

from tf_gspmd import _compat
from tf_gspmd.rewriter import functions
from tf_gspmd.rewriter.vocabulary import TF_COLLECTIVE_OPS
from tf_gspmd.rewriter.graph_view import GraphView, function_names, is_control, normalize, ref
from tf_gspmd.rewriter.partition import variable_shard
from tf_gspmd.rewriter.report import LiveBuffer, MemoryEstimate

# Ops whose output k is their input k's buffer (IdentityN: every output; the others: output 0).
ALIASING_OPS = frozenset({"Identity", "IdentityN", "Reshape", "ExpandDims", "Squeeze", "Bitcast", "StopGradient",
                          "PreventGradient", "EnsureShape", "CheckNumerics", "ReadVariableOp"})
CONSTANT_OPS = frozenset({"Const", "HostConst"})
CALL_OPS = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase", "PartitionedCall",
                      "StatefulPartitionedCall"})
_OPAQUE = (tf.resource, tf.variant, tf.string)
LARGEST = 5


def _static_shape(t):
  """The static shape of tensor `t` as a tuple (None for unknown dims), or None when its rank is unknown."""
  return None if t.shape.rank is None else tuple(t.shape.as_list())


def _bytes(t):
  if t.dtype in _OPAQUE or not t.shape.is_fully_defined():
    return 0
  return t.shape.num_elements() * t.dtype.size


class _Program:
  """One GraphDef's buffers: who allocates what, how many reads each buffer has, which ones never die."""

  def __init__(self, graph_def, arguments, variables, outputs, known=None, handles=None):
    handles = dict(handles or {})
    graph = _imported(graph_def, handles)
    self.handles = {ref(name): value for name, value in handles.items()}   # buffer -> (shape, dtype) behind it
    self.library = graph_def.library
    self.order = GraphView(graph_def).order()
    self.ops = {op.name: op for op in graph.get_operations()}
    self.buffer = {}        # tensor ref -> the ref of the buffer it is (itself, or what it aliases)
    self.size = {}          # buffer ref -> bytes (activations only)
    self.shape = {}         # buffer ref -> its static shape, where TF did not infer it
    self.reads = {}         # buffer ref -> number of op inputs reading it
    self.argument_bytes = self.state_bytes = self.constant_bytes = 0
    known = known or {}
    persistent, unsized = set(), set()
    for nd in self.order:
      op = self.ops[nd.name]
      inputs = [self.buffer[normalize(i)] for i in nd.input if not is_control(i)]
      for b in inputs:
        self.reads[b] = self.reads.get(b, 0) + 1
      for k, t in enumerate(op.outputs):
        r = ref(nd.name, k)
        if nd.op in ALIASING_OPS and k < len(inputs) and (k == 0 or nd.op == "IdentityN"):
          self.buffer[r] = inputs[k]
          if inputs[k] in unsized and t.shape.is_fully_defined():   # e.g. the static reshape after a gather
            self.size[inputs[k]] = _bytes(t)
            self.shape[inputs[k]] = tuple(t.shape.as_list())
            unsized.discard(inputs[k])
          continue
        self.buffer[r] = r
        if nd.name in variables:
          self.state_bytes += math.prod(variables[nd.name][0]) * variables[nd.name][1].size
          persistent.add(r)
        elif nd.name in arguments:
          self.argument_bytes += _bytes(t)
          persistent.add(r)
        elif nd.op in CONSTANT_OPS:
          self.constant_bytes += _bytes(t)
          persistent.add(r)
        elif r in known and t.dtype not in _OPAQUE:
          self.shape[r] = tuple(known[r])
          self.size[r] = math.prod(known[r]) * t.dtype.size
        else:
          self.size[r] = _bytes(t)
          if t.dtype not in _OPAQUE and not t.shape.is_fully_defined():
            unsized.add(r)
    self.pinned = persistent | {self.buffer[r] for r in outputs}

  def _inner(self, nd, cache):
    """Bytes a control-flow op's bodies hold above their parameters (the largest of its functions)."""
    op = self.ops[nd.name]
    shapes = [t.shape for t in op.inputs]
    names = {f.signature.name: f for f in self.library.function}
    most = 0
    for fname in function_names(nd):
      if fname not in names:
        continue
      n = len(names[fname].signature.input_arg)
      arg_shapes = tuple(tuple(s.as_list()) if s.is_fully_defined() else None for s in shapes[len(shapes) - n:])
      # (a handle's reads alias its buffer: only an argument that is itself a handle carries one into the body)
      carried = tuple(self.handles.get(self.buffer[normalize(i)]) if t.dtype == tf.resource else None
                      for i, t in zip([i for i in nd.input if not is_control(i)][len(shapes) - n:],
                                      op.inputs[len(shapes) - n:]))
      key = (fname, arg_shapes, carried)
      if key not in cache:
        gd, params, results = functions.body_graph_def(self.library, fname, arg_shapes)
        body = _Program(gd, set(params), {}, results,
                        handles={p: h for p, h in zip(params, carried) if h is not None})
        peak = body.simulate(cache)[0]
        cache[key] = peak.peak_bytes - peak.argument_bytes
      most = max(most, cache[key])
    return most

  def simulate(self, cache):
    """(MemoryEstimate, index of the op at the peak): two walks, the second stopping at the peak to list what is
    live there."""
    inner = {nd.name: self._inner(nd, cache) for nd in self.order if nd.op in CALL_OPS}
    stop = self._walk(inner, None)
    return self._walk(inner, stop), stop

  def live_at_peak(self, cache):
    """({buffer ref: bytes} of the activations live at the peak, bytes of control-flow bodies there)."""
    inner = {nd.name: self._inner(nd, cache) for nd in self.order if nd.op in CALL_OPS}
    return self._walk(inner, self._walk(inner, None), raw=True)

  def _walk(self, inner, stop, raw=False):
    """Without `stop`: the index of the op at which the activations peak. With it: the estimate at that op
    (`raw`: what is live there and the bodies' bytes)."""
    left = dict(self.reads)
    live, live_bytes, best, best_at = {}, 0, -1, 0
    for step, nd in enumerate(self.order):
      op = self.ops[nd.name]
      mine = [r for r in (ref(nd.name, k) for k in range(len(op.outputs))) if r in self.size]
      for r in mine:
        live[r] = self.size[r]
        live_bytes += self.size[r]
      extra = inner.get(nd.name, 0)
      if stop is None and live_bytes + extra > best:
        best, best_at = live_bytes + extra, step
      if step == stop:
        return (dict(live), extra) if raw else self._estimate(nd, live, extra)
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
    return best_at

  def _estimate(self, nd, live, extra):
    def tensor(r):
      name, _, k = r.rpartition(":")
      return self.ops[name].outputs[int(k)]

    buffers = [LiveBuffer(tensor(r).op.name, tensor(r).op.type, tensor(r).dtype.name,
                          self.shape.get(r, _static_shape(tensor(r))), b)
               for r, b in heapq.nlargest(LARGEST, live.items(), key=lambda kv: (kv[1], kv[0]))]
    if extra:   # a control-flow op's bodies, as one buffer
      buffers = sorted(buffers + [LiveBuffer(nd.name, f"{nd.op} body", "-", (), extra)],
                       key=lambda b: -b.bytes)[:LARGEST]
    activations = sum(live.values()) + extra
    collective = sum(b for r, b in live.items() if tensor(r).op.type in TF_COLLECTIVE_OPS)
    return MemoryEstimate(peak_bytes=self.argument_bytes + self.state_bytes + self.constant_bytes + activations,
                          argument_bytes=self.argument_bytes, state_bytes=self.state_bytes,
                          constant_bytes=self.constant_bytes, activation_bytes=activations,
                          collective_bytes=collective, at=f"{nd.name} ({nd.op})", largest=tuple(buffers))


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
  return _Program(graph_def, set(arguments), variables, [normalize(r) for r in outputs], known,
                  variables).simulate({})[0]


def live_at_peak(graph_def, arguments=(), variables=None, outputs=()):
  """({tensor ref: bytes}, bodies' bytes): the activations live where `graph_def` peaks (`estimate`'s arguments)."""
  if not graph_def.node:
    return {}, 0
  variables = dict(variables or {})
  return _Program(graph_def, set(arguments), variables, [normalize(r) for r in outputs], None,
                  variables).live_at_peak({})


def run(program):
  """Pass: the per-device program's estimated peak memory, as `report.memory` (computed when first read: a
  step that only runs never pays for the simulation)."""
  variables = {name: variable_shard(program, name) for name in program.local_variables}
  variables = {name: shard for name, shard in variables.items() if shard is not None}
  arguments = list(program.local_inputs) + ([program.partition_id] if program.partition_id else [])
  known = {ref(name): e.shape for name, e in program.report.emitted().items()}   # what a collective carries
  graph_def, outputs = program.local_graph_def, program.local_outputs
  return program.replace(report=program.report.with_memory(
      lambda: estimate(graph_def, arguments, variables, outputs, known)))
