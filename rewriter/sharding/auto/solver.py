"""The integer program of a model: stated for HiGHS and solved, evaluated, and folded over repeated layers.

`solve` states a `model.Model` as a MILP: one binary per choice of each block (exactly one per block), one
continuous variable per pair of choices of two blocks joined by a cost matrix (its row and column sums are the
two one-hot choices, exact for integral choices), and the memory budget as one row per op whose live bytes are
bounded (`budget.MemoryRow`). `fold` first merges the blocks of repeated layers; `evaluate` and `local_delta`
price a full assignment and one block's alternatives.

The solver's time limit is wall-clock time: where it runs out, the plan HiGHS holds then depends on how far it got
(the machine's load), so it is not used. `local_search` gives the plan instead: a deterministic descent from every
block at its fewest bytes, within the budget. Identical calls then give identical plans, whether the solver proves
its plan optimal in time (the same every time: one thread, no time-dependent choices) or runs out.
"""

import os
import sys
import time

import numpy as np

from tf_gspmd.errors import AutoShardingError
from tf_gspmd.rewriter.sharding.auto.budget import MemoryRow
from tf_gspmd.rewriter.sharding.auto.model import Model


def _highs():
  """A HiGHS instance, its start-up banner (printed by the C++ library on stdout) kept off the program's output."""
  try:
    import highspy  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise AutoShardingError("in_shardings=\"auto\" needs the HiGHS solver, which is not installed: pip install "
                            "highspy (a dependency of tf_gspmd)") from e
  sys.stdout.flush()
  saved = os.dup(1)
  try:
    with open(os.devnull, "w") as null:
      os.dup2(null.fileno(), 1)
      h = highspy.Highs()
  finally:
    os.dup2(saved, 1)
    os.close(saved)
  return h


TIMED_OUT = "time limit reached"


def solve(model, budget, time_limit):
  """Minimise the model's cost with HiGHS; returns (choice per block, status, columns, rows, seconds). Where the
  time limit runs out (status TIMED_OUT + what was used) the choice is `local_search`'s, or None where that does
  not fit the budget. A `time_limit` of 0 skips the solver."""
  h = _highs()
  start_col, pair_keys, pair_start = _columns(model)
  ny = int(start_col[-1])
  ncol = pair_start[-1]
  cost = _objective(model, start_col, pair_keys, pair_start)
  rows, cols, vals, lo, hi, r = _constraints(model, budget, start_col, pair_keys, pair_start)
  lp = _highs_lp(cost, rows, cols, vals, lo, hi, ncol, r, ny)
  if time_limit <= 0:
    return _fallback(model, budget, ncol, r, 0.0)
  h.setOptionValue("output_flag", False)
  h.setOptionValue("time_limit", float(time_limit))
  h.setOptionValue("mip_rel_gap", 1e-3)
  h.setOptionValue("threads", 1)
  t0 = time.perf_counter()
  h.passModel(lp)
  h.run()
  took = time.perf_counter() - t0
  if h.getModelStatus() == highspy_status("kTimeLimit"):
    return _fallback(model, budget, ncol, r, took)
  status = h.modelStatusToString(h.getModelStatus())
  sol = h.getSolution()
  if not sol.value_valid:
    return None, status, ncol, r, took
  x = np.asarray(sol.col_value)
  choice = [int(np.argmax(x[start_col[b]:start_col[b + 1]])) for b in range(len(model.sizes))]
  return choice, status, ncol, r, took


def highspy_status(name):
  import highspy  # pylint: disable=g-import-not-at-top
  return getattr(highspy.HighsModelStatus, name)


def _fallback(model, budget, ncol, nrow, took):
  start = time.perf_counter()
  choice = local_search(model, budget)
  return (choice, f"{TIMED_OUT}: deterministic local search", ncol, nrow,
          took + time.perf_counter() - start)


