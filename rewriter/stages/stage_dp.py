"""Alpa's inter-operator dynamic program: stage boundaries and submeshes that minimise the pipeline latency.

Submeshes (`submesh_shapes`): a mesh of R rows of M devices (a 2-D mesh; more dims are rows x the last) is cut
into submeshes of one row's power-of-two part, (1, 2^k) with 2^k dividing M, or whole rows, (r, M). Stage sizes
that add up to R x M always tile the mesh (`tile`: whole rows first, then the row parts largest first, each into
the first row with room; every part size divides every larger one and M, so the parts fill rows exactly).

Costs arrive as a table over (first layer i, last layer j, configuration c): a configuration is a submesh size
with a logical mesh shape; `t[i, j, c]` the stage's latency per microbatch, `state[i, j, c]` the bytes per device
that do not grow with microbatches in flight (parameters, gradients, optimizer state) and `act[i, j, c]` those of
one microbatch's activations. A stage with s stages from it to the last (itself included) keeps s microbatches'
activations under 1F1B, so it fits when state + s x act <= the budget.

`solve` enumerates the largest stage latency t_max over the table's values (ascending from the least one under
which any plan exists, found by bisection; skipping values within `step` of the last one tried) and, for each, finds the partition of the layers into stages with sizes summing to
the mesh that minimises the sum of latencies, every stage at most t_max and within the budget: T* = sum t_i +
(B - 1) x max t_j of each is recorded and the enumeration stops once (B - 1) x t_max plus the smallest possible
sum exceeds the best T* found. Without a budget the number of stages after a stage does not matter and the
program drops that dimension.
"""

import dataclasses
import itertools
from typing import Tuple

import numpy as np

from tf_gspmd._layout.schedule import Schedule

INF = float("inf")


def mesh_rows(shape):
  """(rows, devices per row) of a mesh shape: the last dim is a row, the others rows."""
  shape = tuple(int(d) for d in shape)
  if len(shape) == 1:
    return 1, shape[0]
  rows = 1
  for d in shape[:-1]:
    rows *= d
  return rows, shape[-1]


def submesh_shapes(rows, cols):
  """Alpa's submesh shapes of an (rows, cols) mesh: (1, 2^k) with 2^k < cols dividing cols, then (r, cols)."""
  out, k = [], 1
  while k < cols:
    if cols % k == 0:
      out.append((1, k))
    k *= 2
  return out + [(r, cols) for r in range(1, rows + 1)]


