"""Starts one SPMD program as several processes on this machine: `python -m tf_gspmd.launch`.

  python -m tf_gspmd.launch --workers=2 --devices_per_worker=4 -- examples/train_transformer.py --steps=10

Each worker is the same command with its own `TF_CONFIG` (a cluster of `--workers` tasks of job "worker" on
127.0.0.1, free ports) and `TF_GSPMD_CPU_DEVICES_PER_PROCESS` (the logical CPUs `gs.initialize` gives it). The
workers' output is forwarded line by line, prefixed with `[worker K]`. The launcher exits with the first
failing worker's status (0 when all succeed); when one fails, the others are given `--grace` seconds to fail
on their own (their collectives name the lost worker) before they are stopped. With `--max_restarts=N` a failed
job is started again, up to N times, every worker anew (new ports, TF_GSPMD_RESTART=1, 2, ...): a program that
resumes from its last checkpoint (the training binaries' `--resume`) goes on from there.

The program after `--` is a Python script (`train.py ...`, run with this Python), Python code (`-c CODE ...`) or a
module (`-m MODULE ...`), as `python` takes them, or any other executable with its arguments. Every argument is
checked before any worker starts: a bad one is a usage error (exit status 2) naming the flag, its value and the fix.

Several machines do not need this launcher: start the program on each with its TF_CONFIG (or under Slurm, with
`gs.initialize(tf.distribute.cluster_resolver.SlurmClusterResolver())`).
"""

import argparse
import json
import math
import numbers
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from tf_gspmd._platform.cluster import DEVICES_ENV, EXITED_ENV
from tf_gspmd.errors import InputError, MeshError


def free_ports(n):
  """`n` distinct free TCP ports on 127.0.0.1."""
  socks, ports = [], []
  for _ in range(n):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
    ports.append(s.getsockname()[1])
  for s in socks:
    s.close()
  return ports


def worker_envs(workers, devices_per_worker=None, base=None):
  """One environment per worker: TF_CONFIG for a cluster of `workers` tasks on 127.0.0.1."""
  hosts = [f"127.0.0.1:{p}" for p in free_ports(workers)]
  envs = []
  for k in range(workers):
    env = dict(os.environ if base is None else base)
    env["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": k}})
    if devices_per_worker:
      env[DEVICES_ENV] = str(devices_per_worker)
    envs.append(env)
  return envs


def _forward(stream, prefix, out, lock):
  for line in iter(stream.readline, b""):
    with lock:
      out.write(prefix + line.decode(errors="replace"))
      out.flush()
  stream.close()


RESTART_ENV = "TF_GSPMD_RESTART"   # which start of the job a worker belongs to: 0, then 1, 2, ... after restarts


def launch(command, workers, devices_per_worker=None, grace=60.0, timeout=None, out=None, max_restarts=0):
  """Runs `command` (a list, e.g. [sys.executable, "train.py", ...]) as `workers` processes; returns the exit
  status (the first failing worker's, else 0).

  Every worker is polled every 0.1 s; once one fails, the others get `grace` seconds to exit before they are sent
  SIGTERM (and killed 10 s later). A failed job is started again, every worker with new ports, up to
  `max_restarts` times (the program resumes from its last checkpoint, e.g. the training binaries' --resume; each
  worker finds the start it belongs to in TF_GSPMD_RESTART). `timeout` bounds all starts together. Raises
  MeshError (worker or device counts) or InputError (times, restarts, the command) for an argument it cannot run
  with, before any worker starts."""
  command = checked_command(command)
  workers, devices_per_worker, grace, timeout, max_restarts = checked_numbers(workers, devices_per_worker, grace,
                                                                              timeout, max_restarts)
  out = out or sys.stdout
  lock = threading.Lock()
  deadline = None if timeout is None else time.monotonic() + timeout
  for start in range(int(max_restarts) + 1):
    status = _run(command, workers, devices_per_worker, grace, deadline, out, lock, start)
    if status == 0 or start == max_restarts or (deadline is not None and time.monotonic() >= deadline):
      return status
    with lock:
      out.write(f"[launch] the job failed with status {status}; starting it again ({start + 1} of {max_restarts} "
                "restarts), every worker with new ports\n")
  return status


