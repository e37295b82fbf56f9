"""End-to-end check of the GPU path: partitioned training steps compiled whole by XLA on the machine's GPUs.

  python tools/gpu_check.py            # on a machine with GPUs
  python tools/gpu_check.py --cpu      # the same checks on 8 logical CPUs (XLA segments between collectives)

With two or more GPUs the mesh spans them; with one GPU it is split into --logical_gpus logical devices. Each
check runs a program partitioned with jit_compile="auto" (whole-program XLA on GPU), compares every result with
the unpartitioned program on the same inputs, and prints the step time. Exits non-zero on any mismatch.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

flags.DEFINE_bool("cpu", False, "Run on 8 logical CPU devices instead of GPUs.")
flags.DEFINE_integer("logical_gpus", 2, "Logical devices to split a single GPU into.")
flags.DEFINE_integer("steps", 5, "Timed steps per check.")
FLAGS = flags.FLAGS


def _devices(tf):
  if FLAGS.cpu:
    import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
    gs.split_cpu_devices(8)
    return [d.name for d in tf.config.list_logical_devices("CPU")][:8]
  gpus = tf.config.list_physical_devices("GPU")
  if not gpus:
    raise SystemExit("no GPU visible to TensorFlow; run with --cpu to check the CPU path")
  if len(gpus) == 1 and FLAGS.logical_gpus > 1:
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=8192)] * FLAGS.logical_gpus)
  return [d.name for d in tf.config.list_logical_devices("GPU")]


def main(_):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  devices = _devices(tf)
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  n = len(devices)
  model_axis = 2 if n % 2 == 0 and n > 2 else 1
  mesh = gs.Mesh((n // model_axis, model_axis), ("data", "model"), devices=devices)
  print(f"mesh {mesh.shape} over {devices[0]} ... {devices[-1]}; TF {tf.__version__}")
  rng = np.random.default_rng(0)
  failures = []

  def check(name, fn, args, specs):
    f = gs.function(fn, mesh=mesh, in_shardings=tuple(specs), jit_compile=True)
    low = f.lower(*[tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in args])
    start = time.perf_counter()
    got = [t.numpy() for t in tf.nest.flatten(f(*args))]
    first = time.perf_counter() - start
    with tf.device(devices[0]):
      want = [np.asarray(t) for t in tf.nest.flatten(tf.function(fn)(*[tf.constant(a) for a in args]))]
    err = max(float(np.max(np.abs(g - w) / (2e-4 + 2e-3 * np.abs(w)))) for g, w in zip(got, want))
    times = []
    for _ in range(FLAGS.steps):
      start = time.perf_counter()
      tf.nest.flatten(f(*args))[-1].numpy()
      times.append(time.perf_counter() - start)
    ok = err <= 1.0
    if not ok:
      failures.append(name)
    print(f"{name:28s} compiled: {low.program.jit or 'no':9s} collectives: {low.report.counts()}  first call "
          f"{first:.1f} s, step {np.median(times) * 1e3:.1f} ms, {'matches' if ok else f'MISMATCH ({err:.1f}x tol)'}")

  check("mlp_train_step", tm.mlp_train_step,
        [rng.standard_normal((64, 1024), np.float32), rng.standard_normal((64, 1024), np.float32),
         rng.standard_normal((1024, 4096), np.float32) * 0.03, rng.standard_normal((4096, 1024), np.float32) * 0.03],
        [P("data", None), P("data", None), P(None, "model"), P("model", None)])
  check("transformer_train_step", *tm.megatron_train_args(tm.Config(layers=4)))
  if failures:
    raise SystemExit(f"partitioned results differ from the unpartitioned program: {failures}")
  print("all checks passed")


if __name__ == "__main__":
  app.run(main)
