"""Saves or restores sharded variables with tf.train.CheckpointManager, the same calls in every process.

  --save DIR       one step, then a save; prints what this process wrote and how much its memory grew
  --save DIR --loop   saves again and again (each save a step later), touching DIR/first_done after the first
  --restore PREFIX    restores onto --mesh and prints checksums of every variable
  --own_directory     each process saves to a directory of its own (refused: one checkpoint needs one path)

Variables: `a` split over both mesh axes (each process holds its own rows), `b` split over "model" only with an
uneven dimension (replicated over "data"), `c` replicated, `n` a plain counter.
"""

import argparse
import json
import os
import sys

import numpy as np

ROWS = 4096   # a: [ROWS, 2048] float32 = 32 MiB


def peak_growth(start):
  for line in open("/proc/self/status"):
    if line.startswith("VmHWM"):
      return int(line.split()[1]) * 1024 - start
  return None


def mark():
  open("/proc/self/clear_refs", "w").write("5")
  return int(open("/proc/self/statm").read().split()[1]) * 4096


def build(gs, tf, mesh, init=True):
  P = gs.P
  a = gs.variable("uniform" if init else 0.0, (ROWS, 2048), mesh=mesh, spec=P("data", "model"), name="a", seed=1)
  b = gs.variable("uniform" if init else 0.0, (40, 30), mesh=mesh, spec=P(None, "model"), name="b", seed=2)
  c = tf.Variable(tf.range(7, dtype=tf.float32) if init else tf.zeros([7]), name="c")
  n = tf.Variable(0, dtype=tf.int64, name="n")
  return a, b, c, n


def checksums(vs):
  out = {}
  for name, v in zip("abcn", vs):
    x = np.asarray(v.numpy(), np.float64)
    out[name] = [float(x.sum()), float((x * np.arange(x.size).reshape(x.shape) % 97).sum()) if x.ndim else 0.0]
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--save", default=None)
  parser.add_argument("--restore", default=None)
  parser.add_argument("--loop", action="store_true")
  parser.add_argument("--mesh", default="2,4")
  parser.add_argument("--own_directory", action="store_true", help="each process saves under DIR/process_K")
  args = parser.parse_args()
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  from tf_gspmd.runtime import checkpoint, state  # pylint: disable=g-import-not-at-top
  k, count = gs.initialize(cpu_devices=8, heartbeat_timeout=5.0)
  shape = tuple(int(s) for s in args.mesh.split(","))
  mesh = gs.Mesh(shape, ("data", "model"))
  out = {"process": k, "processes": count}
  if args.restore:
    vs = build(gs, tf, mesh, init=False)
    tf.train.Checkpoint(a=vs[0], b=vs[1], c=vs[2], n=vs[3]).read(args.restore).assert_existing_objects_matched()
    out["checksums"] = checksums(vs)
    out["a_spec"] = str(gs.sharding_of(vs[0]).spec)
  else:
    a, b, c, n = build(gs, tf, mesh)
    step = gs.function(lambda: (a.assign(a * 0.5 + 1.0), b.assign_add(tf.ones_like(b)), n.assign_add(1)), mesh=mesh)
    directory = os.path.join(args.save, f"process_{k}") if args.own_directory else args.save
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(a=a, b=b, c=c, n=n), directory, max_to_keep=2)
    step()
    start = mark()
    try:
      out["saved"] = manager.save()
    except gs.InputError as e:
      print("RESULT " + json.dumps(dict(out, error=str(e))), flush=True)
      return 0
    out["growth"] = peak_growth(start)
    out["bytes_written"] = checkpoint.last_save.get("bytes_written")
    owned = 0
    for v in (a, b):
      s = state.storage_of(v)
      owned += sum(int(np.prod(s.tile_extent(p)[1])) * 4 for p in s.written_slices().values())
    out["owned_bytes"] = owned
    out["checksums"] = checksums((a, b, c, n))
    if args.loop:
      open(os.path.join(args.save, "first_done"), "w").close()
      for _ in range(1000):
        step()
        manager.save()
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  sys.exit(main())
