"""Train a GShard mixture-of-experts transformer with its experts split over a mesh axis.

  python examples/train_moe.py                     # 8 experts on 8 logical CPUs (mesh 8, axis "expert")
  python examples/train_moe.py --plan              # the plan for 2048 devices, no devices
  python examples/train_moe.py --auto_parallel --mesh=2,4   # stages, submeshes, layouts planned (Alpa), MPMD

Every layer: causal self-attention, then a mixture-of-experts feed-forward block as in GShard: a softmax
gate picks each token's top-2 experts, each expert takes at most `capacity` tokens per group (capacity
factor x 2 x tokens / experts; overflow tokens are dropped from that expert), dispatch and combine are
einsums with one-hot [group, token, expert, slot] tensors, and a load-balancing loss (mean gate x fraction
of tokens routed, per expert) is added to the language-model loss. Groups (sequences) are split over the
`expert` axis outside the experts, experts over it inside: the dispatch and combine become all-to-alls.

Weights are plain tf.Variables created shard by shard (gs.variable, mesh-independent initial values), trained
with Adam written in TF arithmetic.
"""

import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import training  # noqa: E402

flags.DEFINE_integer("layers", 2, "Transformer layers (each with a mixture-of-experts block).", lower_bound=1)
flags.DEFINE_integer("d_model", 64, "Model width (a multiple of --heads).", lower_bound=1)
flags.DEFINE_integer("heads", 4, "Attention heads.", lower_bound=1)
flags.DEFINE_integer("d_ff", 128, "Hidden width of each expert.", lower_bound=1)
flags.DEFINE_integer("experts", 8, "Number of experts.", lower_bound=1)
flags.DEFINE_float("capacity_factor", 2.0, "Expert capacity as a multiple of the even share of top-2 slots (a "
                   "positive number).")
flags.DEFINE_float("aux_weight", 0.01, "Weight of the load-balancing loss (0 or more).", lower_bound=0.0)
flags.DEFINE_integer("vocab", 128, "Vocabulary size.", lower_bound=1)
flags.DEFINE_integer("seq_len", 32, "Sequence length (tokens per group).", lower_bound=1)
flags.DEFINE_integer("batch", 16, "Global batch size (groups).", lower_bound=1)
flags.DEFINE_integer("microbatches", 4, "With --auto_parallel: microbatches of the MPMD pipeline (the batch must be "
                     "a multiple).", lower_bound=1)
flags.adopt_module_key_flags(training)   # --help lists the shared flags (--mesh, --steps, --plan, ...) too
flags.register_validator("capacity_factor", training.positive_number, "give a positive multiple of the even share")
flags.register_validator("aux_weight", lambda v: v == v and v != float("inf"), "give a finite weight")
training.check_meshes(lambda values: (None, (32, 8)) if values["auto_parallel"] else ([("expert",)], (2048,)))
flags.register_multi_flags_validator(
    ["d_model", "heads"], lambda v: v["d_model"] % v["heads"] == 0,
    "--d_model must be a multiple of --heads: each head takes d_model / heads of the width")
flags.register_multi_flags_validator(
    ["batch", "microbatches", "auto_parallel"], lambda v: not v["auto_parallel"] or v["batch"] % v["microbatches"] == 0,
    "with --auto_parallel, --batch must be a multiple of --microbatches")
FLAGS = flags.FLAGS

B1, B2, EPS = 0.9, 0.999, 1e-7


