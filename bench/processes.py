"""Step time and traffic across processes: one process x 8 CPUs vs 2 x 4 vs 4 x 2, same program, same mesh.

Runs the training binary `examples/train_transformer.py` (decoder LM, Megatron on (2,4): heads and MLP hidden
over `model`, batch over `data`) for --steps steps in one process -- as the one in-process graph (exchange
"auto") and through TF's collectives (--exchange=collectives: each device's program on its own thread, the
runtime of GPUs) -- then under `python -m tf_gspmd.launch` as 2 and 4 worker processes on 127.0.0.1 (each runs
its devices as one graph, with TF's gRPC collectives across processes), and prints per configuration: the runtime
that ran it, the median step time after warm-up, its ratio to one process (in-process, and through TF's
collectives), the bytes per device a step sends and how many of them cross process boundaries, and whether the
losses equal the one-process losses (relative 1e-5).

  python bench/processes.py [--steps=20] [--binary_flags=--layers=2,--d_model=64]
"""

import os
import re
import statistics
import subprocess
import sys

from absl import app
from absl import flags

flags.DEFINE_integer("steps", 20, "Steps per configuration (the first 3 are warm-up).")
flags.DEFINE_list("binary_flags", [], "Extra flags for examples/train_transformer.py.")
flags.DEFINE_list("workers", ["1", "2", "4"], "Process counts to compare (each divides the mesh's 8 devices).")
FLAGS = flags.FLAGS
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _run(workers, logdir, extra=()):
  binary = [os.path.join(ROOT, "examples", "train_transformer.py"), f"--steps={FLAGS.steps}", "--check_steps=0",
            "--ckpt_every=0", f"--logdir={logdir}", *FLAGS.binary_flags, *extra]
  command = [sys.executable] + (binary if workers == 1 else ["-m", "tf_gspmd.launch", f"--workers={workers}", "--",
                                                            *binary])
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONUNBUFFERED="1")
  out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
  if out.returncode:
    raise SystemExit(f"{workers} process(es) failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
  prefix = "" if workers == 1 else r"\[worker 0\] "
  steps = re.findall(rf"^{prefix}step (\d+) loss ([0-9.eE+-]+) time (\d+) ms", out.stdout, re.M)
  per_step = re.search(rf"^{prefix}collectives per step: .*?, ([\d,]+) B/device(?:, ([\d,]+) B/device across)?",
                       out.stdout, re.M)
  runtime = re.search(rf"^{prefix}runtime: (.*)$", out.stdout, re.M).group(1)
  sent = int(per_step.group(1).replace(",", ""))
  across = int(per_step.group(2).replace(",", "")) if per_step.group(2) else 0
  losses = [float(l) for _, l, _ in steps]
  times = [int(t) for _, _, t in steps][3:]
  return losses, statistics.median(times), sent, across, runtime.split(",")[0]


def main(_):
  import tempfile  # pylint: disable=g-import-not-at-top
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for w in (int(x) for x in FLAGS.workers):
      rows.append((f"{w} x {8 // w}",) + _run(w, os.path.join(tmp, str(w))))
      if w == 1:   # the same runtime as several processes, in one
        rows.append(("1 x 8, TF's collectives",) + _run(w, os.path.join(tmp, "1c"), ["--exchange=collectives"]))
  base_losses, base_time = rows[0][1], rows[0][2]
  coll_time = next((r[2] for r in rows if r[0].endswith("collectives")), None)
  print(f"train_transformer {' '.join(FLAGS.binary_flags)} on mesh (2,4), {FLAGS.steps} steps, median after 3 "
        "warm-up steps, all on this machine's cores")
  print("| processes x devices | runtime | step ms | vs 1 process | vs 1 process, TF's collectives | "
        "B/device per step | B/device across processes | losses = 1 process |")
  print("|---|---|---|---|---|---|---|---|")
  for name, losses, t, sent, across, runtime in rows:
    same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, base_losses)) and len(losses) == len(base_losses)
    vs_coll = f"{t / coll_time:.2f}" if coll_time else "-"
    print(f"| {name} | {runtime} | {t:.0f} | {t / base_time:.2f} | {vs_coll} | {sent:,} | {across:,} | "
          f"{'yes' if same else 'NO'} |")


if __name__ == "__main__":
  app.run(main)
