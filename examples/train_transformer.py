"""Train a decoder-only transformer language model, Megatron-partitioned over a (data, model) mesh.

  python examples/train_transformer.py                      # mesh 2,4 on 8 logical CPUs
  python examples/train_transformer.py --plan               # the plan for 2048 devices (32 x 64), no devices
  python examples/train_transformer.py --resume             # continue from the latest checkpoint
  python examples/train_transformer.py --auto_parallel --microbatches=4
                                           # stages, submeshes and layouts planned automatically (Alpa), MPMD
  python examples/train_transformer.py --auto_parallel --plan --layers=64 --plan_mesh=32,8
                                           # the automatic plan of 64 layers on 256 devices, no devices
  python examples/train_transformer.py --layers=8 --pipeline_stages=4 --microbatches=8 --mesh=4,2
                                           # GSPMD pipeline: 4 stages over `stage`, batch over `data`
  python examples/train_transformer.py --layers=8 --pipeline_stages=4 --circular_repeats=2 --mesh=2,2,2
                                           # circular (8 stage slots), stage x data x model (Megatron in stages)

Keras 3 model (embedding, causal multi-head attention, GELU MLP, layer norms) and Keras Adam; attention heads
and the MLP hidden dim split over `model`, the batch over `data`. With --pipeline_stages=S the same decoder (in
plain TF, `transformer_model.PipelinedLM`, Adam) runs its layers as a GSPMD pipeline (`gs.pipeline`): the mesh's
first axis is `stage` (then `data`, then `model`), each device stores only its stages' weights and Adam state,
and --plan shows the weight bytes per device, the bytes of each stage shift and the bubble fraction. Data: token sequences with structure
(each sequence counts up from a random start by a random stride), so the loss falls as the model learns it.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import training  # noqa: E402

flags.DEFINE_integer("layers", 4, "Transformer layers.", lower_bound=1)
flags.DEFINE_integer("d_model", 64, "Model width (a multiple of --heads).", lower_bound=1)
flags.DEFINE_integer("heads", 4, "Attention heads.", lower_bound=1)
flags.DEFINE_integer("d_ff", 256, "MLP hidden width.", lower_bound=1)
flags.DEFINE_integer("vocab", 128, "Vocabulary size.", lower_bound=1)
flags.DEFINE_integer("seq_len", 32, "Sequence length.", lower_bound=1)
flags.DEFINE_integer("batch", 16, "Global batch size.", lower_bound=1)
flags.DEFINE_float("dropout", 0.0, "Dropout rate on each MLP's hidden activation (training steps only).",
                   lower_bound=0.0, upper_bound=0.99)
flags.DEFINE_enum("layout", "megatron", ["megatron", "2d"], "megatron: attention heads and the MLP hidden dim split "
                  "over `model`, everything else replicated over `data` (the batch split over it); 2d: GSPMD's 2D "
                  "layout, every weight split over both axes (d_model over `data`, heads / hidden / vocabulary over "
                  "`model`), the activations' batch over `data` and d_model over `model`.")
flags.DEFINE_integer("pipeline_stages", 0, "Pipeline stages S (0: no pipeline); the layers are split into S (x R) "
                     "stage slots over the mesh's first axis, `stage`.", lower_bound=0)
flags.DEFINE_integer("microbatches", 8, "Microbatches M of the pipeline (the batch must be a multiple).",
                     lower_bound=1)
flags.DEFINE_integer("circular_repeats", 1, "Circular repeats R: each device runs R non-adjacent stage slots.",
                     lower_bound=1)
flags.adopt_module_key_flags(training)   # --help lists the shared flags (--mesh, --steps, --plan, ...) too


def _meshes(values):
  """The axes this run's mesh may have and its default --plan_mesh (training.check_meshes)."""
  if values["auto_parallel"]:
    return None, (32, 8)
  if values["pipeline_stages"]:
    return [("stage", "data"), ("stage", "data", "model")], (16, 16, 8)
  return [("data", "model")], (32, 64)


def _model_fits(values):
  """The model's flags agree with each other (checked before TensorFlow starts; the model would fail later)."""
  stages, repeats, micro = values["pipeline_stages"], values["circular_repeats"], values["microbatches"]
  if values["d_model"] % values["heads"]:
    raise flags.ValidationError(f"--d_model={values['d_model']} is not a multiple of --heads={values['heads']}: "
                                "each head takes d_model / heads of the width")
  if (stages or values["auto_parallel"]) and values["batch"] % micro:
    raise flags.ValidationError(f"--batch={values['batch']} cannot be divided into --microbatches={micro}: give a "
                                "batch that is a multiple of the microbatches")
  if stages and values["layers"] % (stages * repeats):
    raise flags.ValidationError(f"--layers={values['layers']} cannot be divided into --pipeline_stages={stages} x "
                                f"--circular_repeats={repeats} stage slots: give a multiple of {stages * repeats}")
  if stages and repeats > 1 and micro < stages:
    raise flags.ValidationError(f"a circular pipeline needs at least as many microbatches as stages: "
                                f"--microbatches={micro} < --pipeline_stages={stages}")
  if values["dropout"] and (stages or values["auto_parallel"]):
    raise flags.ValidationError(f"--dropout={values['dropout']} is a layer of the Keras model; the pipelined and "
                                "--auto_parallel models have none: leave --dropout out with them")
  flag = "plan_mesh" if values["plan"] else "mesh"
  shape = training.sizes(values[flag]) or ((16, 16, 8) if values["plan"] else (4, 2))   # (pipelined_task's defaults)
  if stages and stages % shape[0]:
    raise flags.ValidationError(f"--pipeline_stages={stages} is not a multiple of {shape[0]}, the size of the mesh's "
                                f"`stage` axis (the first size of --{flag}={','.join(map(str, shape))}): give a "
                                "multiple of it")
  return True


