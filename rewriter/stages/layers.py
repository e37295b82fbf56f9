"""Operator clustering: a traced forward program's ops grouped into layers for the stage planner (`stages`).

The ops (constants, placeholders and no-ops aside: they cost nothing and go with their consumers) are put in a
topological order that keeps the order the program was written in (a layer is a contiguous run of it), each
priced in arithmetic from its shapes (`op_flops`: a contraction 2 x the product of its factor sizes, any other
op the elements it makes). `cluster` then cuts that order into `count` contiguous layers by a dynamic program
over the cut positions: every layer's arithmetic at most (1 + tolerance) x the average (raised to the smallest
largest layer any partition reaches when one op alone is larger, e.g. a large vocabulary head), and among those
partitions the one that minimises the bytes crossing the cuts (every tensor made before a cut and read after it
counts at each cut it crosses; in units of the median cut) plus the imbalance (per layer, the square of its
arithmetic over the average). This is Alpa's clustering objective with the sum of cut bytes in place of their
maximum and a balance term that spreads the layers left under the cap evenly; an op is never split.

`subprogram` builds a layer run (layers i..j) as a program of its own: the ops, the constants they read, a
Placeholder per tensor entering from an earlier layer (its shape and type) and the program arguments it reads;
its results are the tensors later layers or the program's results read.
"""

import dataclasses
import hashlib
import heapq
import math
from typing import Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd import ops as op_rules
from tf_gspmd.errors import InputError
from tf_gspmd.ops.factors import FactorRule
from tf_gspmd.rewriter.sharding import memory
from tf_gspmd.rewriter.program import Program
from tf_gspmd.rewriter.graph.graph_view import node_def, ref, split_ref

FREE_OPS = ("Placeholder", "Const", "NoOp")
CONTRACTIONS = frozenset(("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D", "Conv3D",
                          "DepthwiseConv2dNative", "Conv"))


@dataclasses.dataclass(frozen=True)
class Layer:
  """A contiguous run of the program's ops: what the stage planner slices into stages."""

  index: int
  ops: Tuple[str, ...]          # op names, in program order
  flops: float                  # arithmetic of one forward pass (see `op_flops`)
  inputs: Tuple[str, ...]       # tensors made by earlier layers and read here
  arguments: Tuple[str, ...]    # program arguments read here (parameters and data)
  outputs: Tuple[str, ...]      # tensors made here and read by later layers or returned
  signature: str                # equal for layers that are the same computation (repeated blocks)

  def __str__(self):
    return f"layer {self.index}: {len(self.ops)} ops, {self.flops:,.0f} FLOPs, {len(self.outputs)} boundary tensor(s)"


def op_flops(node):
  """Arithmetic of one op from its static shapes: 2 x the product of its factor sizes for a contraction (its
  multiply-adds: a matmul, einsum or convolution with reduced factors), else the elements of its results."""
  rule = op_rules.lookup(node.op)
  if isinstance(rule, FactorRule) and node.op in CONTRACTIONS:
    try:
      f = rule.cached_factors(node)
      if f.reduced:
        sizes = rule.factor_sizes(node)
        return 2.0 * math.prod(sizes.get(l, 1) for l in f.labels)
    except Exception:  # pylint: disable=broad-except
      pass   # (priced by its results below)
  return float(sum(math.prod(o.shape) for o in node.outputs if o.partitionable))


def tensor_bytes(ir, r):
  info = ir.info(r)
  return memory.shard_bytes(info.shape, info.dtype) if info.partitionable else 0


def program_order(ir):
  """The ops that compute (not FREE_OPS) in a topological order that follows the GraphDef's order (the order the
  program was written in) wherever the data flow allows."""
  position = {n.name: float(k) for k, n in enumerate(ir.graph_def.node)}
  nodes = [n for n in ir.nodes if n.op not in FREE_OPS]
  names = {n.name for n in nodes}
  consumers = {n.name: [] for n in nodes}
  waiting = {}
  for n in nodes:
    deps = {split_ref(r)[0] for r in n.inputs} | set(n.control)
    deps &= names
    waiting[n.name] = len(deps)
    for d in deps:
      consumers[d].append(n.name)
  # An op that reads only arguments and constants runs just before its first reader (wherever tracing or
  # Grappler put it), so it joins that reader's layer.
  for n in nodes:
    if not waiting[n.name] and consumers[n.name]:
      position[n.name] = min(position.get(c, 0) for c in consumers[n.name]) - 0.5
  ready = [(position.get(n.name, 0), n.name) for n in nodes if not waiting[n.name]]
  heapq.heapify(ready)
  out = []
  while ready:
    _, name = heapq.heappop(ready)
    out.append(ir.node(name))
    for c in consumers[name]:
      waiting[c] -= 1
      if not waiting[c]:
        heapq.heappush(ready, (position.get(c, 0), c))
  return out