def local_search(model, budget, sweeps=50):
  """A plan within `budget` found without the solver, the same for the same model: every block at its choice of
  fewest bytes (summed over the memory rows; ties: the cheaper), then, until nothing improves, each block and each
  pair of blocks joined by a cost matrix in turn moved to the choices that cost least with the rest as they are,
  within the budget. None where the start is over the budget."""
  n = len(model.sizes)
  rows = list(model.rows or [MemoryRow(None)]) if budget is not None else []
  mem = [np.array([np.broadcast_to(np.asarray(row.total(model.state, b), float), (model.sizes[b],))
                   for row in rows]).reshape(len(rows), model.sizes[b]) for b in range(n)]
  choice = [int(np.lexsort((model.linear[b], mem[b].sum(axis=0)))[0]) for b in range(n)]
  room = np.array([float(budget) - row.fixed for row in rows])
  used = np.array([sum(mem[b][j, choice[b]] for b in range(n)) for j in range(len(rows))])
  if np.any(used > room):
    return None
  near = [[] for _ in range(n)]
  for (u, v), (c, _) in sorted(model.pairs.items()):
    near[u].append((v, c))
    near[v].append((u, c.T))

  def cost(b, skip=None):
    return model.linear[b] + sum((c[:, choice[o]] for o, c in near[b] if o != skip), np.zeros(model.sizes[b]))

  for _ in range(sweeps):
    moved = False
    for b in range(n):
      trial = used[:, None] - mem[b][:, [choice[b]]] + mem[b]
      moved |= _move(cost(b), np.all(trial <= room[:, None], axis=0), choice, [b])
      used = trial[:, choice[b]]
    for (u, v), (c, _) in sorted(model.pairs.items()):
      trial = (used[:, None, None] - mem[u][:, [choice[u]], None] - mem[v][:, None, [choice[v]]] +
               mem[u][:, :, None] + mem[v][:, None, :])
      total = cost(u, v)[:, None] + cost(v, u)[None, :] + c
      moved |= _move(total, np.all(trial <= room[:, None, None], axis=0), choice, [u, v])
      used = trial[:, choice[u], choice[v]]
    if not moved:
      break
  return choice


def _move(total, fits, choice, blocks):
  """Moves `blocks` to the cheapest choices of `total` (one axis per block) that `fits`, when cheaper than now."""
  best = np.unravel_index(int(np.argmin(np.where(fits, total, np.inf))), total.shape)
  now = total[tuple(choice[b] for b in blocks)]
  if not fits[best] or total[best] >= now - 1e-9 * max(1.0, abs(now)):
    return False
  for b, i in zip(blocks, best):
    choice[b] = int(i)
  return True


def _columns(model):
  """The MILP's columns, the blocks' choices first, then one matrix per pair: (start_col, pair_keys, pair_start).

  Block b's choices are columns start_col[b]:start_col[b + 1]; pair_keys[k] (the pairs, sorted) has its matrix
  from column pair_start[k], row-major; pair_start[-1] is the number of columns.
  """
  start_col = np.zeros(len(model.sizes) + 1, dtype=np.int64)
  start_col[1:] = np.cumsum(model.sizes)
  ny = int(start_col[-1])
  pair_keys = sorted(model.pairs)
  pair_start = [ny]
  for key in pair_keys:
    pair_start.append(pair_start[-1] + model.sizes[key[0]] * model.sizes[key[1]])
  return start_col, pair_keys, pair_start


def _objective(model, start_col, pair_keys, pair_start):
  """Each column's cost: a choice's own cost, or a pair of choices' entry of its cost matrix (row-major)."""
  cost = np.zeros(pair_start[-1])
  for b, lin in enumerate(model.linear):
    cost[start_col[b]:start_col[b + 1]] = lin
  for key, s in zip(pair_keys, pair_start[:-1]):
    u, v = key
    nu, nv = model.sizes[u], model.sizes[v]
    c = model.pairs[key][0]
    cost[s:s + nu * nv] = c.reshape(-1)
  return cost


def _constraints(model, budget, start_col, pair_keys, pair_start):
  """The MILP's rows: (row and column indices and values, as lists of arrays; lower and upper bounds; row count).

  One choice per block; each pair matrix's row and column sums equal its blocks' choices; with a `budget`, the
  memory rows (`budget.MemoryRow`).
  """
  import highspy  # pylint: disable=g-import-not-at-top
  rows, cols, vals, lo, hi = [], [], [], [], []
  r = 0
  for b, n in enumerate(model.sizes):   # one choice per block
    rows.append(np.full(n, r))
    cols.append(np.arange(start_col[b], start_col[b + 1]))
    vals.append(np.ones(n))
    lo.append(1.0)
    hi.append(1.0)
    r += 1
  for key, s in zip(pair_keys, pair_start[:-1]):
    u, v = key
    nu, nv = model.sizes[u], model.sizes[v]
    z = s + np.arange(nu * nv).reshape(nu, nv)
    for block, n, members in ((u, nu, z), (v, nv, z.T)):   # sum_j z[i, j] = y_u[i]; sum_i z[i, j] = y_v[j]
      rows.append(np.repeat(np.arange(r, r + n), members.shape[1]))
      cols.append(members.reshape(-1))
      vals.append(np.ones(members.size))
      rows.append(np.arange(r, r + n))
      cols.append(start_col[block] + np.arange(n))
      vals.append(-np.ones(n))
      lo += [0.0] * n
      hi += [0.0] * n
      r += n
  if budget is not None:
    for row in model.rows or [MemoryRow(None)]:
      for b in sorted(set(model.state) | set(row.terms)):
        mem = np.asarray(row.total(model.state, b), dtype=float)
        rows.append(np.full(len(mem), r))
        cols.append(np.arange(start_col[b], start_col[b + 1]))
        vals.append(mem)
      lo.append(-highspy.kHighsInf)
      hi.append(float(budget) - row.fixed)
      r += 1
  return rows, cols, vals, lo, hi, r