training.check_meshes(_meshes, extra=["pipeline_stages"])
flags.register_multi_flags_validator(["d_model", "heads", "batch", "microbatches", "layers", "pipeline_stages",
                                      "circular_repeats", "auto_parallel", "mesh", "plan_mesh", "plan", "dropout"],
                                     _model_fits)
FLAGS = flags.FLAGS


def task():
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top
  cfg = tm.Config(layers=FLAGS.layers, d_model=FLAGS.d_model, heads=FLAGS.heads, d_ff=FLAGS.d_ff,
                  vocab=FLAGS.vocab, seq=FLAGS.seq_len, batch=FLAGS.batch, lr=FLAGS.lr, dropout=FLAGS.dropout)

  def build(mesh, plan_only=False):  # pylint: disable=unused-argument
    import keras  # pylint: disable=g-import-not-at-top
    keras.utils.set_random_seed(FLAGS.seed)
    two_d = FLAGS.layout == "2d" and not FLAGS.auto
    model = tm.keras_model(cfg, activations=tm.ACTIVATIONS_2D if two_d else None)
    optimizer = keras.optimizers.Adam(cfg.lr)
    optimizer.build(model.trainable_variables)
    return training.Model(step=tm.make_keras_train_step(model, optimizer, annotate=not FLAGS.auto, layout=FLAGS.layout),
                          trackables={"model": model, "optimizer": optimizer})

  return training.Task(
      name="transformer", axes=("data", "model"), default_mesh=(2, 4), default_plan_mesh=(32, 64), build=build,
      batch=lambda k: tm.synthetic_batch(cfg, seed=FLAGS.seed * 1_000_003 + k),
      in_specs=lambda mesh: (P("data", None), P("data", None)), unit="tokens", per_step=cfg.batch * cfg.seq)


def pipelined_task():
  """The pipelined model: mesh axes (stage, data[, model]), the layers stacked per stage slot."""
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top
  cfg = tm.Config(layers=FLAGS.layers, d_model=FLAGS.d_model, heads=FLAGS.heads, d_ff=FLAGS.d_ff,
                  vocab=FLAGS.vocab, seq=FLAGS.seq_len, batch=FLAGS.batch, lr=FLAGS.lr)
  shape = (FLAGS.plan_mesh or (16, 16, 8)) if FLAGS.plan else (FLAGS.mesh or (4, 2))   # (as _model_fits checks)
  axes = ("stage", "data", "model")[:len(shape)]

  def build(mesh, plan_only=False):  # pylint: disable=unused-argument
    lm = tm.PipelinedLM(cfg, FLAGS.pipeline_stages, FLAGS.microbatches, FLAGS.circular_repeats,
                        megatron="model" in axes, seed=FLAGS.seed)
    return training.Model(step=lm.train_step, trackables={"model": lm})

  return training.Task(
      name="transformer_pipeline", axes=axes, default_mesh=(4, 2), default_plan_mesh=(16, 16, 8), build=build,
      batch=lambda k: tm.synthetic_batch(cfg, seed=FLAGS.seed * 1_000_003 + k),
      in_specs=lambda mesh: (P("data", None), P("data", None)), unit="tokens", per_step=cfg.batch * cfg.seq)


def auto_parallel_task():
  """The plain-TF decoder (`transformer_model.loss_fn`, tied embedding and vocabulary head) for --auto_parallel."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  cfg = tm.Config(layers=FLAGS.layers, d_model=FLAGS.d_model, heads=FLAGS.heads, d_ff=FLAGS.d_ff,
                  vocab=FLAGS.vocab, seq=FLAGS.seq_len, batch=FLAGS.batch, lr=FLAGS.lr)

  def loss(params, tokens, targets):
    return tm.loss_fn(params, tokens, targets, cfg)

  return training.AutoTask(
      name="transformer_auto_parallel", loss_fn=loss, init=lambda: tm.init_params(cfg, seed=FLAGS.seed),
      param_specs=lambda: {k: tf.TensorSpec(s, tf.float32) for k, s in tm.param_shapes(cfg).items()},
      batch=lambda k: tm.synthetic_batch(cfg, seed=FLAGS.seed * 1_000_003 + k), layers=cfg.layers,
      microbatches=FLAGS.microbatches, default_mesh=(2, 4), default_plan_mesh=(32, 8))


def main(_):
  if FLAGS.auto_parallel:
    training.run_auto_parallel(auto_parallel_task())
  else:
    training.run(pipelined_task() if FLAGS.pipeline_stages else task())


if __name__ == "__main__":
  app.run(main)