def _run(command, workers, devices_per_worker, grace, deadline, out, lock, start_index):
  """One start of the job: its status (the first failing worker's, else 0). Each failed worker is written to the
  file the workers find in EXITED_ENV, so that those still waiting for it to join stop at once, naming it."""
  handle, exited = tempfile.mkstemp(prefix="tf_gspmd_exited_")
  os.close(handle)
  try:
    return _run_workers(command, workers, devices_per_worker, grace, deadline, out, lock, start_index, exited)
  finally:
    os.remove(exited)


def _run_workers(command, workers, devices_per_worker, grace, deadline, out, lock, start_index, exited):
  procs, threads = [], []
  for k, env in enumerate(worker_envs(workers, devices_per_worker)):
    env[RESTART_ENV] = str(start_index)
    env[EXITED_ENV] = exited
    p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    t = threading.Thread(target=_forward, args=(p.stdout, f"[worker {k}] ", out, lock), daemon=True)
    t.start()
    procs.append(p)
    threads.append(t)
  status, failed_at, reported = 0, None, set()
  while True:
    codes = [p.poll() for p in procs]   # every worker, every round: a failure is seen wherever it happens
    now = time.monotonic()
    for k, code in enumerate(codes):
      if code not in (None, 0) and k not in reported:
        reported.add(k)
        with open(exited, "a") as f:
          f.write(f"{k} {code}\n")
      if code not in (None, 0) and failed_at is None:
        status, failed_at = code, now
        with lock:
          out.write(f"[launch] worker {k} exited with status {code}; the others get {grace:g} s to finish\n")
    if all(code is not None for code in codes):
      break
    late = (failed_at is not None and now - failed_at > grace) or (deadline is not None and now > deadline)
    if late:
      for k, p in enumerate(procs):
        if p.poll() is None:
          with lock:
            out.write(f"[launch] stopping worker {k}\n")
          p.send_signal(signal.SIGTERM)
      break
    time.sleep(0.1)
  for p in procs:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
  for t in threads:
    t.join(timeout=5)
  for k, p in enumerate(procs):
    if status == 0 and p.returncode != 0:
      status = p.returncode if p.returncode > 0 else 128 - p.returncode
      with lock:
        out.write(f"[launch] worker {k} exited with status {p.returncode}\n")
  return status if status >= 0 else 128 - status


def _shown(value):
  return f"{value:g}" if isinstance(value, float) else repr(value) if isinstance(value, str) else str(value)


def checked_numbers(workers, devices_per_worker, grace, timeout, max_restarts=0, dashes=""):
  """(workers, devices_per_worker, grace, timeout, max_restarts), checked before anything starts. A count below 1
  would start no worker, or workers whose `gs.initialize` splits the CPU into no device (they then wait for each
  other until the join times out); a negative or NaN time would stop the workers at once, or never; a negative
  restart count would not run the job at all. Raises MeshError (counts) or InputError (times, restarts), naming the
  argument -- as the command-line flag when `dashes` is "--"."""
  def whole(value):
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)

  def seconds(value):
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)

  if not whole(workers) or workers < 1:
    raise MeshError(f"{dashes}workers={_shown(workers)}: the launcher needs at least one worker process; give at "
                    f"least 1 (e.g. {dashes}workers=2)", node=f"{dashes}workers")
  if devices_per_worker is not None and (not whole(devices_per_worker) or devices_per_worker < 1):
    raise MeshError(f"{dashes}devices_per_worker={_shown(devices_per_worker)}: each worker needs at least 1 logical "
                    f"CPU device; give a whole number of 1 or more (e.g. {dashes}devices_per_worker=4), or leave it "
                    "out to keep the devices TensorFlow finds", node=f"{dashes}devices_per_worker")
  if not seconds(grace) or grace < 0:
    raise InputError(f"{dashes}grace={_shown(grace)}: give the seconds (0 or more) the other workers get to finish "
                     f"on their own after one fails (e.g. {dashes}grace=60)", node=f"{dashes}grace")
  if timeout is not None and (not seconds(timeout) or timeout <= 0):
    raise InputError(f"{dashes}timeout={_shown(timeout)}: give the seconds (more than 0) after which every worker "
                     "is stopped, or leave it out for no limit", node=f"{dashes}timeout")
  if not whole(max_restarts) or max_restarts < 0:
    raise InputError(f"{dashes}max_restarts={_shown(max_restarts)}: give how many times (0 or more) a failed job is "
                     "started again", node=f"{dashes}max_restarts")
  return int(workers), None if devices_per_worker is None else int(devices_per_worker), float(grace), \
      None if timeout is None else float(timeout), int(max_restarts)


