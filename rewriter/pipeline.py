"""The pass pipeline: one explicit list, one line per pass; the paths a lowering takes through it; the pass manager.

Every pass is a function Program -> Program that never mutates its input. A lowering takes one path (`path_of`),
a selection of the list in its order (`PATHS`):

  * "one_graph": CPU devices with exchange="auto", driven by the processes running now -- the program of every
    device of a process becomes one graph (one_graph/); where it cannot (`in_process.applies`: XLA segments across
    processes, collectives inside function bodies, a collective across processes the graph cannot hold), the
    lowering goes on along "collectives" after the in_process pass (`FALLBACK`);
  * "collectives": every device runs the per-device program, its collectives TF's (GPUs, TPUs, exchange=
    "collectives", several processes planned from one);
  * "plan": no devices (plan mode): the per-device program and its report, nothing that needs the devices;
  * "xla": partitioner="xla": the completed program exported with every layout as XLA sharding; XLA partitions
    it, so nothing here partitions it (`Lowered.report` then asks `plan_of_export` for tf_gspmd's own plan).

The manager times each pass (into the report), dumps each pass's graph when TF_GSPMD_DUMP_DIR is set, and names
the failing pass in errors. The last stage, importing the per-device program as a tf.function on every device, is
done by the runtime (`tf_gspmd.runtime`), because it needs the devices; everything here runs without them. The
runtime reads one record, `DeviceProgram` (built by the last pass), never the Program or its IR.
"""

import dataclasses
import os
import time

from tf_gspmd.errors import PartitionError, ShardingError
from tf_gspmd.rewriter.backend import checks, cleanup, constants, horizontal, jit, xla_export
from tf_gspmd.rewriter.collectives import combine, ordering
from tf_gspmd.rewriter.frontend import grappler, import_annotations, trace
from tf_gspmd.rewriter.graph import graph_view
from tf_gspmd.rewriter.one_graph import in_process
from tf_gspmd.rewriter.partition import partition, schedules
from tf_gspmd.rewriter.program import DeviceProgram
from tf_gspmd.rewriter.sharding import auto, completion, device_memory, weight_update


def device_program(program):
  """Pass: `program.device_program`, the record the runtime runs (needs the mesh's devices; None in plan mode); its
  graphs' functions named by what they compute (`graph_view.named_by_content`)."""
  one_graph = program.in_process
  if one_graph is not None and one_graph.graph_def.library.function:
    one_graph = dataclasses.replace(one_graph, graph_def=graph_view.named_by_content(one_graph.graph_def))
  local = program.local_graph_def
  return program.replace(device_program=DeviceProgram(
      devices=tuple(program.devices), partition_id=program.partition_id,
      graph_def=graph_view.named_by_content(local) if local.library.function else local,
      inputs=tuple(program.local_inputs), variable_inputs=tuple(program.local_variables),
      outputs=tuple(program.local_outputs), side_effects=tuple(program.side_effects),
      arguments=tuple(zip(program.input_names, program.arg_specs, program.param_shardings)),
      variables=tuple(zip(program.variable_names, program.variables, program.variable_shardings,
                          program.variables_written)),
      results=tuple(program.output_specs), jit=program.jit, locally_optimized=program.locally_optimized,
      in_process=one_graph, collective_timeout=program.options.collective_timeout,
      checks=program.deferred_checks, verdict=checks.VERDICT if program.deferred_checks else None,
      verdict_agreed=program.verdict_agreed))


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
    ("memory", device_memory.run),                 # estimated peak bytes per device (report.memory)
    ("compile", jit.run),                          # XLA: segments between collectives (CPU) or whole (GPU, TPU)
    ("optimize", grappler.run_local),              # TF's graph optimizer on the per-device program, once
    ("constants", constants.run),                  # its constants per device (report.constants); strict: none > 1 MiB
    ("in_process", in_process.run),                # one graph per process, collectives as device edges
    ("fuse", horizontal.run),                      # like element-wise chains (an optimizer's, per weight) as one
    ("checks", checks.run),                        # a failed check raised after the step, not inside it
    ("order", ordering.run),                       # every device launches its collectives in one order
    ("schedules", schedules.run),                  # gs.pipeline schedules stated in the report
    ("device_program", device_program),            # the record the runtime runs
)

ONE_GRAPH, COLLECTIVES, PLAN, XLA = "one_graph", "collectives", "plan", "xla"
_COMPLETE = ("trace", "grappler", "import_annotations", "auto_shard", "complete", "weight_update_sharding")
_PARTITION = ("partition", "combine", "cleanup", "verify", "memory")
PATHS = {   # the passes each path runs, in the order of PASSES
    ONE_GRAPH: _COMPLETE + _PARTITION + ("compile", "optimize", "constants", "in_process", "schedules",
                                         "device_program"),
    COLLECTIVES: _COMPLETE + _PARTITION + ("compile", "optimize", "constants", "fuse", "checks", "order",
                                           "schedules", "device_program"),
    PLAN: _COMPLETE + _PARTITION + ("compile", "constants", "order", "schedules"),
    XLA: _COMPLETE + ("xla_export",),
}
# A path another takes over from, after one of its passes, when that pass finds it cannot go on: (pass, path).
FALLBACK = {ONE_GRAPH: ("in_process", COLLECTIVES)}


def path_of(program):
  """The path `program` takes through PASSES (see the module docstring)."""
  if program.options.partitioner == xla_export.XLA:
    return XLA
  if program.devices is None:
    return PLAN
  return ONE_GRAPH if in_process.runs_as_one_graph(program) else COLLECTIVES


def run(program, path=None, after=None, until=None):
  """`program` through the passes of `path` (default: `path_of(program)`): those after pass `after` and up to pass
  `until` where given; the report gets each pass's time."""
  path = path or path_of(program)
  names = [name for name, _ in PASSES]
  first = 0 if after is None else names.index(after) + 1
  last = len(names) - 1 if until is None else names.index(until)
  times = {}
  dump = os.environ.get("TF_GSPMD_DUMP_DIR")
  for k, (name, fn) in enumerate(PASSES):
    if name not in PATHS[path] or not first <= k <= last:
      continue
    start = time.perf_counter()
    program = _run_pass(name, fn, program)
    times[name] = time.perf_counter() - start
    if dump:
      _dump(dump, k, name, program)
    if FALLBACK.get(path, (None,))[0] == name and program.in_process is None:
      path = FALLBACK[path][1]
  if program.report is None:
    return program
  return program.replace(report=program.report.with_pass_times(times))


def plan_of_export(program):
  """tf_gspmd's own plan of a program lowered with partitioner="xla": the report of the plan path's passes after
  the export, marked as a plan only (XLA partitions the program that runs)."""
  planned = run(program, path=PLAN, after="xla_export")
  return planned.report.with_planned(xla_export.PLANNED)


def _run_pass(name, fn, program):
  try:
    return fn(program)
  except ShardingError:
    raise
  except trace.UserCodeError as e:   # the user's own error, as tf.function would raise it
    raise e.error from None
  except Exception as e:  # pylint: disable=broad-except
    raise PartitionError(f"pass '{name}' failed: {type(e).__name__}: {e}") from e


def _dump(directory, k, name, program):
  os.makedirs(directory, exist_ok=True)
  gd = program.local_graph_def if program.local_graph_def is not None else program.graph_def
  if gd is not None:
    with open(os.path.join(directory, f"{k:02d}_{name}.pbtxt"), "w") as f:
      f.write(str(gd))
