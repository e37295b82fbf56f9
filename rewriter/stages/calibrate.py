"""Seconds per unit of arithmetic and per byte of a collective on this machine: the stage planner's time scale.

`calibrate()` times, once per process, a float32 matmul (seconds per multiply-add: the unit of arithmetic the
intra-operator model counts, a contraction's factor product and an element-wise op's elements) and, where the
process has at least two logical devices of one type, an all-reduce across two of them through a gs.function
(seconds per byte one device sends); it keeps them in a JSON file (`$TF_GSPMD_CALIBRATION`, default
~/.cache/tf_gspmd/calibration.json) that later processes read instead of timing again. Without two devices the
collective falls back to `DEFAULT`'s per-byte figure.

What a pipeline's runtime adds is timed on submeshes too (`set_stage_timer`, installed by the API floor): the
fixed cost of one call of a stage program (a trivial gs.function on a 2-device submesh: dispatch, argument
placement, result wrapping), the seconds per byte a destination device receives in a cross-mesh move
(gs.reshard of a float32 tensor between two disjoint 2-device submeshes, less the move of a tiny one) and what
the tiny one costs per destination device (each tensor a move carries costs it, whatever its size). It also
measures how many devices compute at once (`parallel_devices`): a matmul per device on k devices against one
device's (logical CPU devices share the process's cores: k devices' work takes k times one device's when one
already fills the cores); inf when they run side by side. A cached file written before these were timed is
timed again.

DEFAULT holds what this routine measured on the 2-core development machine with 8 logical CPU devices:
about 1.5e-11 s per multiply-add (roughly 65 G multiply-adds/s for a 512-cube matmul on both cores) and 1.0e-9 s
per all-reduced byte (about 1 GB/s between logical CPU devices of one process), about 0.5 ms per stage-program
call (0.5 ms at best), 1 ns per byte received in a cross-mesh move and 0.2 ms per tensor moved per destination
device, with the 8 devices computing one at a time (one device's matmul already fills both cores).
"""

import dataclasses
import json
import os
import time
from typing import Any, Callable, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class Calibration:
  seconds_per_flop: float     # per multiply-add (or element of an element-wise op)
  seconds_per_byte: float     # per byte one device sends in a collective
  source: str = "default"
  seconds_per_call: float = 2.0e-3            # one call of a stage program on a submesh (fixed)
  seconds_per_transfer_byte: float = 1.0e-9   # per byte a destination device receives in a cross-mesh move
  parallel_devices: float = float("inf")       # how many devices compute at once (logical devices share cores)
  seconds_per_move: float = 2.0e-4            # per tensor a cross-mesh move carries, per destination device

  @property
  def flops_per_byte(self):
    """Arithmetic a device does in the time a collective moves one byte (the intra-operator model's ratio)."""
    return self.seconds_per_byte / self.seconds_per_flop


DEFAULT = Calibration(seconds_per_flop=1.5e-11, seconds_per_byte=1.0e-9, source="default (development machine)",
                      seconds_per_call=5e-4, seconds_per_transfer_byte=1.0e-9, parallel_devices=1.0,
                      seconds_per_move=2e-4)
_CACHE = {}
_FIELDS = tuple(f.name for f in dataclasses.fields(Calibration))


def _path():
  return os.environ.get("TF_GSPMD_CALIBRATION") or os.path.join(os.path.expanduser("~"), ".cache", "tf_gspmd",
                                                                  "calibration.json")


def call_times(fn, repeats):
  """Seconds of each of `repeats` timed calls of `fn`, after one untimed (tracing, lowering, allocation)."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times


def _best_of(fn, repeats=5):
  return min(call_times(fn, repeats))


def _time_matmul(n=512):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  a = tf.constant(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32))
  mm = tf.function(lambda x: tf.reduce_sum(x @ x))
  return _best_of(lambda: mm(a).numpy()) / n ** 3


@dataclasses.dataclass(frozen=True)
class Timers:
  """What times the runtime's parts, each given `best_of(fn)` (the least of a few timed calls, `call_times`): they
  build gs.functions, so the API floor supplies them (tf_gspmd/_parallel/stages.py); the rewriter runs nothing.

  all_reduce(best_of) -> seconds per byte of an all-reduce over two devices, or None without two devices;
  stage_runs(best_of) -> (seconds per stage-program call, seconds per byte received in a cross-mesh move, devices
  computing at once, seconds per tensor a cross-mesh move carries), or None without four devices of one type."""

  all_reduce: Callable[..., Optional[float]]
  stage_runs: Callable[..., Any]


def calibrate(refresh=False, timers=None):
  """This machine's `Calibration` (timed once, then read from the cache file; `refresh` times again). Without
  `timers` (a `Timers`) the collective and stage figures are the defaults."""
  if not refresh and "c" in _CACHE:
    return _CACHE["c"]
  path = _path()
  if not refresh and os.path.exists(path):
    try:
      with open(path) as f:
        kept = json.load(f)
      if set(kept) == set(_FIELDS):   # (a file from before the stage runs were timed: timed again below)
        c = Calibration(**kept)
        _CACHE["c"] = c
        return c
    except (OSError, ValueError, TypeError):
      pass   # (timed again below)
  per_flop = _time_matmul()
  per_byte = timers.all_reduce(_best_of) if timers is not None else None
  runs = timers.stage_runs(_best_of) if timers is not None else None
  per_call, per_moved, parallel, per_move = runs or (DEFAULT.seconds_per_call, DEFAULT.seconds_per_transfer_byte,
                                                    DEFAULT.parallel_devices, DEFAULT.seconds_per_move)
  c = Calibration(seconds_per_flop=per_flop, seconds_per_byte=per_byte or DEFAULT.seconds_per_byte,
                  source="measured" if per_byte and runs else "measured matmul, default collective or stage runs",
                  seconds_per_call=per_call, seconds_per_transfer_byte=per_moved, parallel_devices=parallel,
                  seconds_per_move=per_move)
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump(dataclasses.asdict(c), f)
  except OSError:
    pass   # (kept for this process only)
  _CACHE["c"] = c
  return c