def _cut_bytes(ir, order):
  """Bytes crossing the cut before each position of `order` (index 0..len): tensors made before, read after."""
  at = {n.name: k for k, n in enumerate(order)}
  diff = np.zeros(len(order) + 2)
  last = {}
  for k, n in enumerate(order):
    for r in n.inputs:
      p = at.get(split_ref(r)[0])
      if p is not None and p < k:
        last[r] = max(last.get(r, -1), k)
  for r in ir.outputs:
    if split_ref(r)[0] in at:
      last[r] = len(order)
  for r, k in last.items():
    p = at[split_ref(r)[0]]
    b = tensor_bytes(ir, r)
    diff[p + 1] += b
    diff[k + 1] -= b
  return np.cumsum(diff)[:len(order) + 1]


def _min_max(flops, count):
  """The smallest largest-layer arithmetic any partition of `flops` into `count` contiguous runs reaches."""
  lo, hi = float(flops.max(initial=0.0)), float(flops.sum())

  def runs(cap):
    n, acc = 1, 0.0
    for f in flops:
      if acc + f > cap:
        n, acc = n + 1, f
      else:
        acc += f
    return n

  for _ in range(60):
    if hi - lo <= 1e-9 * max(hi, 1.0):
      break
    mid = (lo + hi) / 2
    if runs(mid) <= count:
      hi = mid
    else:
      lo = mid
  return hi


def cluster(program, count, tolerance=0.1):
  """The program's ops cut into `count` layers (see the module docstring); a tuple of `Layer`."""
  ir = program.ir
  order = program_order(ir)
  if count < 1 or count > len(order):
    raise InputError(f"layers={count} must be between 1 and the program's {len(order)} ops",
                     node=getattr(program.fn, "__name__", "the step"))
  flops = np.array([op_flops(n) for n in order])
  prefix = np.concatenate([[0.0], np.cumsum(flops)])
  cut = _cut_bytes(ir, order)
  cap = max((1 + tolerance) * prefix[-1] / count, _min_max(flops, count) * (1 + 1e-9))
  n = len(order)
  inf = float("inf")
  avg = max(prefix[-1] / count, 1e-30)
  positive = cut[1:n][cut[1:n] > 0]
  unit = float(np.median(positive)) if positive.size else 1.0
  best = np.full(n + 1, inf)
  best[0] = 0.0
  back = np.zeros((count + 1, n + 1), dtype=np.int64)
  for k in range(1, count + 1):
    new = np.full(n + 1, inf)
    lo = 0
    for p in range(k, n - (count - k) + 1):   # layer k ends before position p
      while prefix[p] - prefix[lo] > cap:
        lo += 1
      hi = p - 1
      if lo > hi:
        continue
      # cut bytes (in units of the median cut) + imbalance: the square of the layer's arithmetic over the average
      window = best[lo:hi + 1] + ((prefix[p] - prefix[lo:hi + 1]) / avg) ** 2
      q = int(np.argmin(window))
      if window[q] < inf:
        new[p] = window[q] + (cut[p] / unit if p < n else 0.0)
        back[k, p] = lo + q
    best = new
  if best[n] == inf:   # (cannot happen: the cap admits the min-max partition)
    raise InputError(f"no partition into {count} layers", node="clustering")
  ends, p = [], n
  for k in range(count, 0, -1):
    ends.append(p)
    p = int(back[k, p])
  bounds = [0] + ends[::-1]
  return _layers(program, order, flops, bounds)


def _layers(program, order, flops, bounds):
  ir = program.ir
  layer_of = {}
  for k in range(len(bounds) - 1):
    for n in order[bounds[k]:bounds[k + 1]]:
      layer_of[n.name] = k
  args = set(ir.inputs) | set(program.variable_names)
  readers = {}
  for n in order:
    for r in n.inputs:
      readers.setdefault(r, set()).add(layer_of[n.name])
  out = []
  for k in range(len(bounds) - 1):
    nodes = order[bounds[k]:bounds[k + 1]]
    inputs, arguments, outputs = [], [], []
    for n in nodes:
      for r in n.inputs:
        src = split_ref(r)[0]
        if src in args:
          if r not in arguments:
            arguments.append(r)
        elif src in layer_of and layer_of[src] != k and r not in inputs:
          inputs.append(r)
      for o in range(len(n.outputs)):
        r = n.ref(o)
        if any(l > k for l in readers.get(r, ())) or r in ir.outputs:
          outputs.append(r)
    out.append(Layer(index=k, ops=tuple(n.name for n in nodes), flops=float(flops[bounds[k]:bounds[k + 1]].sum()),
                     inputs=tuple(inputs), arguments=tuple(arguments), outputs=tuple(outputs),
                     signature=_signature(ir, nodes, inputs, arguments)))
  return tuple(out)


