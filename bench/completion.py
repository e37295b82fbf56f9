"""Completion of a 12-layer decoder-only transformer training step (GradientTape + Adam), plain TF and Keras 3.

Annotated only on inputs and weights (Megatron layout). Prints, for mesh (2,4) and for (32,64) in plan
mode (no devices), the number of tensors, how many the rule table covers (no fallback), completion time
and iterations, collectives and reshards implied. Completion time should not grow with the mesh size.

  python bench/completion.py [--layers=12]
"""

import collections
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

flags.DEFINE_integer("layers", 12, "Transformer layers.")
FLAGS = flags.FLAGS


def plain_step(tm, cfg, mesh):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top
  names = sorted(tm.param_shapes(cfg))
  specs = [tm.megatron_specs(cfg)[k] for k in names]
  shapes = tm.param_shapes(cfg)
  f = gs.function(tm.make_train_step(cfg, names), mesh=mesh,
                  in_shardings=(P(), P("data", None), P("data", None), *specs, *specs, *specs))
  args = ([tf.TensorSpec([], tf.int32)] + [tf.TensorSpec([cfg.batch, cfg.seq], tf.int32)] * 2 +
          [tf.TensorSpec(shapes[k]) for k in names] * 3)
  return f, args


def keras_step(tm, cfg, mesh):
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top
  model = tm.keras_model(cfg)
  opt = keras.optimizers.Adam(1e-3)
  opt.build(model.trainable_variables)
  f = gs.function(tm.make_keras_train_step(model, opt), mesh=mesh, in_shardings=(P("data", None), P("data", None)))
  return f, [tf.TensorSpec([cfg.batch, cfg.seq], tf.int32)] * 2


def main(_):
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  from tf_gspmd import ops  # pylint: disable=g-import-not-at-top
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  cfg = tm.Config(layers=FLAGS.layers)
  rows = []
  for label, build in (("plain TF", plain_step), ("Keras 3", keras_step)):
    for shape in ((2, 4), (32, 64)):
      mesh = gs.Mesh(shape, ("data", "model"))
      f, args = build(tm, cfg, mesh)
      low = f.lower(*args)
      r = low.report
      tensors = len(low.shardings)
      fallback_ops = collections.Counter(op for _, op in r.fallbacks)
      with_rule = sum(1 for n in low.program.ir.nodes if ops.lookup(n.op) is not None)
      rows.append((label, str(shape), tensors, with_rule, len(low.program.ir.nodes),
                   r.pass_times["complete"], r.completion_iterations, len(r.collectives), len(r.reshards),
                   dict(fallback_ops) or "-"))
  head = ("model", "mesh", "tensors", "ops w/ rule", "ops", "complete s", "iters", "collectives", "reshards",
          "fallbacks")
  widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
  fmt = lambda row: "  ".join(  # noqa: E731
      (f"{v:.3f}" if isinstance(v, float) else str(v)).ljust(w) for v, w in zip(row, widths))
  print(f"{FLAGS.layers}-layer transformer training step (GradientTape + Adam), Megatron layout")
  print(fmt(head))
  for row in rows:
    print(fmt(row))


if __name__ == "__main__":
  app.run(main)
