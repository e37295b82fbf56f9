"""The GPU form of a program, lowered and checked on a machine without GPUs.

`gs.gpu_form(f, *specs)` lowers gs.function `f` for a mesh of the same shape and axes whose devices are GPUs
(`/job:localhost/replica:0/task:0/device:GPU:<k>`; none needs to exist: the lowering is a plan), which gives
exactly the per-device program and XLA clusters the GPU runtime runs (rewriter/backend/jit.py), with the
collectives' NCCL hint and launch order. Each cluster is then handed to tf2xla here (`experimental_get_compiler_ir`
at stage "hlo", which lowers CollectiveReduceV2 to an HLO all-reduce on CPU as on GPU), and the form is checked:

  * every cluster lowers (tf2xla takes one group configuration of CollectiveReduceV2 per cluster, and no gather,
    all-to-all or broadcast);
  * each HLO all-reduce's replica group has as many members as the mesh group of its collective;
  * a cluster holds one configuration;
  * every device launches its collectives in one order: between clusters, the collectives and the clusters that
    hold collectives form one chain of edges in the program; inside a cluster, the HLO of the first and the last
    device (which differ along every mesh axis, so in every group key) has its all-reduces in one order, with one
    shape and group size each. Devices differ only in the constants read from the partition id, which XLA's
    scheduler does not look at.

A failed check raises GpuFormError naming the cluster. `GpuForm.summary()` states per program the clusters, the
compute ops left outside XLA, the collectives inside and outside XLA and the largest cluster's share of the
arithmetic. `GpuForm.run(*args)` runs the GPU form on `f`'s own CPU mesh: clusters without collectives compiled by
XLA on CPU, the others (XLA on CPU refuses collectives) in TF's executor, so its results can be compared with the
unpartitioned program's.
"""

import copy
import dataclasses
import math
import re
import threading
from typing import Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.errors import GpuFormError, InputError, PartitionError
from tf_gspmd._layout.mesh import Mesh
from tf_gspmd.rewriter import pipeline
from tf_gspmd.rewriter.backend import jit
from tf_gspmd.rewriter.collectives import ordering, vocabulary
from tf_gspmd.rewriter.collectives import shapes as collective_shapes
from tf_gspmd.rewriter.collectives.groups import MeshGroups
from tf_gspmd.rewriter.graph.graph_view import GraphView, node_of
from tf_gspmd.runtime import executable as _executable

# Ops that compute nothing: not counted as left outside XLA.
_FREE = frozenset({"Placeholder", "Const", "NoOp", "Identity", "StatefulPartitionedCall", "PartitionedCall"})
_ALL_REDUCE = re.compile(r"= (\S+) all-reduce\(.*?replica_groups=\{([^}]*)\}.*?op_name=\"([^\"]+)\"")
_IMPORTED = re.compile(r"^(StatefulPartitionedCall/)?program/")   # where the check imports a cluster's nodes
_DOT = re.compile(r"= (\w+)\[([0-9,]*)\]\S* dot\((\w+)\[([0-9,]*)\]\S* %\S+, .*?lhs_contracting_dims=\{([0-9,]*)\}")
_CONV = re.compile(r"= (\w+)\[([0-9,]*)\]\S* convolution\(\w+\[[0-9,]*\]\S* %\S+, (\w+)\[([0-9,]*)\]\S* %\S+\).*?"
                   r"dim_labels=\w+_(\w+)->")


@dataclasses.dataclass(frozen=True)
class Cluster:
  """One XLA cluster of the GPU form."""

  name: str                               # its call node in the per-device program ("whole": the program)
  ops: int                                # the compute ops it holds
  collectives: Tuple[str, ...]            # the collective ops inside it (XLA's all-reduces)
  all_reduces: Tuple[Tuple[str, int], ...]   # per HLO all-reduce, in the HLO's order: (shape, group size)
  arithmetic: float                       # multiply-adds x 2 of its dots and convolutions, per device (HLO)