def _signature(ir, nodes, inputs, arguments):
  """A digest of a layer's computation without its names: op types, attributes, shapes and the wiring (each
  input as a local op's position, an entering tensor's or argument's position, or a constant's value)."""
  local = {n.name: k for k, n in enumerate(nodes)}
  outer = {r: k for k, r in enumerate(inputs)}
  argpos = {r: k for k, r in enumerate(arguments)}
  h = hashlib.sha256()
  for n in nodes:
    h.update(n.op.encode())
    for key in sorted(n.node_def.attr):
      if key != "_output_shapes" and not key.startswith("_class"):
        h.update(key.encode() + n.node_def.attr[key].SerializeToString(deterministic=True))
    for o in n.outputs:
      h.update(repr((o.shape, o.dtype.name if o.dtype is not None else None)).encode())
    for r in n.inputs:
      src, idx = split_ref(r)
      if src in local:
        h.update(f"l{local[src]}:{idx}".encode())
      elif r in outer:
        h.update(f"i{outer[r]}".encode())
      elif r in argpos:
        info = ir.info(r)
        h.update(f"a{argpos[r]}{info.shape}{info.value_shape}".encode())
      else:   # a constant: its value, not its name
        const = ir.node(src).node_def
        h.update(b"c" + const.attr["value"].SerializeToString(deterministic=True))
  return h.hexdigest()


def subprogram(program, all_layers, first, last, mesh, options):
  """Layers first..last of `all_layers` (of `program`) as a program of their own on `mesh` (see the module
  docstring), ready for `import_annotations` and `auto.run`: (Program, {entering tensor: its Placeholder})."""
  ir = program.ir
  layers = all_layers[first:last + 1]
  read_later = set()
  for l in all_layers[last + 1:]:
    read_later.update(l.inputs)
  names = set()
  for l in layers:
    names.update(l.ops)
  entering, arguments = [], []
  for l in layers:
    for r in l.inputs:
      if split_ref(r)[0] not in names and r not in entering:
        entering.append(r)
    for r in l.arguments:
      if r not in arguments:
        arguments.append(r)
  outputs = []
  for l in layers:
    outputs += [r for r in l.outputs if r not in outputs and (r in ir.outputs or r in read_later)]
  renamed = {r: f"stage_in/{k}" for k, r in enumerate(entering)}
  gd = tf.compat.v1.GraphDef()
  gd.versions.CopyFrom(ir.graph_def.versions)
  wanted, consts = [], set()
  for n in ir.graph_def.node:
    if n.name in names:
      wanted.append(n)
      for i in n.input:
        if not i.startswith("^") and ir.node(split_ref(i)[0]).op == "Const":
          consts.add(split_ref(i)[0])
  for r in arguments:
    consts.discard(split_ref(r)[0])
  keep_args = {split_ref(r)[0] for r in arguments}
  for n in ir.graph_def.node:
    if n.name in keep_args or n.name in consts:
      c = gd.node.add()
      c.CopyFrom(n)
      del c.input[:]   # (a constant's control inputs stay with the program)
  for r, name in renamed.items():
    info = ir.info(r)
    gd.node.append(node_def(name, "Placeholder", attrs={
        "dtype": tf.compat.v1.AttrValue(type=info.dtype.as_datatype_enum),
        "shape": tf.compat.v1.AttrValue(shape=tf.TensorShape(info.shape).as_proto())}))
  for n in wanted:
    c = gd.node.add()
    c.CopyFrom(n)
    del c.input[:]
    for i in n.input:
      if i.startswith("^"):
        if i[1:] in names:
          c.input.append(i)
        continue
      r = ref(*split_ref(i))
      c.input.append(renamed.get(r, i))
  input_names = tuple(split_ref(r)[0] for r in arguments) + tuple(renamed.values())
  variables = set(program.variable_names)
  var_names = tuple(n for n in input_names if n in variables)
  args = tuple(n for n in input_names if n not in variables)
  sub = Program(fn=None, mesh=mesh, options=options, arg_specs=(), declared_in=(None,) * len(args),
                arriving_in=(None,) * len(args), graph_def=gd, input_names=args,
                output_refs=tuple(outputs), variable_names=var_names,
                variables=tuple(program.variables[program.variable_names.index(v)] for v in var_names))
  return sub, renamed