def param_specs(P):
  """name -> (shape, layout, initializer kind) of every weight."""
  d, h, f, e, v = FLAGS.d_model, FLAGS.heads, FLAGS.d_ff, FLAGS.experts, FLAGS.vocab
  specs = {"embed": ((v, d), P(), "normal"), "pos": ((FLAGS.seq_len, d), P(), "normal")}
  for l in range(FLAGS.layers):
    p = f"l{l}/"
    specs.update({
        p + "ln1": ((2, d), P(), "ln"), p + "wqkv": ((3, d, h, d // h), P(), "glorot"),
        p + "wo": ((h, d // h, d), P(), "glorot"), p + "ln2": ((2, d), P(), "ln"),
        p + "gate": ((d, e), P(), "glorot"),
        p + "w1": ((e, d, f), P("expert", None, None), "glorot"), p + "w2": ((e, f, d), P("expert", None, None), "glorot"),
    })
  specs["ln_f"] = ((2, d), P(), "ln")
  return specs


def _initializer(kind, seed):
  from tf_gspmd import initializers as gi  # pylint: disable=g-import-not-at-top
  return {"normal": gi.Normal(0.0, 0.02, seed), "glorot": gi.glorot_uniform(seed),
          "ln": gi.Constant(0.0)}[kind]


def annotate(gs, x, spec):
  """gs.shard(x, spec), unless --auto chooses every layout."""
  return x if FLAGS.auto or FLAGS.auto_parallel else gs.shard(x, spec)


def moe_block(x, gate_w, w1, w2, gs, P):
  """GShard top-2 mixture of experts on x [groups, tokens, d]; returns (y, load-balancing loss)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  g, s, _ = x.shape
  e = gate_w.shape[1]
  capacity = max(1, int(math.ceil(2 * s * FLAGS.capacity_factor / e)))
  gates = tf.nn.softmax(tf.einsum("gsm,me->gse", x, gate_w))
  idx1 = tf.argmax(gates, axis=-1, output_type=tf.int32)
  mask1 = tf.one_hot(idx1, e)
  idx2 = tf.argmax(gates * (1.0 - mask1), axis=-1, output_type=tf.int32)
  mask2 = tf.one_hot(idx2, e)
  # Load balancing: fraction of tokens whose first choice is each expert x its mean gate (GShard eq. 4).
  aux = tf.reduce_mean(tf.reduce_mean(mask1, axis=1) * tf.reduce_mean(gates, axis=1)) * float(e * e)
  pos1 = tf.cumsum(mask1, axis=1, exclusive=True)
  mask1 *= tf.cast(pos1 < capacity, mask1.dtype)
  pos2 = tf.cumsum(mask2, axis=1, exclusive=True) + tf.reduce_sum(mask1, axis=1, keepdims=True)
  mask2 *= tf.cast(pos2 < capacity, mask2.dtype)
  g1 = tf.reduce_sum(gates * mask1, axis=-1)
  g2 = tf.reduce_sum(gates * mask2, axis=-1)
  norm = g1 + g2 + 1e-9
  slot1 = tf.one_hot(tf.cast(tf.reduce_sum(pos1 * mask1, axis=-1), tf.int32), capacity)
  slot2 = tf.one_hot(tf.cast(tf.reduce_sum(pos2 * mask2, axis=-1), tf.int32), capacity)
  combine = ((g1 / norm)[..., None, None] * mask1[..., None] * slot1[:, :, None, :] +
             (g2 / norm)[..., None, None] * mask2[..., None] * slot2[:, :, None, :])      # [g, s, e, c]
  dispatch = tf.cast(combine > 0.0, x.dtype)
  expert_in = annotate(gs, tf.einsum("gsec,gsm->egcm", dispatch, x), P("expert", None, None, None))  # all-to-all
  h = tf.nn.gelu(tf.einsum("egcm,emh->egch", expert_in, w1))
  expert_out = annotate(gs, tf.einsum("egch,ehm->egcm", h, w2), P("expert", None, None, None))
  y = tf.einsum("gsec,egcm->gsm", combine, expert_out)                                         # all-to-all
  return y, aux


def forward(params, tokens, gs, P):
  """(logits [b, s, vocab], total load-balancing loss)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  d, h = FLAGS.d_model, FLAGS.heads
  s = tokens.shape[1]
  x = annotate(gs, tf.gather(params["embed"], tokens) + params["pos"], P("expert", None, None))
  mask = tm.causal_mask(s)
  aux = 0.0
  for l in range(FLAGS.layers):
    p = f"l{l}/"
    ln1, ln2 = params[p + "ln1"], params[p + "ln2"]
    y = tm.layer_norm(x, 1.0 + ln1[0], ln1[1])
    q, k, v = (tf.einsum("bsd,dhk->bhsk", y, params[p + "wqkv"][i]) for i in range(3))
    att = tf.nn.softmax(tf.einsum("bhqk,bhsk->bhqs", q, k) / math.sqrt(d // h) + mask)
    x = x + tf.einsum("bhqk,hkd->bqd", tf.einsum("bhqs,bhsk->bhqk", att, v), params[p + "wo"])
    y, a = moe_block(tm.layer_norm(x, 1.0 + ln2[0], ln2[1]), params[p + "gate"], params[p + "w1"], params[p + "w2"],
                     gs, P)
    x = x + y
    aux += a
  lnf = params["ln_f"]
  x = tm.layer_norm(x, 1.0 + lnf[0], lnf[1])
  return tf.einsum("bsd,vd->bsv", x, params["embed"]), aux


def task():
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top
  cfg = tm.Config(vocab=FLAGS.vocab, seq=FLAGS.seq_len, batch=FLAGS.batch)

  def build(mesh, plan_only=False):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    specs = param_specs(P)
    variables = {}
    for k, (name, (shape, spec, kind)) in enumerate(sorted(specs.items())):
      init = _initializer(kind, FLAGS.seed * 1000 + k)
      for slot in ("", "/m", "/v"):
        what = name + slot
        use = init if not slot else _initializer("ln", 0)
        if mesh is not None and not plan_only and not FLAGS.auto:
          variables[what] = gs.variable(use, shape, mesh=mesh, spec=spec, name=what.replace("/", "_"))
        else:
          variables[what] = tf.Variable(use(shape), name=what.replace("/", "_"))
    t = tf.Variable(0.0, name="adam_t")
    names = sorted(specs)

    def step(tokens, targets):
      with tf.GradientTape() as tape:
        params = {n: variables[n] for n in names}
        for n in names:
          params[n] = annotate(gs, params[n], specs[n][1])
        logits, aux = forward(params, tokens, gs, P)
        lm = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits))
        loss = lm + FLAGS.aux_weight * aux
      grads = tape.gradient(loss, [variables[n] for n in names])
      t.assign_add(1.0)
      lr = FLAGS.lr * tf.sqrt(1.0 - B2 ** t) / (1.0 - B1 ** t)
      for n, g in zip(names, grads):
        m, v = variables[n + "/m"], variables[n + "/v"]
        m.assign(B1 * m + (1.0 - B1) * g)
        v.assign(B2 * v + (1.0 - B2) * g * g)
        variables[n].assign_sub(lr * m / (tf.sqrt(v) + EPS))
      return lm

    trackables = {n.replace("/", "."): var for n, var in variables.items()}
    trackables["adam_t"] = t
    return training.Model(step=step, trackables=trackables)

  return training.Task(
      name="moe", axes=("expert",), default_mesh=(8,), default_plan_mesh=(2048,), build=build,
      batch=lambda k: tm.synthetic_batch(cfg, seed=FLAGS.seed * 1_000_003 + k),
      in_specs=lambda mesh: (P("expert", None), P("expert", None)), unit="tokens",
      per_step=FLAGS.batch * FLAGS.seq_len)


def auto_parallel_task():
  """The same step from explicit parameters for --auto_parallel: its loss is the language-model loss plus the
  weighted load-balancing loss (both means over the groups, so microbatches average to the batch's)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top
  cfg = tm.Config(vocab=FLAGS.vocab, seq=FLAGS.seq_len, batch=FLAGS.batch)
  specs = param_specs(P)

  def loss(params, tokens, targets):
    logits, aux = forward(params, tokens, None, P)
    lm = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits))
    return lm + FLAGS.aux_weight * aux

  def init():
    return {name: np.asarray(_initializer(kind, FLAGS.seed * 1000 + k)(shape), np.float32)
            for k, (name, (shape, _, kind)) in enumerate(sorted(specs.items()))}

  return training.AutoTask(
      name="moe_auto_parallel", loss_fn=loss, init=init,
      param_specs=lambda: {n: tf.TensorSpec(shape, tf.float32) for n, (shape, _, _) in specs.items()},
      batch=lambda k: tm.synthetic_batch(cfg, seed=FLAGS.seed * 1_000_003 + k), layers=FLAGS.layers,
      microbatches=FLAGS.microbatches, default_mesh=(2, 4), default_plan_mesh=(32, 8))


def main(_):
  if FLAGS.auto_parallel:
    training.run_auto_parallel(auto_parallel_task())
  else:
    training.run(task())


if __name__ == "__main__":
  app.run(main)
