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


@dataclasses.dataclass(frozen=True)
class StateRecord:
  """One variable the program keeps on the devices: its layout and its bytes per device."""

  name: str
  shape: Tuple[int, ...]
  sharding: str
  bytes_per_device: int   # the shard, padding included
  global_bytes: int
  role: str               # "weight" (read by the computation) or "update state" (optimizer slots, counters)


@dataclasses.dataclass
class Report:
  collectives: List[CollectiveRecord] = dataclasses.field(default_factory=list)
  fallbacks: List[Tuple[str, str]] = dataclasses.field(default_factory=list)   # (node, op type)
  reshards: List[Tuple[str, str, str, Tuple[str, ...]]] = dataclasses.field(default_factory=list)  # (op, from, to, steps)
  completion_iterations: int = 0
  warnings: List[str] = dataclasses.field(default_factory=list)
  pass_times: dict = dataclasses.field(default_factory=dict)
  state: List[StateRecord] = dataclasses.field(default_factory=list)
  combined: List[Tuple[int, int]] = dataclasses.field(default_factory=list)  # (all-reduces merged, bytes) each

  def add(self, record):
    self.collectives.append(record)
    if record.kind == "all-gather" and record.bytes > LARGE_GATHER_BYTES:
      self.warnings.append(f"involuntary full rematerialization: {record}")

  def counts(self):
    """{kind: number of collectives} for the kinds present."""
    return dict(collections.Counter(c.kind for c in self.collectives))

  def bytes_per_device(self):
    return sum(c.bytes for c in self.collectives)

  def wire_bytes_per_device(self):
    """Bytes each device sends with bandwidth-optimal (ring) algorithms: an all-reduce of B bytes over N devices
    sends 2B(N-1)/N, a reduce-scatter, all-gather or all-to-all B(N-1)/N, a collective-permute B. A reduce-scatter
    plus an all-gather therefore costs what the all-reduce they replace costs."""
    total = 0.0
    for c in self.collectives:
      share = (c.group_size - 1) / c.group_size if c.group_size else 0.0
      total += c.bytes * {"all-reduce": 2 * share, "collective-permute": 1.0}.get(c.kind, share)
    return int(round(total))

  def state_bytes(self, role=None):
    """(bytes per device, global bytes) of the variables kept on the devices ("weight", "update state" or all)."""
    rows = [r for r in self.state if role is None or r.role == role]
    return sum(r.bytes_per_device for r in rows), sum(r.global_bytes for r in rows)

  def __str__(self):
    lines = [f"{len(self.collectives)} collective(s), {self.bytes_per_device():,} bytes per device "
             f"({self.wire_bytes_per_device():,} sent on the wire), {len(self.reshards)} reshard(s)"]
    lines += ["  " + str(c) for c in self.collectives]
    if self.combined:
      merged = sum(n for n, _ in self.combined)
      lines.append(f"emitted: {merged} independent all-reduces combined into {len(self.combined)} collectives")
    for role in ("weight", "update state"):
      if any(r.role == role for r in self.state):
        local, total = self.state_bytes(role)
        lines.append(f"{role} variables: {local:,} B per device of {total:,} B")
    if self.fallbacks:
      lines.append("replicated fallback for: " + ", ".join(f"{n} ({op})" for n, op in self.fallbacks))
    lines += ["warning: " + w for w in self.warnings]
    return "\n".join(lines)
