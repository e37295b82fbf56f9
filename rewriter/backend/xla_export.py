"""The xla_export pass (`partitioner="xla"`): the completed global program, every layout written as XLA sharding.

XLA's own SPMD partitioner (the system of the GSPMD paper) partitions a program whose tensors carry XLA sharding
annotations. This pass hands it tf_gspmd's completion: a copy of the global graph (after folding, annotation import
and completion, and automatic sharding where asked) in which every tensor that has a layout -- every numeric
output of every op, the arguments at their entry, the results at their exit, the reads of captured variables --
is followed by TF's `XlaSharding` op carrying that layout, exactly as `xla_sharding.mesh_split(...,
use_sharding_op=True)` writes it (the serialized OpSharding of `Sharding.to_proto()` in its `sharding` and
`_XlaSharding` attributes). XLA then has nothing left to propagate but inside function bodies (loop bodies and
branches, which it completes from the layouts of their operands).

The annotated graph is compiled with `tf.function(jit_compile=True)` (`Exported.function`); its HLO
(`Exported.hlo()`) is what XLA's partitioner reads: under TPUStrategy's SPMD bridge, or on host CPUs in
`tools/xla_oracle.py`. Opaque tensors (resource handles, TensorLists, strings) carry no annotation.
"""

import dataclasses
import math
import re
import threading
from typing import Any, Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.errors import InputError, UnsupportedOpError
from tf_gspmd.rewriter.graph.graph_view import node_def, normalize, split_ref

XLA = "xla"
SUFFIX = "/gspmd/xla_sharding"
SCOPE = "exported"   # the name scope the graph is imported under in its tf.function (HLO op names start with it)
PLANNED = "planned: XLA partitions this program (partitioner=\"xla\"); tf_gspmd's own plan for it"


@dataclasses.dataclass(frozen=True)
class Exported:
  """The global program with XLA sharding annotations, as one jit-compiled tf.function.

  Attributes:
    graph_def: the annotated global graph (no argument Placeholders: the function's arguments take their place).
    inputs: the Placeholders the arguments replace, in order; `variable_inputs`: those of the captured
      variables' handles, mapped onto `variables` (the tf.Variables, captured by the function).
    outputs: per flattened result, the annotated tensor returned.
    arg_specs: the arguments' tf.TensorSpecs.
    annotations: {XlaSharding node: (the tensor it annotates, its Sharding)}.
    device: where `__call__` runs the compiled program, or None.
  """

  graph_def: Any
  inputs: Tuple[str, ...]
  variable_inputs: Tuple[str, ...]
  variables: Tuple[Any, ...]
  outputs: Tuple[str, ...]
  arg_specs: Tuple[Any, ...]
  annotations: Mapping[str, Tuple[str, Any]]
  device: Optional[str] = None
  _cache: Any = dataclasses.field(default_factory=dict, compare=False, repr=False)
  _lock: Any = dataclasses.field(default_factory=threading.RLock, compare=False, repr=False)

  def function(self):
    """The annotated program as a `tf.function(jit_compile=True)` of the arguments (flat results, a list)."""
    with self._lock:
      if "function" not in self._cache:
        self._cache["function"] = tf.function(self._body, jit_compile=True, autograph=False)
      return self._cache["function"]

  def _body(self, *args):
    used = {split_ref(normalize(i))[0] for nd in self.graph_def.node for i in nd.input if not i.startswith("^")}
    input_map = {f"{name}:0": a for name, a in zip(self.inputs, args) if name in used}
    for name, v in zip(self.variable_inputs, self.variables):
      if name in used:   # (its handle passes through an Identity, which captures it into the function)
        input_map[f"{name}:0"] = tf.identity(v.handle)
    if not self.outputs:
      tf.graph_util.import_graph_def(self.graph_def, input_map=input_map, name=SCOPE)
      return []
    return tf.graph_util.import_graph_def(self.graph_def, input_map=input_map, return_elements=list(self.outputs),
                                          name=SCOPE)

  def concrete_function(self):
    """The compiled function's ConcreteFunction for `arg_specs`."""
    return self.function().get_concrete_function(*self.arg_specs)

  def hlo(self, stage="hlo"):
    """The program as XLA receives it: `stage="hlo"` HLO text (before any XLA pass; every XlaSharding op is a
    `Sharding` custom-call with its `sharding={...}`), "hlo_serialized" the HloModuleProto bytes, or any other
    stage of `experimental_get_compiler_ir`."""
    key = ("hlo", stage)
    with self._lock:
      if key not in self._cache:
        _compat.define_functions(self.graph_def.library.function)
        self._cache[key] = self.function().experimental_get_compiler_ir(*self.arg_specs)(stage=stage)
      return self._cache[key]

  def __call__(self, args):
    """Runs the compiled program on `args` (tf.Tensors) on `device`; returns the flat results."""
    with tf.device(self.device):
      return list(self.function()(*args))


