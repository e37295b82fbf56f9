"""Lingvo's own layer stacks through tf_gspmd: GenericRepeatLayer (lingvo.core.repeat_layer) and GShard's builder.

Lingvo runs its repeated layer through `lingvo.core.recurrent.Recurrent`: a functional While for the forward that
stacks every layer's activations, and a second While, its custom gradient, that walks the layers backwards and
accumulates the stacked weights' gradients. The test builds the layer as Lingvo does, splits the stacked weights
over `model` and the batch over `data`, and compares forward, backward and two SGD steps with plain TF.

It runs when Lingvo is importable: from the environment, or from `.lingvo/` at the repository root, where
`make test` installs lingvo 0.14.2 and the pure-Python modules its import needs (`pip install --no-deps`).
"""

import importlib.util
import pathlib
import sys
import types

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))
LAYERS, WIDTH, BATCH = 4, 16, 12
_FOLDER = pathlib.Path(__file__).resolve().parents[2] / ".lingvo"


class _OpsUnavailable(types.ModuleType):
  """Stands in for lingvo.core.ops.gen_x_ops: every op raises when called."""

  def __getattr__(self, name):
    if name.startswith("__"):
      raise AttributeError(name)

    def op(*args, **kwargs):
      raise NotImplementedError(f"lingvo's custom op {name} is not available (x_ops.so did not load)")
    return op


def _import_lingvo():
  """Lingvo's repeat_layer, layers and py_utils, or None when Lingvo is not importable."""
  if importlib.util.find_spec("lingvo") is None and _FOLDER.is_dir():
    sys.path.append(str(_FOLDER))   # after the environment's own packages: its numpy and TF stay the ones used
  spec = importlib.util.find_spec("lingvo")
  if spec is None:
    return None
  ops_dir = pathlib.Path(list(spec.submodule_search_locations)[0]) / "core" / "ops"
  if not (ops_dir / "gen_x_ops.py").exists():
    try:
      tf.load_op_library(str(ops_dir / "x_ops.so"))
    except (tf.errors.NotFoundError, OSError):
      # lingvo 0.14.2's x_ops.so is built against a newer glibc (2.38) than some systems have, and then fails to
      # load. lingvo.core.ops imports gen_x_ops first (its statically linked form) and only then loads the
      # library, so a module whose ops raise takes its place: the layers below call none of Lingvo's custom ops
      # once Lingvo's own `enable_asserts` flag is off (any call would raise, not pass silently).
      sys.modules["lingvo.core.ops.gen_x_ops"] = _OpsUnavailable("lingvo.core.ops.gen_x_ops")
  try:
    from lingvo.core import layers, py_utils, repeat_layer  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return repeat_layer, layers, py_utils


_LINGVO = _import_lingvo()
pytestmark = pytest.mark.skipif(_LINGVO is None, reason="lingvo is not importable (make test installs it into "
                                                        ".lingvo/; the install failed or was skipped)")