@dataclasses.dataclass(frozen=True)
class GpuForm:
  """The GPU form of one lowering, checked (see the module docstring)."""

  lowered: object                         # the Lowered for the GPU mesh
  clusters: Tuple[Cluster, ...]
  outside_ops: Tuple[str, ...]            # compute ops that run in TF's executor
  outside_collectives: Tuple[str, ...]    # collectives between clusters
  source: object = None                   # the gs.function on its own mesh (for `run`)

  @property
  def jit(self):
    return self.lowered.program.jit

  @property
  def collectives_inside(self):
    return sum(len(c.collectives) for c in self.clusters)

  @property
  def largest_share(self):
    """The largest cluster's share of the arithmetic XLA compiles (1.0 when the program has none)."""
    total = sum(c.arithmetic for c in self.clusters)
    return max(c.arithmetic for c in self.clusters) / total if total else 1.0

  def counts(self):
    return {"clusters": len(self.clusters), "outside_ops": len(self.outside_ops),
            "collectives_in_xla": self.collectives_inside, "collectives_outside": len(self.outside_collectives),
            "largest_share": round(self.largest_share, 3)}

  def summary(self):
    c = self.counts()
    return (f"{self.jit or 'not compiled'}: {c['clusters']} cluster(s), {c['outside_ops']} compute op(s) outside "
            f"XLA, collectives {c['collectives_in_xla']} inside XLA / {c['collectives_outside']} outside, largest "
            f"cluster {100 * c['largest_share']:.1f}% of the arithmetic")

  def run(self, *args):
    """The GPU form's per-device program run on the gs.function's own CPU mesh (see the module docstring)."""
    if self.source is None:
      raise InputError("this GPU form was checked from a lowering: build it with gs.gpu_form(f, *specs) to run it")
    f = self.source
    devices = f.mesh.resolve_devices()
    program = self.lowered.program
    if program.variables and any(v is None for v in program.variables):
      raise InputError("the program captures a resource that is not a variable: its GPU form cannot run here")
    graph_def = _on_cpus(program.local_graph_def)
    # compiled whole on GPUs, collectives included: TF's executor runs it on CPUs (XLA on CPU refuses collectives)
    jit_mode = None if program.jit == "whole" else program.jit
    record = pipeline.device_program(program.replace(devices=tuple(devices), local_graph_def=graph_def, jit=jit_mode))
    flat = _executable.Executable(record.device_program)(list(args))
    return tf.nest.map_structure(lambda k: None if k is None else flat[k], program.output_structure)


def gpu_mesh(mesh):
  """A mesh of `mesh`'s shape and axes over GPUs (planned: no GPU needs to exist)."""
  devices = [f"/job:localhost/replica:0/task:0/device:GPU:{k}" for k in range(mesh.size)]
  return Mesh(mesh.shape, mesh.axis_names, devices=devices)


def gpu_form(f, *specs):
  """The GPU form of gs.function `f` for argument `specs` (TensorSpecs or arrays), checked; or of a Lowered of a
  GPU mesh (no specs). Raises GpuFormError where it would not compile or would hang on GPUs."""
  from tf_gspmd._function import Lowered, ShardedFunction  # pylint: disable=g-import-not-at-top
  if isinstance(f, Lowered):
    return check(f)
  if not isinstance(f, ShardedFunction):
    raise InputError(f"gs.gpu_form takes a gs.function and its argument specs, or a lowering; got {f!r:.80}",
                     node="f")
  specs = [s if isinstance(s, tf.TensorSpec) else tf.TensorSpec(np.shape(s), tf.as_dtype(np.asarray(s).dtype))
           for s in specs]
  on_gpus = copy.copy(f)
  on_gpus.mesh = gpu_mesh(f.mesh)
  on_gpus._cache, on_gpus._last, on_gpus._lock = {}, None, threading.Lock()  # pylint: disable=protected-access
  return dataclasses.replace(check(on_gpus.lower(*specs)), source=f)


