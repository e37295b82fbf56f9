"""Starts one SPMD program as several processes on this machine: `python -m tf_gspmd.launch`.

  python -m tf_gspmd.launch --workers=2 --devices_per_worker=4 -- examples/train_transformer.py --steps=10

Each worker is the same command with its own `TF_CONFIG` (a cluster of `--workers` tasks of job "worker" on
127.0.0.1, free ports) and `TF_GSPMD_CPU_DEVICES_PER_PROCESS` (the logical CPUs `gs.initialize` gives it). The
workers' output is forwarded line by line, prefixed with `[worker K]`. The launcher exits with the first
failing worker's status (0 when all succeed); when one fails, the others are given `--grace` seconds to fail
on their own (their collectives name the lost worker) before they are stopped.

Several machines do not need this launcher: start the program on each with its TF_CONFIG (or under Slurm, with
`gs.initialize(tf.distribute.cluster_resolver.SlurmClusterResolver())`).
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tf_gspmd._platform.cluster import DEVICES_ENV


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


def launch(command, workers, devices_per_worker=None, grace=60.0, timeout=None, out=None):
  """Runs `command` (a list, e.g. [sys.executable, "train.py", ...]) as `workers` processes; returns the exit
  status (the first failing worker's, else 0).

  Every worker is polled every 0.1 s; once one fails, the others get `grace` seconds to exit before they are sent
  SIGTERM (and killed 10 s later)."""
  if int(workers) < 1:
    raise ValueError(f"workers={workers}: the launcher needs at least one worker process; pass --workers=1 or more")
  if grace < 0:
    raise ValueError(f"grace={grace}: give the seconds (0 or more) the other workers get after one fails")
  out = out or sys.stdout
  lock = threading.Lock()
  procs, threads = [], []
  for k, env in enumerate(worker_envs(workers, devices_per_worker)):
    p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    t = threading.Thread(target=_forward, args=(p.stdout, f"[worker {k}] ", out, lock), daemon=True)
    t.start()
    procs.append(p)
    threads.append(t)
  start = time.monotonic()
  status, failed_at = 0, None
  while True:
    codes = [p.poll() for p in procs]   # every worker, every round: a failure is seen wherever it happens
    now = time.monotonic()
    for k, code in enumerate(codes):
      if code not in (None, 0) and failed_at is None:
        status, failed_at = code, now
        with lock:
          out.write(f"[launch] worker {k} exited with status {code}; the others get {grace:g} s to finish\n")
    if all(code is not None for code in codes):
      break
    late = (failed_at is not None and now - failed_at > grace) or (timeout is not None and now - start > timeout)
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


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m tf_gspmd.launch", description=__doc__.splitlines()[0])
  parser.add_argument("--workers", type=int, required=True, help="number of processes")
  parser.add_argument("--devices_per_worker", type=int, default=None,
                      help="logical CPU devices per process (gs.initialize reads it)")
  parser.add_argument("--grace", type=float, default=60.0,
                      help="seconds the other workers get to fail on their own after one fails")
  parser.add_argument("--timeout", type=float, default=None, help="stop every worker after this many seconds")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program.py [flags] (a .py file runs with this "
                      "Python)")
  args = parser.parse_args(argv)
  if args.workers < 1:
    parser.error(f"--workers={args.workers}: give at least 1 worker process")
  if args.grace < 0:
    parser.error(f"--grace={args.grace:g}: give 0 or more seconds")
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the program after --")
  if command[0].endswith(".py"):
    command = [sys.executable] + command
  return launch(command, args.workers, args.devices_per_worker, args.grace, args.timeout)


if __name__ == "__main__":
  sys.exit(main())