@pytest.fixture(scope="module")
def stack():
  """(layer, its stacked weights by name): GenericRepeatLayer over an FCLayer WIDTH -> WIDTH with tanh."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  repeat_layer, layers, py_utils = _LINGVO
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  before = flags.FLAGS.enable_asserts
  flags.FLAGS.enable_asserts = False   # Lingvo's shape assertions are its custom ops
  nested = py_utils.NestedMap

  class Repeat(repeat_layer.GenericRepeatLayer):
    """Each repetition maps the running activation through the body layer."""

    def FProp(self, theta, x):  # pylint: disable=invalid-name
      def fn(theta_i, *, common_input, layerwise_input, iterative):  # pylint: disable=unused-argument
        y = self._body.FProp(theta_i.body, iterative.x)
        return nested(layerwise_output=nested(), iterative=nested(x=y))
      return self._Repeat(theta, fn, iterative_input_0=nested(x=x)).iterative.x

  params = Repeat.Params().Set(name="repeat", repeat=LAYERS, body=layers.FCLayer.Params().Set(
      input_dim=WIDTH, output_dim=WIDTH, activation="TANH"))
  layer = params.Instantiate()
  yield layer, [(name, v.numpy()) for name, v in layer.vars.FlattenItems()]
  flags.FLAGS.enable_asserts = before


def _programs(layer):
  def loss_and_grads(x, *ws):
    theta = layer.vars.Pack(list(ws))
    with tf.GradientTape() as tape:
      tape.watch(list(ws))
      y = layer.FProp(theta, x)
      loss = tf.reduce_sum(y * y)
    return (y, loss) + tuple(tape.gradient(loss, list(ws)))

  def sgd_step(x, *ws):
    _, loss, *grads = loss_and_grads(x, *ws)
    return (loss,) + tuple(w - 0.01 * g for w, g in zip(ws, grads))
  return loss_and_grads, sgd_step


def _specs(weights):
  """The batch over data; each stacked weight split on its last dim over model, the layer axis whole."""
  return (P("data", None),) + tuple(P(*([None] * (w.ndim - 1)), "model") for _, w in weights)


def _assert_stacked_values_not_gathered(low, weights):
  """No all-gather of a value stacked over the layers (the stacked weights, their gradients, the activations the
  forward loop keeps for the backward), and none whose cause is a weight."""
  assert low.report.fallbacks == ()
  gathers = [c for c in low.report.collectives if c.kind == "all-gather"]
  stacked = [c for c in gathers if c.shape and c.shape[0] == LAYERS]
  assert not stacked, [str(c) for c in stacked]
  params = ["ws_%d" % k for k in range(len(weights))]
  named = [c for c in gathers if any(f"{p} is" in c.reason for p in params)]
  assert not named, [str(c) for c in named]


def test_forward_and_backward_match_plain_tf(stack, rng):
  layer, weights = stack
  assert [w.shape for _, w in weights] == [(LAYERS, WIDTH), (LAYERS, WIDTH, WIDTH)]   # body.b, body.w stacked
  loss_and_grads, _ = _programs(layer)
  x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
  ws = [w for _, w in weights]
  want = tf.function(loss_and_grads)(x, *ws)
  f = gs.function(loss_and_grads, mesh=MESH, in_shardings=_specs(weights))
  got = f(x, *ws)
  assert len(got) == len(want) == 2 + len(ws)
  for g, w in zip(got, want):
    assert_close(g, w, rtol=1e-5, atol=1e-5)
  assert float(np.abs(np.asarray(want[2])).max()) > 1e-3   # the gradients compared are not all zero
  low = f.lower(*[tf.TensorSpec(a.shape) for a in [x] + ws])
  _assert_stacked_values_not_gathered(low, weights)
  assert sum(n.op in ("While", "StatelessWhile") for n in low.graph_def.node) == 2   # forward and its gradient


def test_two_sgd_steps_match_plain_tf(stack, rng):
  layer, weights = stack
  _, sgd_step = _programs(layer)
  x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
  ws = [w for _, w in weights]
  ref = tf.function(sgd_step)
  f = gs.function(sgd_step, mesh=MESH, in_shardings=_specs(weights))
  mine, theirs = list(ws), list(ws)
  losses = []
  for _ in range(2):
    got = f(x, *mine)
    want = ref(x, *theirs)
    for g, w in zip(got, want):
      assert_close(g, w, rtol=1e-5, atol=1e-5)
    losses.append(float(want[0]))
    mine = [np.asarray(g) for g in got[1:]]
    theirs = [w.numpy() for w in want[1:]]
  assert losses[1] < losses[0]   # the step trains
  for (name, before), after in zip(weights, mine):
    assert np.abs(after - before).max() > 1e-4, name   # every stacked weight moved
  low = f.lower(*[tf.TensorSpec(a.shape) for a in [x] + ws])
  _assert_stacked_values_not_gathered(low, weights)


# GShard's builder: an encoder stack of attention, mixture-of-experts and dense feed-forward blocks wrapped in its
# RepeatLayer (per-layer weights stacked inside the layer, lingvo.core.recurrent's own While forward and backward),
# annotated by Lingvo itself (gshard_utils.Split / MeshSplit emit XlaSharding ops when Lingvo targets a TPU).
GSHARD_LAYERS, GSHARD_BATCH, GSHARD_LENGTH, GSHARD_MODEL = 2, 8, 4, 8


@pytest.fixture(scope="module")
def gshard_encoder():
  """(layer, its variables): DenseBuilder.EncoderLayerStack(use_repeat_layer=True) over a (2, 4) device mesh."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from lingvo.core import gshard_builder  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  before = flags.FLAGS.enable_asserts, flags.FLAGS.xla_device
  flags.FLAGS.enable_asserts = False
  builder = gshard_builder.DenseBuilder.Params().Set(
      device_mesh_shape=list(MESH.shape), num_devices=MESH.size, deterministic_dropout=True, dropout_rate=0.0,
      dtype=tf.float32, model_dim=GSHARD_MODEL, attention_num_heads=2, attention_key_value_dim=4, ff_dim=16,
      moe_hidden_dim=16, e_dim=4, c_dim=4).Instantiate()
  params = builder.EncoderLayerStack(
      "encoder", sub_layers=[builder.SelfAttention("atten"), builder.MoE("moe"), builder.DenseReluDense("ffw")],
      num=GSHARD_LAYERS, use_repeat_layer=True)
  layer = params.Instantiate()   # eagerly: Lingvo annotates weights at creation only in graph mode
  flags.FLAGS.xla_device = "tpu"   # from here on, Lingvo's FProp emits its sharding annotations
  yield layer, [v for _, v in layer.vars.FlattenItems()]
  flags.FLAGS.enable_asserts, flags.FLAGS.xla_device = before