def check(lowered):
  """The GpuForm of `lowered` (a lowering for a GPU mesh), checked."""
  program = lowered.program
  if jit.backend_of(program) != "GPU":
    raise InputError(f"this lowering is for a {jit.backend_of(program)} mesh: lower the function for a mesh of GPUs "
                     "(gs.gpu_form(f, *specs) plans one)", node="mesh")
  gd = program.local_graph_def
  fixed = jit.per_device_constants(GraphView(gd).order(), program.partition_id)
  groups = MeshGroups(program.mesh, program.devices, program.processes)
  emitted = {op.name: op for op in program.report.emitted_ops()}
  library = {fdef.signature.name: fdef for fdef in gd.library.function}
  # each variable handle's shard: (shape, dtype)
  handles = {ph: (s.with_rank(len(v.shape)).shard_shape(tuple(v.shape)), v.dtype)
             for ph, v, s in zip(program.local_variables, program.variables, program.variable_shardings)}
  if program.jit == "whole":
    inputs = [program.partition_id] + list(program.local_inputs) + list(program.local_variables)
    outputs = [node_of(n) + ":0" for n in program.local_outputs]
    units = [("whole", gd, inputs, outputs, handles, {i: i for i in inputs})]
    outside = []
  else:
    units, outside = [], []
    for node in gd.node:
      if node.op == "StatefulPartitionedCall" and node.attr["_XlaMustCompile"].b:
        units.append(_cluster_unit(node, library[node.attr["f"].func.name], handles))
      elif node.op not in _FREE and node.name not in fixed:
        outside.append(node)
  shapes = _OuterShapes(gd, program.partition_id, handles)
  clusters = tuple(_checked(u, program, groups, emitted, shapes) for u in units)
  outside_collectives = tuple(n.name for n in outside if n.op in vocabulary.TF_COLLECTIVE_OPS) + tuple(
      n.name for fdef in library.values() if not fdef.attr["_XlaMustCompile"].b for n in fdef.node_def
      if n.op in vocabulary.TF_COLLECTIVE_OPS)
  _check_chain(gd)
  return GpuForm(lowered=lowered, clusters=clusters,
                 outside_ops=tuple(n.name for n in outside if n.op not in vocabulary.TF_COLLECTIVE_OPS),
                 outside_collectives=outside_collectives)


def _cluster_unit(call, fdef, handles):
  """(name, GraphDef of the cluster's function, its argument Placeholders, its results, {argument: variable
  shard}) of the cluster `call` calls."""
  sources = [i for i in call.input if not i.startswith("^")]
  known = list(fdef.attr["_input_shapes"].list.shape) if "_input_shapes" in fdef.attr else None   # (jit.py)
  graph_def, flat = _compat.function_def_to_graph_def(fdef, input_shapes=known)
  inputs = [a.name for a in fdef.signature.input_arg]
  outputs = [flat.get(fdef.ret[a.name], fdef.ret[a.name]) for a in fdef.signature.output_arg]
  held = {a: handles[node_of(i)] for a, i in zip(inputs, sources) if node_of(i) in handles}
  return call.name, graph_def, inputs, outputs, held, dict(zip(inputs, sources))


class _OuterShapes:
  """Static shapes of the per-device program's tensors on device `pid` (a received halo's size depends on the
  device: it is read from a per-device table), the program imported with the partition id a constant."""

  def __init__(self, graph_def, partition_id, handles):
    self.graph_def, self.partition_id, self.handles = graph_def, partition_id, handles
    self.graphs = {}

  def __call__(self, pid, ref):
    if pid not in self.graphs:
      gd = tf.compat.v1.GraphDef()
      gd.CopyFrom(collective_shapes.for_shapes(self.graph_def, self.handles))
      for n in gd.node:
        if n.name == self.partition_id:
          n.op = "Const"
          n.attr.clear()
          n.attr["dtype"].type = tf.int32.as_datatype_enum
          n.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.int32(pid)))
      g = tf.Graph()
      with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
      self.graphs[pid] = g
    return self.graphs[pid].get_tensor_by_name(ref if ":" in ref else ref + ":0").shape


def _checked(unit, program, groups, emitted, outer_shapes):
  name, graph_def, inputs, outputs, handles, sources = unit
  view = GraphView(graph_def)
  collectives = [n for n in graph_def.node if n.op in vocabulary.TF_COLLECTIVE_OPS]
  configurations = {jit.configuration(view, n) for n in collectives}
  if len(configurations) > 1:
    raise GpuFormError(f"XLA cluster {name} holds all-reduces of {len(configurations)} group configurations "
                       f"({', '.join(n.name for n in collectives)}); tf2xla compiles one per cluster")
  pids = sorted({0, program.mesh.size - 1})
  sequences = [_hlo_all_reduces(name, graph_def, inputs, outputs, handles, program, pid,
                                lambda i, pid=pid: outer_shapes(pid, sources[i]), sources)
               for pid in pids]
  for got in sequences[1:]:
    if [(s, g) for _, s, g in got] != [(s, g) for _, s, g in sequences[0]]:
      raise GpuFormError(f"XLA cluster {name}: devices {pids[0]} and {pids[-1]} launch its all-reduces in "
                         f"different orders: {sequences[0]} vs {got}")
  hlo_text = sequences[0].hlo
  for op_name, shape, size in sequences[0]:
    record = emitted.get(_IMPORTED.sub("", op_name))
    if record is None:
      raise GpuFormError(f"XLA cluster {name}: an all-reduce ({op_name}) the partitioner did not emit")
    want = len(groups.ranked_groups(record.axes, record.level).members[0])
    if size != want:
      raise GpuFormError(f"XLA cluster {name}: all-reduce {record.name} over {record.axes} has replica groups of "
                         f"{size} in XLA, its mesh group has {want} members")
  return Cluster(name=name, ops=sum(1 for n in graph_def.node if n.op not in _FREE),
                 collectives=tuple(n.name for n in collectives),
                 all_reduces=tuple((s, g) for _, s, g in sequences[0]), arithmetic=_arithmetic(hlo_text))


