"""Pass: each `gs.pipeline` of the program stated in its report (`Report.pipelines`)."""

import math

from tf_gspmd.rewriter.report import PipelineSchedule


def run(program):
  """The pass that states each `gs.pipeline` of the program (`program.pipelines`) in its report: the schedule,
  the bytes of one shift (the loop's collective-permutes from the pipeline's Roll), the collectives over the
  stage axis inside its loops (forward and gradient), and its buffers' bytes per device from their layouts."""
  rep = program.report
  schedules = []
  for spec in program.pipelines:
    loop = f"{spec.name}_loop/"
    shifts = [c for c in rep.collectives if c.kind == "collective-permute" and c.source.endswith(loop + spec.shift)]
    in_loops = tuple(f"{c.kind} {c.bytes:,} B{c.loops_text} ({c.source})" for c in rep.collectives
                     if loop in c.source and spec.stage_axis in c.axes)
    buffers = []
    for tensor, shape, itemsize in spec.buffers:
      sharding = _sharding_of(program, tensor)
      local = shape if sharding is None or sharding.is_maximal else sharding.with_rank(len(shape)).shard_shape(shape)
      buffers.append((tensor[len(spec.name) + 1:], math.prod(int(d) for d in local) * itemsize))
    schedules.append(PipelineSchedule(
        name=spec.name, stage_axis=spec.stage_axis, schedule=spec.schedule, shift_bytes=sum(c.bytes for c in shifts),
        shift_permutes=len(shifts), loop_stage_collectives=in_loops,
        buffer_bytes=tuple(buffers)))
  return program.replace(report=rep.with_pipelines(schedules)) if schedules else program


def _sharding_of(program, tensor):
  """The completed sharding of the op named `tensor` (or ending in /`tensor`: it may sit in a name scope)."""
  for r, s in (program.shardings or {}).items():
    op = r.split(":")[0]
    if op == tensor or op.endswith("/" + tensor):
      return s
  return None

