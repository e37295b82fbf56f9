"""Running cases and comparing them: `run_batch` runs a batch of cases in one gs.function and checks each
case's results against its own eager, unpartitioned run.
"""

import re

import numpy as np
import tensorflow as tf

from conftest import random_ops_made_whole
import tf_gspmd as gs
from differential.cases import MESHES, _tolerance
from tf_gspmd._layout.sharding import Sharding


def _valid_block(sharding, shape, position):
  """Slices of the global value held (unpadded) by the device at `position`, and its valid local extent."""
  local = sharding.shard_shape(shape)
  glob, loc = [], []
  for d, (n, c) in enumerate(zip(shape, local)):
    i = sharding.tile_index(position, d)
    lo, hi = min(i * c, n), min((i + 1) * c, n)
    glob.append(slice(lo, hi))
    loc.append(slice(0, hi - lo))
  return tuple(glob), tuple(loc)


def _compare(got, want, out, what):
  """None if `got` matches `want` (exactly for int and bool, else within `_tolerance`), else why not."""
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape:
    return f"{what}: shape {got.shape} != {want.shape}"
  if out.kind != "f":
    bad = got != want
    return f"{what}: {int(bad.sum())} element(s) differ (exact dtype)" if bad.any() else None
  atol, rtol = _tolerance(out)
  diff = np.abs(got.astype(np.float64) - want)
  bad = ~(diff <= atol + rtol * np.abs(want))
  if bad.any():
    return (f"{what}: {int(bad.sum())} element(s) off, worst |diff| {float(np.nanmax(diff)):.3g} "
            f"(atol {atol:.3g}, rtol {rtol:.3g})")
  return None


def _compile(case):
  namespace = {"tf": tf}
  exec(compile(case.source, f"<case {case.index}>", "exec"), namespace)  # pylint: disable=exec-used
  return namespace["fn"]


def _check_case(case, fn, args, got, low, in_offset, out_offset):
  """Problems of one case within its batch's results: [] when it agrees with its unpartitioned run."""
  mesh = MESHES[case.mesh_key]
  problems = []
  expected = [np.asarray(e) for e in fn(*[tf.constant(a) for a in args])]
  assert [e.shape for e in expected] == [o.shape for o in case.outs], "generator shape bookkeeping is off"
  for k, (spec, a) in enumerate(zip(case.in_specs, case.args)):
    if spec is not None:
      lowered = low.in_shardings[in_offset + k].with_rank(len(a.shape))
      if lowered != Sharding.from_spec(mesh, spec, len(a.shape)):
        problems.append(f"argument {k}: declared {spec}, lowered as {lowered}")
  for k, (want, out) in enumerate(zip(expected, case.outs)):
    value = got[out_offset + k]
    shape = want.shape
    problem = _compare(value.numpy(), want, out, f"output {k} global value")
    if problem:
      problems.append(problem)
      continue
    sharding = value.sharding
    if case.out_specs is not None and case.out_specs[k] is not None:
      if sharding.with_rank(len(shape)) != Sharding.from_spec(mesh, case.out_specs[k], len(shape)):
        problems.append(f"output {k}: declared {case.out_specs[k]}, got {sharding}")
    if sharding.is_maximal:
      problem = _compare(value.components[sharding.maximal].numpy(), want, out, f"output {k} maximal component")
      if problem:
        problems.append(problem)
      continue
    sharding = sharding.with_rank(len(shape))
    local = sharding.shard_shape(shape)
    shapes = [tuple(c.shape) for c in value.components]
    if shapes != [local] * mesh.size:
      problems.append(f"output {k} ({sharding}): component shapes {shapes}, want {local}")
      continue
    for p, comp in enumerate(value.components):
      glob, loc = _valid_block(sharding, shape, p)
      problem = _compare(comp.numpy()[loc], want[glob], out, f"output {k} ({sharding}), component on device {p}")
      if problem:
        problems.append(problem)
        break
  return problems


_CASE_OF = re.compile(r"(?:^|/)c(\d+)/")


def run_batch(cases):
  """Runs `cases` (one mesh) side by side in one gs.function; returns ({case index: problems}, the report)."""
  mesh = MESHES[cases[0].mesh_key]
  fns = [_compile(c) for c in cases]

  def program(*flat):
    outs, offset = [], 0
    for c, fn in zip(cases, fns):
      with tf.name_scope(f"c{c.index}"):
        outs.extend(fn(*flat[offset:offset + len(c.args)]))
      offset += len(c.args)
    return tuple(outs)

  in_specs = tuple(s for c in cases for s in c.in_specs)
  out_specs = tuple(s for c in cases for s in (c.out_specs or (None,) * len(c.outs)))
  args = []
  for c in cases:
    rng = np.random.default_rng(c.seed)
    args.append([a.value(rng) for a in c.args])
  f = gs.function(tf.function(program, autograph=False), mesh=mesh, in_shardings=in_specs, out_shardings=out_specs)
  got = f(*[a for per_case in args for a in per_case])
  got = list(got) if isinstance(got, (tuple, list)) else [got]
  low = f.lower(*[tf.TensorSpec(a.shape, a.dtype) for c in cases for a in c.args])
  problems, in_offset, out_offset = {}, 0, 0
  for c, fn, a in zip(cases, fns, args):
    found = _check_case(c, fn, a, got, low, in_offset, out_offset)
    if found:
      problems[c.index] = found
    in_offset += len(c.args)
    out_offset += len(c.outs)
  _, whole = random_ops_made_whole(low)
  for c in cases:   # a split random value drawn at its global size on a device (sliced after): not scale-true
    if whole and "stateless_dropout" in c.source:
      problems.setdefault(c.index, []).append(f"random values of {whole} elements drawn whole on a device")
  return problems, low.report


def _culprit(cases):
  """The first case that fails on its own (a batch raised): (case, exception)."""
  for c in cases:
    try:
      run_batch([c])
    except Exception as e:  # pylint: disable=broad-except
      return c, e
  return None, None