def _check_compilable(program):
  """A typed error for what XLA cannot compile at all: strings (XLA has no string type; tf2xla would refuse the
  compiled function at its first call, naming an internal `_Arg`)."""
  for k, (name, spec) in enumerate(zip(program.input_names, program.arg_specs)):
    if spec.dtype == tf.string:
      raise InputError(f"partitioner=\"xla\" compiles the whole function with XLA, which has no string type, but "
                       f"argument {k} ({name}) is a tf.string {list(spec.shape)}: turn strings into numbers outside "
                       "the function (e.g. a tf.keras.layers.StringLookup before the call), or leave partitioner at "
                       "its default (tf_gspmd's own partitioner runs string ops replicated)", node=name)
  for node in program.ir.nodes:
    if any(info.dtype == tf.string for info in node.outputs):
      raise UnsupportedOpError(f"partitioner=\"xla\" compiles the whole function with XLA, which has no string "
                               f"type: {node.name} ({node.op}) makes a string; move it outside the function, or "
                               "leave partitioner at its default (tf_gspmd's own partitioner runs it replicated)",
                               node=node.name, op_type=node.op)


def run(program):
  """Pass (partitioner="xla"): `program.exported`, the completed global graph with every layout as an XlaSharding
  op (see the module docstring)."""
  _check_compilable(program)
  ir, shardings = program.ir, program.shardings
  gd = tf.compat.v1.GraphDef()
  gd.CopyFrom(ir.graph_def)
  consumers = {}
  for nd in gd.node:
    for k, inp in enumerate(nd.input):
      if not inp.startswith("^"):
        consumers.setdefault(normalize(inp), []).append((nd, k))
  names = {nd.name for nd in gd.node}
  annotations, replaced = {}, {}
  for node in ir.nodes:
    for o, info in enumerate(node.outputs):
      r = node.ref(o)
      s = shardings.get(r)
      if s is None or not info.partitionable:
        continue
      name = node.name + SUFFIX + (f"_{o}" if o else "")
      while name in names:
        name += "_"
      names.add(name)
      for nd, k in consumers.get(r, ()):
        nd.input[k] = name
      proto = s.to_proto().SerializeToString()
      attr = tf.compat.v1.AttrValue
      gd.node.append(node_def(name, "XlaSharding", [r], {
          "T": attr(type=info.dtype.as_datatype_enum), "sharding": attr(s=proto),
          "unspecified_dims": attr(list=attr.ListValue()), "_XlaSharding": attr(s=proto)}))
      annotations[name] = (r, s)
      replaced[r] = f"{name}:0"
  removed = set(program.input_names) | set(program.variable_names)
  kept = [nd for nd in gd.node if nd.name not in removed]
  for nd in kept:
    controls = [i for i in nd.input if i.startswith("^") and i[1:] in removed]
    for c in controls:
      nd.input.remove(c)
  del gd.node[:]
  gd.node.extend(kept)
  outputs = tuple(replaced.get(r, r) for r in ir.outputs)
  return program.replace(exported=Exported(
      graph_def=gd, inputs=tuple(program.input_names), variable_inputs=tuple(program.variable_names),
      variables=tuple(program.variables), outputs=outputs, arg_specs=tuple(program.arg_specs),
      annotations=annotations, device=program.devices[0] if program.devices else None))


