"""XLA's own SPMD partitioner as the oracle for tf_gspmd's: one annotated program, partitioned both ways.

  python tools/xla_oracle.py                          # every program of tools/oracle_programs.py (18)
  python tools/xla_oracle.py --only=mlp_megatron,pipeline --verbose
  python tools/xla_oracle.py --keep=/tmp/oracle       # keep the exported and the partitioned HLO there

From Python (tools/ on sys.path):

  import xla_oracle as oracle
  c = oracle.compare(fn, args, specs, mesh, out_specs=None)   # numpy args laid out as specs on mesh
  print(c); c.xla_bytes, c.ours_bytes, c.xla_ok, c.ours_ok

For each program: `gs.function(fn, ..., partitioner="xla")` exports the program after completion, every
layout as XLA sharding, to HLO; in a separate Python (the oracle's virtualenv, `make oracle-venv`: jax[cpu]
0.10.2; the project never imports jax) XLA partitions that HLO for the mesh's devices among 8 host CPU devices and
runs it on inputs laid out as the arguments' layouts say (tools/xla_partition.py). XLA's collectives are read from
its module right after `spmd-partitioning`, before CPU passes change them (there a reduce-scatter is still an
all-reduce and a dynamic-slice, which GPU and TPU passes turn into a reduce-scatter of the same operand: the same
bytes below). tf_gspmd partitions and runs the same gs.function on the 8 logical CPUs. Printed side by side: the
collectives and bytes per device of each, and whether each one's results equal the unpartitioned TF program's
(|got - want| <= 1e-4 + 1e-4 |want| elementwise, captured variables' new values included). Where the two differ
for a known reason (oracle_programs.KNOWN_DIFFERENCES) it is said. The last line: `oracle: N programs, results match
on N, tf_gspmd bytes <= XLA on M`; the exit status is 1 when a result differs for no known reason.

Bytes per device, for both: what one device sends per step -- the per-device result of an all-gather, the per-device
operand of an all-reduce, all-to-all, collective-permute or reduce-scatter (docs/inspecting.md "Reading a plan and a
report", rewriter/report.py); the device that sends the most; a collective in a loop once per iteration. tf_gspmd's
is `report.bytes_per_device()` (the ops its program emits). XLA's is the same count over the partitioned module's
collectives (tools/xla_partition.py).
"""

import collections
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_gspmd as gs  # noqa: E402
from tf_gspmd.rewriter.graph import loops  # noqa: E402
from tf_gspmd.rewriter.backend import xla_export

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle_programs  # noqa: E402  pylint: disable=g-import-not-at-top

ROOT = oracle_programs.ROOT
WORKER = os.path.join(ROOT, "tools", "xla_partition.py")
RTOL = ATOL = 1e-4


class OracleUnavailable(RuntimeError):
  """The oracle's virtualenv (jax[cpu]) is missing: `make oracle-venv` creates it."""


def oracle_python():
  """The Python of the oracle's virtualenv: $TF_GSPMD_ORACLE_PYTHON, else .venv-oracle/bin/python."""
  path = os.environ.get("TF_GSPMD_ORACLE_PYTHON", os.path.join(ROOT, ".venv-oracle", "bin", "python"))
  if not os.path.exists(path):
    raise OracleUnavailable(f"no oracle Python at {path}: run `make oracle-venv` (a virtualenv with "
                            "jax[cpu]==0.10.2) or set TF_GSPMD_ORACLE_PYTHON")
  return path


