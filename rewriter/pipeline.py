"""The pass pipeline: one explicit list, one line per pass; the pass manager that runs it.

Every pass is a function Program -> Program that never mutates its input. The manager times each pass
(into the report), dumps each pass's graph when TF_GSPMD_DUMP_DIR is set, and names the failing pass in
errors. The last stage, importing the per-device program as a tf.function on every device, is done by the
runtime (`tf_gspmd.runtime`), because it needs the devices; everything here runs without them. The runtime
reads one record, `DeviceProgram` (built by the last pass), never the Program or its IR.
"""

import dataclasses
import os
import time
from typing import Any, Optional, Tuple

import tensorflow as tf

from tf_gspmd.errors import PartitionError, ShardingError
from tf_gspmd.rewriter import (auto, cleanup, combine, completion, constants, grappler, horizontal,
                               import_annotations, in_process, jit, memory, ordering, partition, schedules, trace,
                               weight_update, xla_export)


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
  collective_keys: Any = None            # per device: {collective op name: (group key, instance key)} (in_process)
  in_process: Any = None                 # in_process.InProcess: every device's program as one graph, or None
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
               devices=parent.devices, processes=parent.processes, variable_layout=parent.variable_layout,
               graph_def=graph_def, input_names=tuple(input_names), output_refs=tuple(output_refs),
               function_cache=parent.function_cache)

  @property
  def on_cpus(self):
    """Whether the mesh's devices are known and every one is a CPU."""
    return bool(self.devices) and all(tf.DeviceSpec.from_string(d).device_type.upper() == "CPU" for d in self.devices)

  @property
  def output_shardings(self):
    return tuple(self.shardings[r] for r in self.ir.outputs)


def device_program(program):
  """Pass: `program.device_program`, the record the runtime runs (needs the mesh's devices; None in plan mode)."""
  if program.devices is None or program.local_graph_def is None:
    return program
  return program.replace(device_program=DeviceProgram(
      devices=tuple(program.devices), graph_def=program.local_graph_def, partition_id=program.partition_id,
      inputs=tuple(program.local_inputs), variable_inputs=tuple(program.local_variables),
      outputs=tuple(program.local_outputs), side_effects=tuple(program.side_effects),
      arguments=tuple(zip(program.input_names, program.arg_specs, program.param_shardings)),
      variables=tuple(zip(program.variable_names, program.variables, program.variable_shardings,
                          program.variables_written)),
      results=tuple(program.output_specs), jit=program.jit, locally_optimized=program.locally_optimized,
      in_process=program.in_process, collective_timeout=program.options.collective_timeout))


PASSES = (
    ("trace", trace.run),                          # Python fn -> global GraphDef with static shapes
    ("grappler", grappler.run),                    # shape/constant folding, function inlining
    ("import_annotations", import_annotations.run),  # _XlaSharding / XlaSharding / boundaries -> pinned shardings
    ("auto_shard", auto.run),                      # layouts left "auto" chosen by an integer program
    ("complete", completion.run),                  # a sharding for every tensor
    ("weight_update_sharding", weight_update.run),  # optimizer state and updates split over the data axis
    ("xla_export", xla_export.run),                # partitioner="xla": every layout written as XLA sharding
    ("partition", partition.run),                  # one per-device GraphDef + collective report
    ("combine", combine.run),                      # independent all-reduces merged into one collective
    ("cleanup", cleanup.run),                      # dead nodes removed
    ("verify", cleanup.verify),                    # invariants of the per-device program
    ("memory", memory.run),                        # estimated peak bytes per device (report.memory)
    ("collective_keys", in_process.keys),          # CPUs: each device's collective keys
    ("compile", jit.run),                          # XLA: segments between collectives (CPU) or whole (GPU, TPU)
    ("optimize", grappler.run_local),              # TF's graph optimizer on the per-device program, once
    ("constants", constants.run),                  # its constants per device (report.constants); strict: none > 1 MiB
    ("in_process", in_process.run),                # CPUs: one graph per process, collectives as device edges
    ("fuse", horizontal.run),                      # else: like element-wise chains (an optimizer's, per weight) as one
    ("order", ordering.run),                       # every device launches its collectives in one order
    ("schedules", schedules.run),                  # gs.pipeline schedules stated in the report
    ("device_program", device_program),            # the record the runtime runs
    ("xla_planned", xla_export.mark_planned),      # partitioner="xla": the report is marked as our plan only
)
# With partitioner="xla", XLA partitions and runs the exported program: the passes above that prepare tf_gspmd's
# per-device program to run are skipped; those before them still plan it, for the report.
RUN_ONLY = frozenset(("collective_keys", "compile", "optimize", "fuse", "in_process", "order", "device_program"))


def run(program):
  times = {}
  dump = os.environ.get("TF_GSPMD_DUMP_DIR")
  skip = RUN_ONLY if program.options.partitioner == xla_export.XLA else ()
  for k, (name, fn) in enumerate(PASSES):
    if name in skip:
      continue
    start = time.perf_counter()
    try:
      program = fn(program)
    except ShardingError:
      raise
    except trace.UserCodeError as e:   # the user's own error, as tf.function would raise it
      raise e.error from None
    except Exception as e:  # pylint: disable=broad-except
      raise PartitionError(f"pass '{name}' failed: {type(e).__name__}: {e}") from e
    times[name] = time.perf_counter() - start
    if dump:
      _dump(dump, k, name, program)
  return program.replace(report=program.report.with_pass_times(times)) if program.report is not None else program


def _dump(directory, k, name, program):
  os.makedirs(directory, exist_ok=True)
  gd = program.local_graph_def if program.local_graph_def is not None else program.graph_def
  if gd is not None:
    with open(os.path.join(directory, f"{k:02d}_{name}.pbtxt"), "w") as f:
      f.write(str(gd))