def logical_shapes(n):
  """Logical 2-D meshes of n devices, (a, b) with a x b = n and a <= b (the intra-operator plan is the same
  with the axes swapped)."""
  return [(a, n // a) for a in range(1, int(n ** 0.5) + 1) if n % a == 0]


@dataclasses.dataclass(frozen=True)
class Config:
  shape: Tuple[int, int]     # the submesh: (rows, devices per row)
  logical: Tuple[int, int]   # the logical mesh its stage's program runs on

  @property
  def size(self):
    return self.shape[0] * self.shape[1]


def configs(rows, cols):
  return [Config(s, l) for s in submesh_shapes(rows, cols) for l in logical_shapes(s[0] * s[1])]


def tile(rows, cols, shapes):
  """Device positions (row-major indices into the mesh) of each submesh of `shapes` (in order), placed as the
  module docstring says; ValueError when they do not cover the mesh exactly."""
  if sum(r * c for r, c in shapes) != rows * cols:
    raise ValueError(f"submeshes {shapes} hold {sum(r * c for r, c in shapes)} devices, the mesh {rows * cols}")
  out = [None] * len(shapes)
  row = 0
  for k, (r, c) in enumerate(shapes):
    if c == cols:
      out[k] = tuple(range(row * cols, (row + r) * cols))
      row += r
  free = [0] * rows   # devices used in each row left
  for k in sorted((k for k, (r, c) in enumerate(shapes) if c != cols), key=lambda k: -shapes[k][1]):
    c = shapes[k][1]
    for q in range(row, rows):
      if free[q] + c <= cols:
        out[k] = tuple(range(q * cols + free[q], q * cols + free[q] + c))
        free[q] += c
        break
    else:
      raise ValueError(f"submeshes {shapes} do not tile a ({rows}, {cols}) mesh")
  return out


@dataclasses.dataclass(frozen=True)
class Solution:
  stages: Tuple[Tuple[int, int, int], ...]   # (first layer, last layer, configuration index) per stage
  latencies: Tuple[float, ...]
  total: float                              # T* = sum + (B - 1) x max

  @property
  def t_max(self):
    return max(self.latencies)


def latency(lat, microbatches):
  """A step's seconds for stage latencies `lat` (`Schedule.step_time`: 1F1B's and GPipe's alike)."""
  return Schedule("1f1b", len(lat), microbatches).step_time(lat)


def _best_per_size(t, fits, t_max, sizes, cfg_size):
  """[i, j, z] the least latency among configurations of size sizes[z] within t_max where `fits`, and which."""
  ok = np.where((t <= t_max) & fits, t, INF)
  best = np.full(t.shape[:2] + (len(sizes),), INF)
  which = np.zeros(t.shape[:2] + (len(sizes),), dtype=np.int64)
  for z, size in enumerate(sizes):
    idx = np.flatnonzero(cfg_size == size)
    sub = ok[:, :, idx]
    a = sub.argmin(axis=2)
    best[:, :, z] = np.take_along_axis(sub, a[:, :, None], axis=2)[:, :, 0]
    which[:, :, z] = idx[a]
  return best, which


def _layer_dp(best, prev, layers, devices, sizes):
  """One round of the program: F[k, d] = min over stages k..j on a submesh of size z of best[k, j, z] +
  prev[j + 1, d - z]; returns F and the (j, z) chosen per (k, d)."""
  F = np.full((layers + 1, devices + 1), INF)
  bj = np.zeros((layers + 1, devices + 1), dtype=np.int64)
  bz = np.zeros((layers + 1, devices + 1), dtype=np.int64)
  _fill(best, prev, F, bj, bz, layers, devices, sizes)
  return F, bj, bz


def _run(best_of, layers, devices, sizes, max_stages, counted):
  """The stages of F[0][devices] for each number of stages s up to max_stages (`counted`: under a budget, or a
  limit on the stages; otherwise for any number), where F[k, d] is the least sum of latencies of layers k..L-1 on
  d devices."""
  found = []
  if not counted:
    best, which = best_of(1)
    F = np.full((layers + 1, devices + 1), INF)
    F[layers, 0] = 0.0
    F, bj, bz = _layer_dp_in_place(best, F, layers, devices, sizes)
    if F[0, devices] < INF:
      stages, k, d = [], 0, devices
      while k < layers:
        j, z = int(bj[k, d]), int(bz[k, d])
        stages.append((k, j, int(which[k, j, z])))
        k, d = j + 1, d - sizes[z]
      found.append(tuple(stages))
    return found
  prev = np.full((layers + 1, devices + 1), INF)
  prev[layers, 0] = 0.0
  rounds = []
  for s in range(1, max_stages + 1):
    best, which = best_of(s)
    F, bj, bz = _layer_dp(best, prev, layers, devices, sizes)
    rounds.append((bj, bz, which))
    if F[0, devices] < INF:
      stages, k, d = [], 0, devices
      for q in range(s - 1, -1, -1):
        bj_q, bz_q, which_q = rounds[q]
        j, z = int(bj_q[k, d]), int(bz_q[k, d])
        stages.append((k, j, int(which_q[k, j, z])))
        k, d = j + 1, d - sizes[z]
      found.append(tuple(stages))
    if not np.isfinite(F).any():
      break
    prev = F
  return found


def _layer_dp_in_place(best, F, layers, devices, sizes):
  """`_layer_dp` with one table: each row F[k] is filled from the rows after it (any number of stages)."""
  bj = np.zeros((layers + 1, devices + 1), dtype=np.int64)
  bz = np.zeros((layers + 1, devices + 1), dtype=np.int64)
  _fill(best, F, F, bj, bz, layers, devices, sizes)
  return F, bj, bz


def _fill(best, src, F, bj, bz, layers, devices, sizes):
  for k in range(layers - 1, -1, -1):
    for z, size in enumerate(sizes):
      if size > devices:
        continue
      cand = best[k, k:, z][:, None] + src[k + 1:, :devices + 1 - size]   # stage k..j, then j+1.. on d - size
      j = cand.argmin(axis=0)
      v = cand[j, np.arange(devices + 1 - size)]
      better = v < F[k, size:]
      F[k, size:] = np.where(better, v, F[k, size:])
      bj[k, size:] = np.where(better, k + j, bj[k, size:])
      bz[k, size:] = np.where(better, z, bz[k, size:])


def solve(t, state, act, cfg_sizes, devices, microbatches, budget=None, max_stages=None, step=0.0, keep=4):
  """The `keep` best plans (Solutions, best first) under the module docstring's program; [] when none fits.
  Also returns the number of t_max values tried."""
  layers = t.shape[0]
  cfg_size = np.asarray(cfg_sizes)
  sizes = sorted(set(int(s) for s in cfg_sizes))
  limited = max_stages is not None and max_stages < min(layers, devices)
  max_stages = min(layers, devices, max_stages or layers)
  budgeted = budget is not None

  def fits(s):
    return np.ones(t.shape, bool) if not budgeted else state + s * act <= budget

  values = np.unique(t[np.isfinite(t)])
  plans, tried = {}, [0]
  fastest = {}   # s -> per size the fastest fitting configuration: within t_max exactly when it is

  def run_at(t_max):
    tried[0] += 1

    def best_of(s):
      if s not in fastest:
        fastest[s] = _best_per_size(t, fits(s), INF, sizes, cfg_size)
      best, which = fastest[s]
      return np.where(best <= t_max, best, INF), which

    return _run(best_of, layers, devices, sizes, max_stages, budgeted or limited)

  if not values.size or not run_at(values[-1]):
    return [], tried[0]
  lo, hi = 0, len(values) - 1   # feasibility grows with t_max: the least feasible one by bisection
  while lo < hi:
    mid = (lo + hi) // 2
    if run_at(values[mid]):
      hi = mid
    else:
      lo = mid + 1
  best_total, last = INF, None
  for t_max in values[lo:]:
    if last is not None and t_max <= last * (1 + step):
      continue
    if last is not None and microbatches * last >= best_total:
      break   # a plan not found yet has its largest latency above `last`: T* > B x last
    last = t_max
    for stages in run_at(t_max):
      lat = tuple(float(t[i, j, c]) for i, j, c in stages)
      sol = Solution(stages, lat, latency(lat, microbatches))
      plans[stages] = sol
      best_total = min(best_total, sol.total)
  ordered = sorted(plans.values(), key=lambda p: (p.total, len(p.stages)))
  return ordered[:keep], tried[0]


def brute_force(t, state, act, cfg_sizes, devices, microbatches, budget=None, max_stages=None):
  """The least T* over every partition of the layers into contiguous stages and every configuration of each
  whose sizes add up to `devices` (a check of `solve` on small tables); None when nothing fits."""
  layers = t.shape[0]
  best = None
  for cuts in itertools.product((False, True), repeat=layers - 1):
    bounds = [0] + [k + 1 for k, c in enumerate(cuts) if c] + [layers]
    ranges = [(bounds[q], bounds[q + 1] - 1) for q in range(len(bounds) - 1)]
    n = len(ranges)
    if max_stages is not None and n > max_stages:
      continue
    for cfgs in itertools.product(range(len(cfg_sizes)), repeat=n):
      if sum(cfg_sizes[c] for c in cfgs) != devices:
        continue
      lat = []
      for q, ((i, j), c) in enumerate(zip(ranges, cfgs)):
        if budget is not None and state[i, j, c] + (n - q) * act[i, j, c] > budget:
          break
        lat.append(t[i, j, c])
      else:
        if all(np.isfinite(lat)):
          total = latency(lat, microbatches)
          best = total if best is None else min(best, total)
  return best