@dataclasses.dataclass
class Comparison:
  """One program partitioned by XLA and by tf_gspmd, each against the unpartitioned program."""

  name: str
  mesh: Any
  xla_collectives: List[dict] = dataclasses.field(default_factory=list)
  xla_bytes: Optional[int] = None
  # per result, then per captured variable's new value: max |got - want| / (ATOL + RTOL |want|), <= 1 matches
  xla_errors: tuple = ()
  ours: Any = None                       # tf_gspmd's report
  ours_bytes: Optional[int] = None
  ours_errors: tuple = ()
  unknown_loops: tuple = ()
  failure: Optional[str] = None          # why XLA (or tf_gspmd) did not give a result

  @property
  def xla_error(self):
    return max(self.xla_errors) if self.xla_errors else (None if self.failure else 0.0)

  @property
  def ours_error(self):
    return max(self.ours_errors) if self.ours_errors else (None if self.failure else 0.0)

  @property
  def xla_ok(self):
    return self.xla_error is not None and self.xla_error <= 1.0

  @property
  def ours_ok(self):
    return self.ours_error is not None and self.ours_error <= 1.0

  @property
  def ok(self):
    return self.xla_ok and self.ours_ok

  @property
  def ours_at_most_xla(self):
    return self.xla_bytes is not None and self.ours_bytes is not None and self.ours_bytes <= self.xla_bytes

  def xla_counts(self):
    runs = collections.Counter()
    for c in self.xla_collectives:
      runs[c["kind"]] += c["times"]
    return dict(runs)

  def xla_lines(self):
    """XLA's collectives, one line each: kind, dtype and per-device shape, mesh axes, runs per step, bytes."""
    lines = []
    for c in self.xla_collectives:
      shape = ";".join(f"{c['dtype']}[{','.join(map(str, s))}]" for s in c["shape"])
      times = f" x {c['times']}" if c["times"] != 1 else ""
      lines.append(f"{c['kind']} {shape} over {axes_of(c, self.mesh)}{times}, {c['bytes']:,} B/device "
                   f"({c['op_name'] or c['name']})")
    return lines

  def __str__(self):
    head = (f"{self.name} on {self.mesh}: XLA {_counts_text(self.xla_counts())}, {_num(self.xla_bytes)} B/device, "
            f"results {_verdict(self.xla_error)}; tf_gspmd "
            f"{_counts_text(self.ours.counts() if self.ours else {})}, {_num(self.ours_bytes)} B/device, results "
            f"{_verdict(self.ours_error)}")
    lines = [head] + (["  failure: " + self.failure] if self.failure else [])
    lines += ["  XLA:      " + x for x in self.xla_lines()]
    if self.unknown_loops:
      lines.append(f"  XLA loops of unknown trip count (counted once): {', '.join(self.unknown_loops)}")
    lines += ["  tf_gspmd: " + str(c) for c in (self.ours.collectives if self.ours else ())]
    return "\n".join(lines)


def _num(x):
  return "?" if x is None else f"{x:,}"


def _verdict(err):
  return "?" if err is None else ("match" if err <= 1.0 else f"DIFFER ({err:.1f}x tolerance)")


def _counts_text(counts):
  return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no collectives"


def axes_of(c, mesh):
  """The mesh axes a collective's groups (or a permute's pairs) span, e.g. "model" or "data,model"."""
  n = mesh.size
  ids = np.arange(n).reshape(mesh.shape)
  if c["pairs"] is not None:
    coords = [np.unravel_index(k, mesh.shape) for k in range(n)]
    moved = {mesh.axis_names[a] for s, t in c["pairs"] for a in range(mesh.ndim) if coords[s][a] != coords[t][a]}
    return ",".join(a for a in mesh.axis_names if a in moved) or "-"
  want = sorted(sorted(g) for g in c["groups"])
  for r in range(mesh.ndim + 1):
    for axes in itertools.combinations(range(mesh.ndim), r):
      rest = [k for k in range(mesh.ndim) if k not in axes]
      size = int(np.prod([mesh.shape[k] for k in axes]))
      groups = sorted(sorted(g) for g in np.transpose(ids, rest + list(axes)).reshape(-1, size).tolist())
      if groups == want:
        return ",".join(mesh.axis_names[k] for k in axes) or "-"
  return "groups " + str(c["groups"])


def _mismatch(got, want):
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape:
    return float("inf")
  if got.size == 0:
    return 0.0
  if not np.issubdtype(want.dtype, np.floating):
    return 0.0 if np.array_equal(got, want) else float("inf")
  want = want.astype(np.float64)
  return float(np.max(np.abs(got.astype(np.float64) - want) / (ATOL + RTOL * np.abs(want))))


def _flat(values):
  return [np.asarray(v.numpy() if hasattr(v, "numpy") else v) for v in tf.nest.flatten(values) if v is not None]


@dataclasses.dataclass
class _Prepared:
  """What the TF side knows of one program before XLA runs it."""

  job: Any
  comparison: Comparison
  expected: list                   # the unpartitioned results, flat
  variables: list                  # the captured tf.Variables, in the exported module's parameter order
  expected_variables: list         # their values after the unpartitioned step
  n_args: int
  aliases: dict                    # exported module output index -> parameter index (a variable's new value)


def _restore(variables, values):
  for v, x in zip(variables, values):
    v.assign(x)


