"""The records of one lowering: the options, the `Program` every pass reads and returns, the `DeviceProgram` the
runtime runs, and the queries on them that several phases ask."""

import dataclasses
from typing import Any, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd.rewriter.graph.graph_view import ref


@dataclasses.dataclass(frozen=True)
class Options:
  strict: bool = False               # an op without a rule, or an involuntary full gather, is an error
  collective_timeout: float = 300.0  # seconds before a stuck program's collectives are aborted
  weight_update_sharding: Any = None  # None/False, True (the "data" axis, else the first), or a mesh axis name
  jit_compile: Any = "auto"          # "auto" (GPU/TPU), True (every backend; CPU in segments), False
  auto: Any = None                   # auto.AutoOptions: layouts chosen by the auto_shard pass, or None
  exchange: str = "auto"             # "auto": one graph per process on CPUs (in_process pass); "collectives"
  partitioner: str = "tf_gspmd"      # "tf_gspmd", or "xla": XLA partitions the exported program (xla_export pass)


@dataclasses.dataclass(frozen=True)
class Check:
  """A check of the per-device program whose verdict the runtime reads after the step (rewriter/backend/checks.py):
  where it is, its op type, what it says when it fails, the per-device resource holding its verdict and, for a
  numerics check, the (bit, name) of each value its verdict can report (an assert's verdict is 1 when it failed)."""
  node: str
  op: str
  message: str
  resource: str
  found: Tuple[Tuple[int, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class DeviceProgram:
  """What the runtime runs, and all it reads: the per-device program, how every device calls it, and the state it
  keeps on the devices. The last pass (`device_program`) builds it from the Program."""

  devices: Tuple[str, ...]               # the mesh's devices, row-major
  graph_def: Any                         # the per-device GraphDef
  partition_id: str                      # its partition-id Placeholder (scalar int32)
  inputs: Tuple[str, ...]                # its Placeholders of the arguments, in order
  variable_inputs: Tuple[str, ...]       # its Placeholders of the captured variables' handles, in order
  outputs: Tuple[str, ...]               # the ops whose output 0 is each flattened result
  side_effects: Tuple[str, ...]          # ops that must run though no result depends on them
  arguments: Tuple[Tuple[str, Any, Any], ...]   # per argument: (name, tf.TensorSpec, Sharding it is passed in)
  variables: Tuple[Tuple[str, Any, Any, bool], ...]   # per captured variable: (name, tf.Variable, its Sharding, written)
  results: Tuple[Any, ...]               # per flattened result: (Sharding, global shape tuple, tf.DType)
  jit: Optional[str]                     # None, "segments" (XLA between collectives) or "whole" (XLA compiles it all)
  locally_optimized: bool                # TF's graph optimizer already ran on graph_def (the runtime skips it)
  in_process: Any                        # in_process.InProcess: every device's program as one graph, or None
  collective_timeout: float              # seconds before a stuck step's collectives are aborted
  checks: Tuple[Check, ...] = ()         # checks decided after the step (rewriter/backend/checks.py)
  verdict: Optional[str] = None          # with checks: the op whose output 0 is their verdict, one more result
  verdict_agreed: bool = False           # every device's verdict says whether a check failed on any device


@dataclasses.dataclass(frozen=True)
class Program:
  """Everything known about one lowering; passes fill in fields with `replace`."""

  fn: Any
  mesh: Any
  options: Options
  arg_specs: Tuple[Any, ...]
  declared_in: Tuple[Any, ...]           # Sharding or None per argument (the function's in_shardings)
  arriving_in: Tuple[Any, ...]           # Sharding or None per argument (layout of ShardedTensor arguments)
  open_in: Tuple[Any, ...] = ()          # per argument: the dims its in_shardings entry leaves open (P.UNCONSTRAINED)
  declared_out: Any = None               # None, or a tuple of Sharding-or-None per flattened output
  devices: Optional[Tuple[str, ...]] = None
  processes: Optional[Tuple[int, ...]] = None   # per mesh position: the process driving it (None: one)
  process: Optional[int] = None          # the process this lowering runs in, of `processes` (None: one, or a plan)
  variable_layout: Any = None            # tf.Variable -> the Sharding it is stored in (pinned), or None
  # trace / grappler
  graph_def: Any = None
  input_names: Tuple[str, ...] = ()
  output_refs: Tuple[str, ...] = ()
  output_structure: Any = None
  variable_names: Tuple[str, ...] = ()   # Placeholders of captured variables (resource handles)
  variables: Tuple[Any, ...] = ()        # the captured tf.Variables, in the same order
  variable_pins: Tuple[Any, ...] = ()    # the stored layout of each captured variable when lowered (or None)
  pipelines: Tuple[Any, ...] = ()        # the `gs.pipeline` schedules built while tracing (_annotations.PipelineSpec)
  checks: Tuple[str, ...] = ()           # assertions and prints that must run though no result reads them
  # import_annotations / complete
  ir: Any = None
  annotations: Any = None                # ref -> Sharding, pinned
  open_dims: Any = None                  # ref -> dims an annotation leaves open (completion may split only those)
  shardings: Any = None                  # ref -> Sharding for every tensor
  explanations: Any = None               # ref -> why completion chose it
  param_shardings: Tuple[Any, ...] = ()
  completion_iterations: int = 0
  auto_plan: Any = None                  # auto.AutoPlan: what the auto_shard pass chose (None without it)
  update_state: Tuple[str, ...] = ()     # handles of variables read only to compute updates (optimizer state)
  # partition / cleanup
  local_graph_def: Any = None
  local_inputs: Tuple[str, ...] = ()
  local_variables: Tuple[str, ...] = ()
  local_outputs: Tuple[str, ...] = ()
  side_effects: Tuple[str, ...] = ()
  partition_id: Optional[str] = None     # the per-device program's partition-id input (scalar int32 Placeholder)
  variable_shardings: Tuple[Any, ...] = ()  # per captured variable: the Sharding its shards are stored in
  variables_written: Tuple[bool, ...] = ()  # per captured variable: whether the program may write it
  output_specs: Tuple[Any, ...] = ()     # per flattened output: (Sharding, global shape tuple, tf.DType)
  report: Any = None
  jit: Optional[str] = None              # None (not compiled), "segments" (CPU) or "whole" (GPU, TPU)
  locally_optimized: bool = False        # TF's graph optimizer already ran on local_graph_def (the runtime skips it)
  in_process: Any = None                 # in_process.InProcess: every device's program as one graph, or None
  deferred_checks: Tuple[Check, ...] = ()  # the checks pass: checks whose verdict the program returns
  verdict_agreed: bool = False           # the checks pass: the devices all-reduce whether one failed
  device_program: Optional[DeviceProgram] = None   # what the runtime runs (the last pass)
  exported: Any = None                   # xla_export.Exported: partitioner="xla"'s annotated global program
  function_cache: Any = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def replace(self, **changes):
    return dataclasses.replace(self, **changes)

  @classmethod
  def body(cls, parent, graph_def, input_names, output_refs, param_shardings, out_shardings):
    """The program of a function body of `parent` (a While body, an If branch): its own graph, its parameters
    arriving in `param_shardings`, its results declared as `out_shardings` (or None). It shares with the parent
    what describes the lowering -- mesh, options, devices, processes, the stored variable layouts and the cache of
    completed bodies -- and nothing else: every other field starts empty, whatever fields the parent has."""
    return cls(fn=None, mesh=parent.mesh, options=parent.options, arg_specs=(), declared_in=tuple(param_shardings),
               arriving_in=tuple(param_shardings), declared_out=tuple(out_shardings) if out_shardings else None,
               devices=parent.devices, processes=parent.processes, process=parent.process,
               variable_layout=parent.variable_layout, graph_def=graph_def, input_names=tuple(input_names),
               output_refs=tuple(output_refs), function_cache=parent.function_cache)

  @property
  def on_cpus(self):
    """Whether the mesh's devices are known and every one is a CPU."""
    return bool(self.devices) and all(tf.DeviceSpec.from_string(d).device_type.upper() == "CPU" for d in self.devices)

  def replicated_variables(self):
    """The handles of the captured variables stored replicated (every device holds and writes the whole value)."""
    return {h for h, s in zip(self.variable_names, self.variable_shardings) if s.is_replicated}

  @property
  def output_shardings(self):
    return tuple(self.shardings[r] for r in self.ir.outputs)


def variable_shard(program, name):
  """(shape, dtype) of one device's shard of the captured variable behind handle `name` (padding included), or
  None when its value's shape is unknown."""
  info, layout = program.ir.info(ref(name)), program.shardings[ref(name)]
  if info.value_shape is None:
    return None
  local = info.value_shape if layout.is_maximal else layout.with_rank(len(info.value_shape)).shard_shape(
      info.value_shape)
  return tuple(local), info.value_dtype


def variable_shard_bytes(program, name):
  """Bytes of one device's shard of the captured variable behind handle `name`, or None (shape unknown)."""
  shard = variable_shard(program, name)
  return None if shard is None else int(np.prod(shard[0])) * shard[1].size
