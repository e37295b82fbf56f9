"""Runs a program of tests/cluster_programs/ as several processes on 127.0.0.1 (`python -m tf_gspmd.launch`) and
collects the JSON line each process prints after "RESULT ". Shared by the multi-process tests."""

import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PROGRAMS = os.path.join(os.path.dirname(__file__), "cluster_programs")


def env():
  path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
  return dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")


def launch(workers, program, *args, timeout=300, devices_per_worker=None, exchange="auto", launcher=(), output=None):
  """{process index: its RESULT record} of `program` run by `workers` processes; asserts every one succeeded.
  `exchange="collectives"`: its gs.functions left at exchange "auto" run TF's collectives on every device;
  `launcher`: more options of the launcher (`--max_restarts=N`, `--grace=S`); `output`: a list the launcher's
  whole output is appended to (for a test's messages)."""
  per = [f"--devices_per_worker={devices_per_worker}"] if devices_per_worker else []
  forced = [os.path.join(PROGRAMS, "with_collectives.py")] if exchange == "collectives" else []
  out = subprocess.run([sys.executable, "-m", "tf_gspmd.launch", f"--workers={workers}", *per, *launcher, "--", *forced,
                        os.path.join(PROGRAMS, program), *args], capture_output=True, text=True, timeout=timeout,
                       env=env(), cwd=ROOT, check=False)
  if output is not None:
    output.append(out.stdout)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
  results = {}
  for line in out.stdout.splitlines():
    if "RESULT " in line:
      r = json.loads(line.split("RESULT ", 1)[1])
      results[r["process"]] = r
  assert sorted(results) == list(range(workers)), out.stdout[-4000:]
  return results
