"""A two-layer MLP partitioned over a device mesh: data parallel or Megatron-style model parallel.

Prints the completed sharding of every weight and activation, the collective report, the time per step,
and the largest difference from the same MLP run unpartitioned.

  python examples/mlp.py --mesh=2,4 --mode=megatron
  python examples/mlp.py --mesh=8 --mode=dp
"""

import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402

flags.DEFINE_list("mesh", ["2", "4"], "Mesh shape, e.g. 2,4 (data, model) or 8 (data).")
flags.DEFINE_integer("batch", 64, "Global batch size.", lower_bound=1)
flags.DEFINE_integer("d_model", 1024, "Input and output width.", lower_bound=1)
flags.DEFINE_integer("hidden", 4096, "Hidden width.", lower_bound=1)
flags.DEFINE_enum("mode", "megatron", ["dp", "megatron"], "dp: batch split, weights replicated; megatron: "
                  "batch split over 'data', hidden split over 'model'.")
flags.DEFINE_integer("steps", 10, "Timed steps.", lower_bound=1)
# Checked as the flags are parsed, before TensorFlow starts: a bad value is absl's usage error naming the flag.
flags.register_validator("mesh", lambda v: 1 <= len(v) <= 2 and all(s.strip().isdigit() and int(s) > 0 for s in v),
                         "give one or two positive whole sizes, the mesh axes (data, model), e.g. 2,4 or 8")
flags.register_multi_flags_validator(["mode", "mesh"], lambda v: v["mode"] != "megatron" or len(v["mesh"]) == 2,
                                     "--mode=megatron needs a 2-D mesh (data, model), e.g. --mesh=2,4")
FLAGS = flags.FLAGS


def main(_):
  shape = tuple(int(s) for s in FLAGS.mesh)
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  gs.initialize(cpu_devices=math.prod(shape))   # one process, or the workers of python -m tf_gspmd.launch
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top

  names = ("data", "model")[:len(shape)] if len(shape) <= 2 else tuple(f"m{k}" for k in range(len(shape)))
  mesh = gs.Mesh(shape, names)
  model = "model" if "model" in names else None
  if FLAGS.mode == "megatron" and model is None:
    raise app.UsageError("--mode=megatron needs a 2-D mesh (data, model), e.g. --mesh=2,4")

  def mlp(x, w1, w2):
    h = tf.identity(tf.nn.gelu(x @ w1), name="hidden")
    return tf.identity(h @ w2, name="y")

  if FLAGS.mode == "dp":
    in_shardings = (P("data", None), P(), P())
  else:
    in_shardings = (P("data", None), P(None, model), P(model, None))
  f = gs.function(mlp, mesh=mesh, in_shardings=in_shardings, out_shardings=P("data", None))

  rng = np.random.default_rng(0)
  x = rng.standard_normal((FLAGS.batch, FLAGS.d_model), np.float32)
  w1 = (rng.standard_normal((FLAGS.d_model, FLAGS.hidden)) / math.sqrt(FLAGS.d_model)).astype(np.float32)
  w2 = (rng.standard_normal((FLAGS.hidden, FLAGS.d_model)) / math.sqrt(FLAGS.hidden)).astype(np.float32)

  low = f.lower(*[tf.TensorSpec(a.shape) for a in (x, w1, w2)])
  print(f"mesh {mesh}, mode {FLAGS.mode}")
  print("shardings:")
  for name in ("x", "w1", "w2", "hidden", "y"):
    s = low.shardings[name]
    print(f"  {name:7s} {str(list(low.program.ir.info(name + ':0').shape)):14s} {s}")
  print("collectives:", low.report)

  y = f(x, w1, w2)  # first call imports and traces the per-device program
  start = time.perf_counter()
  for _ in range(FLAGS.steps):
    y = f(x, w1, w2)
    y.components[0].numpy()
  step = (time.perf_counter() - start) / FLAGS.steps
  expected = mlp(tf.constant(x), tf.constant(w1), tf.constant(w2)).numpy()
  diff = float(np.max(np.abs(y.numpy() - expected)))
  print(f"time per step: {step * 1e3:.2f} ms (including scattering the inputs)")
  print(f"max |partitioned - unpartitioned| = {diff:.3g}")
  if diff > 1e-5 * max(1.0, float(np.max(np.abs(expected)))):
    raise SystemExit(f"partitioned result differs from the unpartitioned one by {diff}")


if __name__ == "__main__":
  app.run(main)