class _Sequence(list):
  hlo = ""


def _hlo_all_reduces(name, graph_def, inputs, outputs, handles, program, pid, outer_shape, sources):
  """The all-reduces of the cluster's HLO for device `pid`, in order: [(op name, shape, group size)].
  `outer_shape(argument)`: the static shape on device `pid` of what the program passes the argument."""
  nodes = {n.name: n for n in graph_def.node}
  fn = tf.function(_executable._function_from_graph_def(  # pylint: disable=protected-access
      graph_def, [i + ":0" for i in inputs], outputs), jit_compile=True, autograph=False)
  args = []
  keep = []
  for i in inputs:
    attr = nodes[i].attr
    dtype = tf.as_dtype(attr["dtype"].type)
    if node_of(sources[i]) == program.partition_id:
      args.append(tf.constant(pid, tf.int32))
      continue
    shape = tf.TensorShape(attr["shape"].shape) if "shape" in attr else tf.TensorShape(None)
    if dtype == tf.resource:
      if i not in handles:
        raise GpuFormError(f"XLA cluster {name}: argument {i} is a resource that is not a variable of the program")
      v = tf.Variable(tf.zeros(*handles[i]))
      keep.append(v)
      args.append(v.handle)
    else:
      if not shape.is_fully_defined():
        shape = shape.merge_with(outer_shape(i))
      if not shape.is_fully_defined():
        raise GpuFormError(f"XLA cluster {name}: argument {i} has no static shape ({shape}; {nodes[i]})")
      args.append(tf.zeros(shape, dtype) if dtype != tf.string else tf.constant("", shape=shape))
  try:
    hlo = fn.experimental_get_compiler_ir(*args)(stage="hlo")
  except Exception as e:  # pylint: disable=broad-except
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise GpuFormError(f"XLA cluster {name} does not lower with tf2xla: {message}") from e
  out = _Sequence((m.group(3), m.group(1), len(m.group(2).split(",")) if m.group(2) else 1)
                  for m in _ALL_REDUCE.finditer(hlo))
  out.hlo = hlo
  return out


def _dims(text):
  return [int(d) for d in text.split(",") if d]


def _arithmetic(hlo):
  """2 x the multiply-adds of the HLO's dots and convolutions (per device)."""
  total = 0.0
  for m in _DOT.finditer(hlo):
    lhs = _dims(m.group(4))
    total += 2.0 * math.prod(_dims(m.group(2))) * math.prod(lhs[d] for d in _dims(m.group(5)))
  for m in _CONV.finditer(hlo):
    kernel, labels = _dims(m.group(4)), m.group(5)
    # each output element takes the kernel's window times its input features (labels: spatial digits, i, o)
    window = math.prod(k for k, label in zip(kernel, labels) if label not in "o")
    total += 2.0 * math.prod(_dims(m.group(2))) * window
  return total


def _check_chain(graph_def):
  """GpuFormError unless the program's collectives and the clusters holding some run in one chain of edges."""
  try:
    ordering.sequence(graph_def)
  except PartitionError as e:
    raise GpuFormError(f"devices could launch their collectives in different orders: {e}") from e


def _on_cpus(graph_def):
  """The GPU form's program for CPU devices: clusters that hold collectives (XLA on CPU refuses them) run in TF's
  executor, every collective with TF's own choice of implementation."""
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(graph_def)
  holding = {f.signature.name for f in out.library.function
             if any(n.op in vocabulary.TF_COLLECTIVE_OPS for n in f.node_def)}
  for fdef in out.library.function:
    if fdef.signature.name in holding:
      fdef.attr["_XlaMustCompile"].b = False
    for n in fdef.node_def:
      if n.op in vocabulary.TF_COLLECTIVE_OPS:
        n.attr["communication_hint"].s = b"auto"
  for n in out.node:
    if n.op in vocabulary.TF_COLLECTIVE_OPS:
      n.attr["communication_hint"].s = b"auto"
    if n.op == "StatefulPartitionedCall" and n.attr["f"].func.name in holding:
      n.attr["_XlaMustCompile"].b = False
  return out