def _prepare(job, directory):
  """Exports `job` with partitioner="xla" (HLO and inputs into `directory`), runs it unpartitioned and with
  tf_gspmd's partitioner, and returns what the comparison needs once XLA has run."""
  specs = [tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in job.args]
  comparison = Comparison(job.name, job.mesh)
  low = gs.function(job.fn, mesh=job.mesh, in_shardings=job.in_specs, out_shardings=job.out_specs,
                    partitioner="xla").lower(*specs)
  exported = low.exported
  cf = exported.concrete_function()
  by_handle = {id(v.handle): v for v in exported.variables if v is not None}
  variables = [by_handle[id(t)] for t in cf.captured_inputs if id(t) in by_handle]
  start = [v.numpy() for v in variables]
  hlo = low.xla_hlo()
  entry = hlo[hlo.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  if entry.count(" parameter(") != len(job.args) + len(variables):
    raise RuntimeError(f"{job.name}: the exported module has {entry.count(' parameter(')} parameters, expected "
                       f"{len(job.args)} arguments and {len(variables)} variables")
  aliases = {int(o): int(p) for o, p in re.findall(r"\{(\d+)\}: \((\d+), \{\}", hlo.split("\n", 1)[0])}
  with open(os.path.join(directory, job.name + ".hlo.pb"), "wb") as f:
    f.write(low.xla_hlo("hlo_serialized"))
  with open(os.path.join(directory, job.name + ".hlo.txt"), "w") as f:
    f.write(hlo)
  np.savez(os.path.join(directory, job.name + ".inputs.npz"), *[np.asarray(a) for a in job.args], *start)
  ir = low.program.ir
  trips = {f"{xla_export.SCOPE}/{n.name}": loops.trip_count(ir, n.name)[0] for n in ir.nodes if n.op in loops.WHILE_OPS}

  expected = _flat(tf.function(job.fn)(*[tf.constant(a) for a in job.args]))
  expected_variables = [v.numpy() for v in variables]
  _restore(variables, start)
  try:
    ours = gs.function(job.fn, mesh=job.mesh, in_shardings=job.in_specs, out_shardings=job.out_specs)
    got = _flat(ours(*job.args))
    errors = [_mismatch(g, w) for g, w in zip(got, expected)] + [
        _mismatch(v.numpy(), w) for v, w in zip(variables, expected_variables)]
    comparison.ours_errors = tuple(errors) if len(got) == len(expected) else (float("inf"),)
    comparison.ours = ours.lower(*specs).report
    comparison.ours_bytes = comparison.ours.bytes_per_device()
  except Exception as e:  # pylint: disable=broad-except
    comparison.failure = f"tf_gspmd: {type(e).__name__}: {str(e)[:500]}"
  finally:
    _restore(variables, start)
  # the entry's layouts: the arguments' and the results', a variable's (its handle's) for its read and new value
  program = low.program
  handle = {id(v): name for v, name in zip(exported.variables, exported.variable_inputs)}
  params = list(program.param_shardings) + [program.shardings.get(f"{handle[id(v)]}:0") for v in variables]
  results = list(program.output_shardings) + [params[aliases[k]] if k in aliases else None for k in range(
      len(program.output_shardings), len(program.output_shardings) + len(aliases))]
  text = lambda s: None if s is None else xla_export.hlo_sharding_text(s)  # noqa: E731
  spec = {"name": job.name, "devices": job.mesh.size, "loop_trips": {k: v for k, v in trips.items() if v is not None},
          "arg_shardings": [text(s) for s in params], "result_shardings": [text(s) for s in results]}
  return spec, _Prepared(job, comparison, expected, variables, expected_variables, len(job.args), aliases)


def _finish(prepared, directory):
  """Reads XLA's result for one program into its Comparison."""
  c, name = prepared.comparison, prepared.job.name
  record = json.load(open(os.path.join(directory, name + ".result.json")))
  if not record["ok"]:
    c.failure = (c.failure + "; " if c.failure else "") + "XLA: " + record["error"]
    return c
  c.xla_collectives = record["collectives"]
  c.unknown_loops = tuple(record["unknown_loops"])
  per_device = np.zeros(prepared.job.mesh.size, np.int64)
  for coll in c.xla_collectives:
    per_device += np.asarray(coll["device_bytes"], np.int64) * coll["times"]
  c.xla_bytes = int(per_device.max()) if c.xla_collectives else 0
  outputs = np.load(os.path.join(directory, name + ".outputs.npz"))
  got = [outputs[f"arr_{k}"] for k in range(len(outputs.files))]
  n = len(prepared.expected)
  errors = [_mismatch(g, w) for g, w in zip(got[:n], prepared.expected)]
  for k, value in enumerate(got[n:], start=n):
    p = prepared.aliases.get(k)
    if p is None or p < prepared.n_args:
      errors.append(float("inf"))
      continue
    errors.append(_mismatch(value, prepared.expected_variables[p - prepared.n_args]))
  c.xla_errors = tuple(errors) if len(got) >= n else (float("inf"),)
  return c


def compare_all(jobs, keep=None, log=None):
  """[Comparison] of `jobs` (oracle_programs.Job), XLA's side in one run of the oracle's Python; the exported and
  partitioned modules are kept in directory `keep` (else removed)."""
  if keep is None:
    with tempfile.TemporaryDirectory(prefix="xla_oracle_") as directory:
      return compare_all(jobs, keep=directory, log=log)
  python = oracle_python()
  directory = keep
  os.makedirs(directory, exist_ok=True)
  for job in jobs:
    if os.path.exists(os.path.join(directory, job.name + ".result.json")):
      os.remove(os.path.join(directory, job.name + ".result.json"))
  specs, prepared = [], []
  failed = {}
  for job in jobs:
    if log:
      log(f"exporting and partitioning {job.name} ...")
    try:
      spec, p = _prepare(job, directory)
    except Exception as e:  # pylint: disable=broad-except
      failed[job.name] = Comparison(job.name, job.mesh, failure=f"export: {type(e).__name__}: {str(e)[:800]}")
      continue
    specs.append(spec)
    prepared.append(p)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  pending = list(specs)
  while pending:   # one run of the oracle's Python for them all; after a crash, again for those left
    with open(os.path.join(directory, "manifest.json"), "w") as f:
      json.dump({"programs": pending}, f)
    done = subprocess.run([python, WORKER, directory], env=env, capture_output=True, text=True, check=False)
    left = [s for s in pending if not os.path.exists(os.path.join(directory, s["name"] + ".result.json"))]
    if left and done.returncode:
      with open(os.path.join(directory, left[0]["name"] + ".result.json"), "w") as f:
        json.dump({"ok": False, "error": f"the XLA side crashed ({done.returncode}): {done.stderr[-600:]}"}, f)
      left = left[1:]
    elif left:
      raise RuntimeError(f"{WORKER} gave no result for {[s['name'] for s in left]}:\n{done.stderr[-3000:]}")
    pending = left
  finished = {p.job.name: _finish(p, directory) for p in prepared}
  return [failed.get(job.name) or finished[job.name] for job in jobs]


def compare(fn, args, specs, mesh, out_specs=None, name="program", keep=None):
  """One gs.function's program, partitioned by XLA and by tf_gspmd (see the module docstring): a Comparison."""
  job = oracle_programs.Job(name, fn, list(args), specs, mesh, out_specs)
  return compare_all([job], keep=keep)[0]


def _ratio(c):
  """tf_gspmd's bytes per device over XLA's."""
  if c.ours_bytes is None or c.xla_bytes is None:
    return "?"
  if not c.xla_bytes:
    return "-" if not c.ours_bytes else "inf"
  return f"{c.ours_bytes / c.xla_bytes:.2f}"


def table(comparisons):
  """The side-by-side table and the closing line."""
  head = ("program", "mesh", "XLA collectives", "XLA B/device", "tf_gspmd collectives", "tf_gspmd B/device",
          "ratio", "XLA result", "tf_gspmd result")
  rows = []
  for c in comparisons:
    rows.append((c.name, "x".join(map(str, c.mesh.shape)), _counts_text(c.xla_counts()), _num(c.xla_bytes),
                 _counts_text(c.ours.counts() if c.ours else {}), _num(c.ours_bytes), _ratio(c),
                 _verdict(c.xla_error), _verdict(c.ours_error)))
  widths = [max(len(x) for x in col) for col in zip(head, *rows)]
  lines = ["| " + " | ".join(x.ljust(w) for x, w in zip(row, widths)) + " |" for row in [head] + rows]
  lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
  match = sum(c.ok for c in comparisons)
  fewer = sum(c.ours_at_most_xla for c in comparisons)
  xla_wrong = sum(c.ours_ok and not c.xla_ok for c in comparisons)
  lines.append(f"oracle: {len(comparisons)} programs, results match on {match}, tf_gspmd bytes <= XLA on {fewer}, "
               f"{xla_wrong} where XLA's own result is wrong")
  return "\n".join(lines)


def main(argv):
  import argparse  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--only", default="", help="comma-separated program names (default: all): "
                      + ", ".join(oracle_programs.PROGRAMS))
  parser.add_argument("--verbose", action="store_true", help="every collective of both partitions")
  parser.add_argument("--keep", default=None, help="directory to keep the exported and partitioned HLO in")
  flags = parser.parse_args(argv)
  names = [n for n in flags.only.split(",") if n] or list(oracle_programs.PROGRAMS)
  unknown = [n for n in names if n not in oracle_programs.PROGRAMS]
  if unknown:
    parser.error(f"unknown programs {unknown}; known: {list(oracle_programs.PROGRAMS)}")
  gs.split_cpu_devices(8)
  jobs = [oracle_programs.PROGRAMS[n]() for n in names]
  comparisons = compare_all(jobs, keep=flags.keep, log=lambda m: print(m, file=sys.stderr, flush=True))
  for c in comparisons:
    if flags.verbose or c.failure or not c.ok or not c.ours_at_most_xla:
      print(c)
      print()
  for c in comparisons:
    if c.name in oracle_programs.KNOWN_DIFFERENCES:
      print(f"known difference, {c.name}: {oracle_programs.KNOWN_DIFFERENCES[c.name]}")
  print(table(comparisons))
  unexpected = [c.name for c in comparisons if not c.ok and c.name not in oracle_programs.KNOWN_DIFFERENCES]
  return 1 if unexpected else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
