"""Pipeline schedules: the one description of how a pipeline runs its microbatches through its stages.

GSPMD's SPMD pipeline (`gs.pipeline`) runs "circular": S stage slots on a mesh axis, M microbatches, R circular
repeats, in R*M + S - 1 loop iterations of which (S-1)/(R*M+S-1) compute nothing useful (its backward is the
loop's gradient: every forward, then every backward). MPMD pipelines on submeshes (`gs.mpmd_pipeline`, Alpa's
stages) run "gpipe" (every forward, then every backward) or "1f1b" (after S - i - 1 warm-up forwards, stage i
alternates one forward and one backward, so at most S - i microbatch inputs are alive in it). Both are a
`Schedule`: its order per stage, its iterations and bubble, and the step time of stages of given latencies, which
the stage planner prices.
"""

import dataclasses
import numbers

from tf_gspmd.errors import InputError

KINDS = ("circular", "gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Schedule:
  """How `stages` stages run `microbatches` microbatches (`repeats` circular repeats of the stages: "circular")."""

  kind: str
  stages: int
  microbatches: int
  repeats: int = 1

  def __post_init__(self):
    if self.kind not in KINDS:
      raise InputError(f"schedule={self.kind!r}: give one of {KINDS}", node="schedule")
    for name in ("stages", "microbatches", "repeats"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InputError(f"{name}={value!r}: a pipeline schedule needs a whole number of 1 or more {name}",
                         node=name)

  @property
  def iterations(self):
    """Time steps of the forward: R*M + S - 1 (the last microbatch leaves the last stage)."""
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble_fraction(self):
    """The share of stage-iterations that compute nothing useful: (S-1)/(R*M+S-1)."""
    return (self.stages - 1) / self.iterations

  def order(self, stage):
    """The order stage `stage` runs its work: a list of ("F" | "B", microbatch)."""
    items = self.repeats * self.microbatches
    fwd = [("F", m) for m in range(items)]
    bwd = [("B", m) for m in range(items)]
    if self.kind != "1f1b":
      return fwd + bwd
    warm = min(self.stages - stage - 1, items)
    order = fwd[:warm]
    for m in range(items - warm):
      order += [fwd[warm + m], bwd[m]]
    return order + bwd[items - warm:]

  def orders(self):
    """`order` of every stage."""
    return [self.order(i) for i in range(self.stages)]

  def step_time(self, latencies):
    """Seconds of a step whose stage i takes latencies[i] per microbatch: the first microbatch through every
    stage, then one more per microbatch at the slowest stage's pace, sum + (M - 1) * max."""
    return sum(latencies) + (self.microbatches - 1) * max(latencies)
