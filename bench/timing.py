"""Timing shared by the benchmarks."""

import time

import numpy as np


def interleaved(calls, steps, block=3):
  """{key: median seconds of calls[key]()} (None where calls[key] is None) over `steps` timed calls each.

  The configurations take turns in rounds, in an order rotated round by round, so a burst of load on the
  machine falls on all of them alike rather than on whichever was being timed; in its turn each runs one
  untimed call, then `block` timed ones back to back, as a training loop repeats its step (switching programs
  every call would time them with cold caches).
  """
  keys = [k for k, c in calls.items() if c is not None]
  for k in keys:
    calls[k]()
  times = {k: [] for k in keys}
  for r in range(-(-steps // block)):
    for k in keys[r % len(keys):] + keys[:r % len(keys)]:
      calls[k]()
      for _ in range(min(block, steps - len(times[k]))):
        start = time.perf_counter()
        calls[k]()
        times[k].append(time.perf_counter() - start)
  return {k: (float(np.median(times[k])) if k in times else None) for k in calls}
