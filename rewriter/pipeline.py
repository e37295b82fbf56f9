"""The pass pipeline: one explicit list, one line per pass; the pass manager that runs it.

Every pass is a function Program -> Program that never mutates its input. The manager times each pass
(into the report), dumps each pass's graph when TF_GSPMD_DUMP_DIR is set, and names the failing pass in
errors. The last stage, importing the per-device program as a tf.function on every device, is done by the
runtime (`tf_gspmd.runtime`), because it needs the devices; everything here runs without them. The runtime
reads one record, `DeviceProgram` (built by the last pass), never the Program or its IR.
"""

import os
import time

from tf_gspmd.errors import PartitionError, ShardingError
from tf_gspmd.rewriter.sharding import auto, completion, memory, weight_update
from tf_gspmd.rewriter.backend import cleanup, constants, horizontal, jit, xla_export
from tf_gspmd.rewriter.collectives import combine, ordering
from tf_gspmd.rewriter.frontend import grappler, import_annotations, trace
from tf_gspmd.rewriter.one_graph import in_process
from tf_gspmd.rewriter.partition import partition, schedules
from tf_gspmd.rewriter.program import DeviceProgram


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