def checked_command(command):
  """`command` as a list of strings whose program exists (InputError otherwise: Popen would raise
  FileNotFoundError in the middle of starting the workers)."""
  if isinstance(command, str) or not isinstance(command, (list, tuple)) or not command or \
      not all(isinstance(a, str) for a in command):
    raise InputError(f"command={command!r}: give the program and its arguments as a list of strings, e.g. "
                     "[sys.executable, 'train.py', '--steps=10']", node="command")
  if shutil.which(command[0]) is None:
    raise InputError(f"the program {command[0]!r} is not an executable file nor on PATH; give a path to it (or, "
                     "on the command line, a script.py, -c CODE or -m MODULE)", node="command")
  return list(command)


def python_command(command):
  """The argv that runs the program given after `--`: a Python script, `-c CODE` or `-m MODULE` with this Python,
  else the executable as it is. Raises InputError, naming what is missing, for anything that cannot start."""
  first = command[0]
  if first in ("-c", "-m"):
    if len(command) < 2:
      what = "the code" if first == "-c" else "the module's name"
      raise InputError(f"{first} needs {what} after it, as for python (e.g. -- -c \"print(1)\" or -- -m "
                       "package.train)", node=first)
    return [sys.executable] + list(command)
  if first.startswith("-"):
    raise InputError(f"{first!r} is an option, not a program: after -- give a script path (train.py), -c CODE, "
                     "-m MODULE, or an executable", node="command")
  if first.endswith(".py"):
    if not os.path.isfile(first):
      raise InputError(f"the script {first!r} does not exist (looked for it from {os.getcwd()}); give the path of "
                       "a Python file", node="command")
    return [sys.executable] + list(command)
  return checked_command(command)


_PROGRAMS = """program (after --), as python takes it:
  script.py [ARGS]     a Python script, run with this Python
  -c CODE [ARGS]       Python code (python -c CODE)
  -m MODULE [ARGS]     a module (python -m MODULE)
  PROGRAM [ARGS]       any other executable (a path, or a name on PATH)

Every argument is checked before any worker starts; a bad one is a usage error (exit status 2)."""


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m tf_gspmd.launch", description=__doc__.splitlines()[0],
                                   epilog=_PROGRAMS, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workers", type=int, required=True, help="number of processes (1 or more)")
  parser.add_argument("--devices_per_worker", type=int, default=None,
                      help="logical CPU devices per process, 1 or more (gs.initialize reads it)")
  parser.add_argument("--grace", type=float, default=60.0,
                      help="seconds (0 or more) the other workers get to fail on their own after one fails")
  parser.add_argument("--timeout", type=float, default=None,
                      help="stop every worker after this many seconds (more than 0; default: no limit)")
  parser.add_argument("--max_restarts", type=int, default=0,
                      help="start a failed job again, every worker anew, up to this many times (0 or more); the "
                           "program resumes from its last checkpoint (the training binaries: --resume)")
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="-- then the program and its arguments: script.py, -c CODE, -m MODULE or an executable")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  try:
    *numbers_, restarts = checked_numbers(args.workers, args.devices_per_worker, args.grace, args.timeout,
                                          args.max_restarts, dashes="--")
    if not command:
      raise InputError("give the program after --, e.g. -- train.py --steps=10", node="command")
    command = python_command(command)
  except (InputError, MeshError) as e:
    parser.error(e.message)
  return launch(command, *numbers_, max_restarts=restarts)


if __name__ == "__main__":
  sys.exit(main())
