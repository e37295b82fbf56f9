"""Process memory (RSS) for creating one large sharded variable with gs.variable, by initializer.

Prints a table: the variable's bytes, the RSS the creation added, the peak RSS above the start (VmHWM) and
the peak's ratio to the variable. Each initializer runs in a
fresh process (RSS only grows within one). 8 logical CPU devices; the variable is split over all 8.

  .venv/bin/python bench/memory.py [--rows 8192 --cols 16384]
"""

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
import tf_gspmd as gs
from tf_gspmd import P

def status(key):
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))

gs.split_cpu_devices(8)
mesh = gs.Mesh((8,), ("m",))
rows, cols, name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
init = {"zeros": gs.initializers.zeros(), "normal": gs.initializers.Normal(seed=1),
        "uniform": gs.initializers.Uniform(seed=1), "glorot_uniform": gs.initializers.glorot_uniform(seed=1)}[name]
tf.zeros([8]).numpy()   # runtime up before the first reading
before = status("VmRSS")
v = gs.variable(init, [rows, cols], mesh=mesh, spec=P(None, "m"))
print(json.dumps({"added": status("VmRSS") - before, "peak": status("VmHWM") - before, "bytes": rows * cols * 4}))
"""


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rows", type=int, default=8192)
  parser.add_argument("--cols", type=int, default=16384)
  args = parser.parse_args()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  print(f"{'initializer':<16} {'variable MiB':>12} {'RSS added MiB':>14} {'peak added MiB':>15} {'peak ratio':>10}")
  for name in ("zeros", "normal", "uniform", "glorot_uniform"):
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.rows), str(args.cols), name], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    print(f"{name:<16} {row['bytes'] / 2**20:>12.0f} {row['added'] / 2**20:>14.0f} {row['peak'] / 2**20:>15.0f} "
          f"{row['peak'] / row['bytes']:>10.2f}")


if __name__ == "__main__":
  main()