# ---- reading HLO text ------------------------------------------------------------------------------------------------

_SHARDING_CALL = re.compile(r'custom_call_target="Sharding".*?sharding=(\{[^}]*\})')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_annotations(hlo_text):
  """{XlaSharding node name: OpSharding} of the `Sharding` custom-calls in `hlo_text` (an exported program's HLO,
  before XLA's passes), named by the node their metadata names (the import scope dropped)."""
  out = {}
  for line in hlo_text.splitlines():
    m, name = _SHARDING_CALL.search(line), _OP_NAME.search(line)
    if m and name:
      node = name.group(1)
      out[node[len(SCOPE) + 1:] if node.startswith(SCOPE + "/") else node] = parse_hlo_sharding(m.group(1))
  return out


def hlo_sharding_text(sharding):
  """`sharding` (a Sharding) as HLO writes a sharding attribute, e.g. "{devices=[2,1,4]0,1,2,3,4,5,6,7
  last_tile_dim_replicate}" (the inverse of `parse_hlo_sharding`)."""
  pb = _compat.xla_data_pb2()
  proto = sharding.to_proto()
  if proto.type == pb.OpSharding.REPLICATED:
    return "{replicated}"
  if proto.type == pb.OpSharding.MAXIMAL:
    return f"{{maximal device={proto.tile_assignment_devices[0]}}}"
  tiles = ",".join(str(d) for d in proto.tile_assignment_dimensions)
  devices = ",".join(str(d) for d in proto.tile_assignment_devices)
  return f"{{devices=[{tiles}]{devices}{' last_tile_dim_replicate' if proto.replicate_on_last_tile_dim else ''}}}"


def parse_hlo_sharding(text):
  """The OpSharding of an HLO sharding attribute: "{replicated}", "{maximal device=3}",
  "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}", "{devices=[2,4]<=[4,2]T(1,0)}" (an iota tile
  assignment), "{manual}"."""
  pb = _compat.xla_data_pb2()
  body = text.strip().strip("{}").strip()
  if body == "replicated":
    return pb.OpSharding(type=pb.OpSharding.REPLICATED)
  if body == "manual":
    return pb.OpSharding(type=pb.OpSharding.MANUAL)
  m = re.fullmatch(r"maximal device=(\d+)", body)
  if m:
    return pb.OpSharding(type=pb.OpSharding.MAXIMAL, tile_assignment_dimensions=[1],
                         tile_assignment_devices=[int(m.group(1))])
  m = re.fullmatch(r"devices=\[([\d,]+)\](<=\[([\d,]+)\](?:T\(([\d,]+)\))?|[\d,]+)\s*(.*)", body)
  if not m:
    raise ValueError(f"cannot read HLO sharding {text!r}")
  tiles = [int(d) for d in m.group(1).split(",")]
  if m.group(3):
    dims = [int(d) for d in m.group(3).split(",")]
    perm = [int(d) for d in m.group(4).split(",")] if m.group(4) else list(range(len(dims)))
    devices = np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(-1).tolist()
  else:
    devices = [int(d) for d in m.group(2).split(",")]
  rest = m.group(5).strip()
  if rest not in ("", "last_tile_dim_replicate", "last_tile_dims={replicated}"):
    raise ValueError(f"cannot read HLO sharding {text!r}: {rest!r}")
  return pb.OpSharding(type=pb.OpSharding.OTHER, tile_assignment_dimensions=tiles, tile_assignment_devices=devices,
                       replicate_on_last_tile_dim=bool(rest) or None)