def _highs_lp(cost, rows, cols, vals, lo, hi, ncol, r, ny):
  """The HighsLp of the MILP: its matrix column-wise, the first `ny` columns (the choices) integral, the costs
  scaled near 1."""
  import highspy  # pylint: disable=g-import-not-at-top
  rows = np.concatenate(rows)
  cols = np.concatenate(cols)
  vals = np.concatenate(vals)
  order = np.lexsort((rows, cols))
  rows, cols, vals = rows[order], cols[order], vals[order]
  starts = np.searchsorted(cols, np.arange(ncol + 1))
  # Scale: bytes can be large; HiGHS prefers costs near 1.
  scale = max(1.0, float(np.abs(cost).max()))
  lp = highspy.HighsLp()
  lp.num_col_ = ncol
  lp.num_row_ = r
  lp.col_cost_ = cost / scale
  lp.col_lower_ = np.zeros(ncol)
  lp.col_upper_ = np.ones(ncol)
  lp.row_lower_ = np.array(lo)
  lp.row_upper_ = np.array(hi)
  lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
  lp.a_matrix_.start_ = starts.astype(np.int32)
  lp.a_matrix_.index_ = rows.astype(np.int32)
  lp.a_matrix_.value_ = vals
  lp.integrality_ = [highspy.HighsVarType.kInteger] * ny + [highspy.HighsVarType.kContinuous] * (ncol - ny)
  return lp


def evaluate(model, choice):
  """(weighted cost, bytes) of a full assignment."""
  cost = sum(float(model.linear[b][c]) for b, c in enumerate(choice))
  nbytes = sum(float(model.linear_bytes[b][c]) for b, c in enumerate(choice))
  for (u, v), (c, nb) in model.pairs.items():
    cost += float(c[choice[u], choice[v]])
    nbytes += float(nb[choice[u], choice[v]])
  return cost, nbytes


def local_delta(model, choice, b):
  """Objective per choice of block b with every other block as chosen."""
  out = model.linear[b].copy()
  for (u, v), (c, _) in model.pairs.items():
    if u == b:
      out = out + c[:, choice[v]]
    elif v == b:
      out = out + c[choice[u], :]
  return out


def fold(model, rounds=4):
  """Blocks of repeated layers merged: (folded model, block -> folded block).

  Blocks whose neighbourhoods look the same `rounds` edges deep (Weisfeiler-Lehman colours over what each
  block is, its costs and the cost matrices of its edges) take one shared choice; their costs are summed, and an
  edge between two blocks of one class becomes its diagonal. Twelve identical layers then cost one layer's
  program (Alpa reuses the solution of repeated layers the same way); a shared choice is always feasible.
  """
  n = len(model.sizes)

  def digest(a):
    return hash(np.round(np.asarray(a, dtype=float), 3).tobytes())

  first = model.rows[0] if model.rows else MemoryRow(None)
  color = [hash((model.signatures[b], model.sizes[b], digest(model.linear[b]), digest(model.linear_bytes[b]),
                 digest(first.total(model.state, b)) if b in model.state or b in first.terms else 0))
           for b in range(n)]
  nbrs = [[] for _ in range(n)]
  for (u, v), (c, nb) in model.pairs.items():
    h = hash((digest(c), digest(nb)))
    nbrs[u].append((0, v, h))
    nbrs[v].append((1, u, h))
  for _ in range(rounds):
    color = [hash((color[b], tuple(sorted((d, color[o], h) for d, o, h in nbrs[b])))) for b in range(n)]
  index = {}
  of = [index.setdefault(c, len(index)) for c in color]
  folded = Model()
  for k in range(len(index)):
    b = of.index(k)
    folded.block(model.sizes[b], model.labels[b], model.signatures[b])
  folded.rows = [row.folded(of) for row in model.rows]
  for b in range(n):
    folded.add_linear(of[b], model.linear[b], model.linear_bytes[b])
    if b in model.state:
      folded.state[of[b]] = folded.state.get(of[b], 0) + model.state[b]
  for (u, v), (c, nb) in model.pairs.items():
    folded.add_pair(of[u], of[v], c, nb)
  return folded, of