def test_gshard_builder_repeat_layer_forward_and_gradients_match_plain_tf(gshard_encoder, rng):
  _, _, py_utils = _LINGVO
  layer, variables = gshard_encoder
  assert len(variables) == 12 * GSHARD_LAYERS + 1   # attention 5, MoE 4, dense 3 per layer; the final norm

  def loss_and_grads(x, segment_id, segment_pos):
    with tf.GradientTape() as tape:
      out = layer.FPropDefaultTheta(py_utils.NestedMap(vec=x, segment_id=segment_id, segment_pos=segment_pos,
                                                       aux_loss=tf.constant(0.0)))
      loss = tf.reduce_sum(out.vec * out.vec) + out.aux_loss
    return (out.vec, loss) + tuple(tape.gradient(loss, variables))

  x = rng.standard_normal((GSHARD_BATCH, GSHARD_LENGTH, GSHARD_MODEL)).astype(np.float32)
  segment_id = np.ones((GSHARD_BATCH, GSHARD_LENGTH), np.int32)
  segment_pos = np.tile(np.arange(GSHARD_LENGTH, dtype=np.int32), (GSHARD_BATCH, 1))
  want = tf.function(loss_and_grads)(x, segment_id, segment_pos)
  f = gs.function(loss_and_grads, mesh=MESH)
  got = f(x, segment_id, segment_pos)
  assert len(got) == len(want) == 2 + len(variables)
  for g, w, name in zip(got, want, ["vec", "loss"] + [v.name for v in variables]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)
  assert all(float(np.abs(np.asarray(w)).max()) > 1e-7 for w in want[2:])   # every gradient compared is non-zero

  low = f.lower(tf.TensorSpec(x.shape), tf.TensorSpec(segment_id.shape, tf.int32),
                tf.TensorSpec(segment_pos.shape, tf.int32))
  report = low.report
  assert report.fallbacks == ()
  assert not [w for w in report.warnings if "unknown rank" in w], report.warnings
  # Lingvo stacks each per-layer weight (encoder/stack_k) for its loops: no stacked weight is gathered for the
  # backward loop, and no weight's gradient changes layout on its way out of it
  stacked = [c for c in report.collectives if "encoder/stack" in c.reason]
  assert not stacked, [str(c) for c in stacked]
  assert sum(n.op in ("While", "StatelessWhile") for n in low.graph_def.node) == 2   # forward and its gradient
  kinds = {c.kind for c in report.collectives}
  assert "all-to-all" in kinds   # the experts' dispatch: the MoE layer's split is Lingvo's own, honoured
