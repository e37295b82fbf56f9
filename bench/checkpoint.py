"""Checkpoints of sharded variables: one process x 8 CPUs vs 2 x 4 vs 4 x 2, same variables, same mesh (2,4).

Four float32 variables of --mb MiB in all, split over both mesh axes (P("data","model") and P("model","data")),
updated by a partitioned step. Each configuration (one process, or `python -m tf_gspmd.launch` workers on
127.0.0.1) saves them with tf.train.CheckpointManager (every process the same call), restores them onto fresh
variables laid out otherwise (each P("data","model") variable onto P("model","data") and back: every
tile crosses processes), and compares a step right after a synchronous save
with one right after an asynchronous save (CheckpointOptions(experimental_enable_async_checkpoint=True)).
Per configuration it prints: save and restore wall time, bytes each process wrote, the largest resident-memory
growth (VmHWM) of any process during the save and during the restore as a share of that process's own tiles,
the step time alone, the blocking part of a synchronous and of an asynchronous save, and whether the restored
values equal the saved ones.

Then (--keras_mb, one process of 8 CPUs) a Keras model under keras.distribution.ModelParallel on (2,4), two Dense
kernels of --keras_mb MiB each split over "model" (up P(None,"model"), down P("model",None)) with Adam: resident
growth of tf.train.Checkpoint(model, optimizer).write, of its restore onto a fresh model laid out the other way,
and of model.save_weights / load_weights, each as a share of the largest variable.

  python bench/checkpoint.py [--mb=2048] [--workers=1,2,4] [--keras_mb=128]
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

flags.DEFINE_integer("mb", 2048, "MiB of variables in all.")
flags.DEFINE_list("workers", ["1", "2", "4"], "Process counts (each divides the mesh's 8 devices).")
flags.DEFINE_integer("keras_mb", 128, "MiB of the Keras model's largest kernel (0: no Keras measurement).")
flags.DEFINE_string("worker_dir", None, "Internal: run as one worker saving under this directory.")
flags.DEFINE_string("keras_dir", None, "Internal: run the Keras measurement saving under this directory.")
FLAGS = flags.FLAGS
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _mark():
  open("/proc/self/clear_refs", "w").write("5")   # VmHWM restarts from the current resident size
  return int(open("/proc/self/statm").read().split()[1]) * 4096


def _peak_since(start):
  for line in open("/proc/self/status"):
    if line.startswith("VmHWM"):
      return int(line.split()[1]) * 1024 - start
  return 0


def _worker(directory):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  from tf_gspmd.runtime import checkpoint, state  # pylint: disable=g-import-not-at-top
  k, n = gs.initialize(cpu_devices=8)
  mesh = gs.Mesh((2, 4), ("data", "model"))
  P = gs.P
  rows = FLAGS.mb * 2**20 // 4 // 4 // 4096
  specs = [P("data", "model"), P("model", "data")] * 3   # restored onto the other one
  vs = [gs.variable("uniform", (rows, 4096), mesh=mesh, spec=s, name=f"v{i}", seed=i) for i, s in enumerate(specs[:4])]
  step = gs.function(lambda: [v.assign(v * 0.5 + 1.0) for v in vs], mesh=mesh)
  step()
  own = sum(int(np.prod(state.storage_of(v).tile_extent(p)[1])) * 4
            for v in vs for p in state.storage_of(v).written_slices().values())
  ckpt = tf.train.Checkpoint(**{f"v{i}": v for i, v in enumerate(vs)})
  manager = tf.train.CheckpointManager(ckpt, directory, max_to_keep=1)
  out = {"process": k, "processes": n, "own_bytes": own}
  start, t = _mark(), time.perf_counter()
  path = manager.save()
  out["save_s"], out["save_growth"] = time.perf_counter() - t, _peak_since(start)
  out["bytes_written"] = (checkpoint.last_save.get("bytes_written") if n > 1 else
                          sum(os.path.getsize(f) for f in tf.io.gfile.glob(path + ".data-*")))
  def checksum(x):
    x = tf.cast(x, tf.float64)
    return float(tf.reduce_sum(x) + tf.reduce_sum(x * x))
  sums = [checksum(s.value()) for v in vs for s in gs.shards_of(v)]
  fresh = [gs.variable(0.0, (rows, 4096), mesh=mesh, spec=specs[i + 1], name=f"r{i}") for i in range(len(vs))]
  start, t = _mark(), time.perf_counter()
  tf.train.Checkpoint(**{f"v{i}": v for i, v in enumerate(fresh)}).read(path).assert_existing_objects_matched()
  out["restore_s"], out["restore_growth"] = time.perf_counter() - t, _peak_since(start)
  got = [checksum(s.value()) for v in fresh for s in gs.shards_of(v)]
  # The same values: sums over every process's shards of the old layout and of the new one, compared in total.
  out["sum_saved"], out["sum_restored"] = sum(sums), sum(got)
  del fresh
  times = []
  for _ in range(3):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
  out["step_s"] = min(times)
  for name, options in (("sync", None),
                        ("async", tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True))):
    ck = tf.train.Checkpoint(**{f"v{i}": v for i, v in enumerate(vs)})
    t = time.perf_counter()
    ck.write(os.path.join(directory, name, "ck"), options=options)
    blocked = time.perf_counter() - t
    step()
    out[f"{name}_save_plus_step_s"], out[f"{name}_blocked_s"] = time.perf_counter() - t, blocked
    if options is not None:
      ck.sync()
  print("RESULT " + json.dumps(out), flush=True)


def _keras(directory):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  gs.split_cpu_devices(8)
  import keras  # pylint: disable=g-import-not-at-top
  import tf_gspmd.keras  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  rows = 4096
  cols = FLAGS.keras_mb * 2**20 // 4 // rows

  def build(up, down):
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = up
    layout_map[".*down/kernel"] = down
    with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
      model = keras.Sequential([keras.Input((rows,)), keras.layers.Dense(cols, name="up"),
                                keras.layers.Dense(rows, name="down")])
      model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
      model.optimizer.build(model.trainable_variables)
    return model

  def checksum(model):
    """Per variable: sum of value x (1 + global row index), shard by shard (nothing is put together); the same on
    every layout (each kernel's tiles cover it twice on (2,4) either way)."""
    out = []
    for v in model.weights + model.optimizer.variables:
      if gs.sharding_of(v) is None or not v.shape:
        out.append(float(np.sum(np.asarray(v.numpy(), np.float64))))
        continue
      total = 0.0
      for s in gs.shards_of(v):
        x = tf.cast(s.value(), tf.float64)
        rows = tf.cast(tf.range(s.index[0].start or 0, (s.index[0].start or 0) + x.shape[0]), tf.float64) + 1.0
        total += float(tf.reduce_sum(x * tf.reshape(rows, [-1] + [1] * (x.shape.rank - 1))))
      out.append(total)
    return out

  model = build((None, "model"), ("model", None))
  largest = max(int(np.prod(v.shape)) * 4 for v in model.weights)
  out = {"largest": largest}
  start = _mark()
  path = tf.train.Checkpoint(model=model, opt=model.optimizer).write(os.path.join(directory, "ck"))
  out["checkpoint_save"] = _peak_since(start)
  want = checksum(model)
  fresh = build(("model", None), (None, "model"))
  start = _mark()
  tf.train.Checkpoint(model=fresh, opt=fresh.optimizer).read(path).assert_existing_objects_matched()
  out["checkpoint_restore"] = _peak_since(start)
  out["checkpoint_equal"] = checksum(fresh) == want
  del fresh
  weights = os.path.join(directory, "model.weights.h5")
  start = _mark()
  model.save_weights(weights)
  out["save_weights"] = _peak_since(start)
  fresh = build(("model", None), (None, "model"))
  start = _mark()
  fresh.load_weights(weights)
  out["load_weights"] = _peak_since(start)
  out["weights_equal"] = checksum(fresh) == want
  print("RESULT " + json.dumps(out), flush=True)


def _run(workers, directory):
  script = [os.path.abspath(__file__), f"--mb={FLAGS.mb}", f"--worker_dir={directory}"]
  if workers == 0:   # the Keras measurement
    script = [os.path.abspath(__file__), f"--keras_mb={FLAGS.keras_mb}", f"--keras_dir={directory}"]
  command = [sys.executable] + (script if workers <= 1 else ["-m", "tf_gspmd.launch", f"--workers={workers}", "--",
                                                            *script])
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
             TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
  out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
  if out.returncode:
    raise SystemExit(f"{workers} process(es) failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
  return [json.loads(line.split("RESULT ", 1)[1]) for line in out.stdout.splitlines() if "RESULT " in line]


def main(_):
  if FLAGS.worker_dir:
    return _worker(FLAGS.worker_dir)
  if FLAGS.keras_dir:
    return _keras(FLAGS.keras_dir)
  print(f"{FLAGS.mb} MiB of float32 variables (4 split over (2,4)), saved with CheckpointManager, restored onto "
        "the transposed layout; growth = peak resident growth of the worst process / its own tiles")
  print("| processes x devices | save s | restore s | MiB written per process | save growth | restore growth | "
        "step ms | sync save blocks ms | async save blocks ms | step after async save ms | values equal |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for w in (int(x) for x in FLAGS.workers):
    with tempfile.TemporaryDirectory() as tmp:
      rows = sorted(_run(w, tmp), key=lambda r: r["process"])
    mib = "/".join(f"{r['bytes_written'] / 2**20:.0f}" for r in rows)
    saved = sum(r["sum_saved"] for r in rows)
    equal = abs(sum(r["sum_restored"] for r in rows) - saved) <= 1e-9 * abs(saved)
    worst = lambda key: max(r[key] / r["own_bytes"] for r in rows)  # noqa: E731
    print(f"| {w} x {8 // w} | {max(r['save_s'] for r in rows):.2f} | {max(r['restore_s'] for r in rows):.2f} | "
          f"{mib} | {worst('save_growth'):.0%} | {worst('restore_growth'):.0%} | "
          f"{max(r['step_s'] for r in rows) * 1e3:.0f} | {max(r['sync_blocked_s'] for r in rows) * 1e3:.0f} | "
          f"{max(r['async_blocked_s'] for r in rows) * 1e3:.0f} | "
          f"{max(r['async_save_plus_step_s'] - r['async_blocked_s'] for r in rows) * 1e3:.0f} | {equal} |", flush=True)

  if FLAGS.keras_mb:
    with tempfile.TemporaryDirectory() as tmp:
      r = _run(0, tmp)[0]
    share = lambda key: f"{r[key] / r['largest']:.0%}"  # noqa: E731
    print(f"\nKeras ModelParallel (2,4), two {r['largest'] / 2**20:.0f} MiB kernels and Adam, one process; growth / "
          "largest variable")
    print("| Checkpoint save | Checkpoint restore (other layout) | save_weights | load_weights (other layout) | "
          "values equal |")
    print("|---|---|---|---|---|")
    print(f"| {share('checkpoint_save')} | {share('checkpoint_restore')} | {share('save_weights')} | "
          f"{share('load_weights')} | {r['checkpoint_equal'] and r['weights_equal']} |", flush=True)


if __name__ == "__main__":
  app.run(main)
