"""The partition report: every collective the per-device program performs, with its cause.

Bytes are per device (`shared` convention): the per-device *result* of an all-gather; the per-device
*operand* of all-reduce, reduce-scatter, all-to-all and collective-permute.
"""

import collections
import dataclasses
from typing import List, Tuple

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
LARGE_GATHER_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
  """One logical collective: kind, dtype, per-device shape, bytes, group size, mesh axes, cause."""

  kind: str
  dtype: str
  shape: Tuple[int, ...]
  bytes: int
  group_size: int
  axes: Tuple[str, ...]
  source: str           # the op that needed it
  reason: str           # why
  emitted: str = ""     # what the backend emitted, when it differs from `kind`

  def __str__(self):
    shape = ",".join(str(s) for s in self.shape)
    return (f"{self.kind} {self.dtype}[{shape}] over {'x'.join(self.axes) or '-'} (group {self.group_size}), "
            f"{self.bytes:,} B/device - {self.source}: {self.reason}")


@dataclasses.dataclass
class Report:
  collectives: List[CollectiveRecord] = dataclasses.field(default_factory=list)
  fallbacks: List[Tuple[str, str]] = dataclasses.field(default_factory=list)   # (node, op type)
  reshards: List[Tuple[str, str, str, Tuple[str, ...]]] = dataclasses.field(default_factory=list)  # (op, from, to, steps)
  completion_iterations: int = 0
  warnings: List[str] = dataclasses.field(default_factory=list)
  pass_times: dict = dataclasses.field(default_factory=dict)

  def add(self, record):
    self.collectives.append(record)
    if record.kind == "all-gather" and record.bytes > LARGE_GATHER_BYTES:
      self.warnings.append(f"involuntary full rematerialization: {record}")

  def counts(self):
    """{kind: number of collectives} for the kinds present."""
    return dict(collections.Counter(c.kind for c in self.collectives))

  def bytes_per_device(self):
    return sum(c.bytes for c in self.collectives)

  def __str__(self):
    lines = [f"{len(self.collectives)} collective(s), {self.bytes_per_device():,} bytes per device, "
             f"{len(self.reshards)} reshard(s)"]
    lines += ["  " + str(c) for c in self.collectives]
    if self.fallbacks:
      lines.append("replicated fallback for: " + ", ".join(f"{n} ({op})" for n, op in self.fallbacks))
    lines += ["warning: " + w for w in self.warnings]
    return "\n".join(lines)
