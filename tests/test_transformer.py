"""A decoder-only transformer training step (GradientTape + Adam), plain TF and Keras 3, Megatron layout."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

MESH = gs.Mesh((2, 4), ("data", "model"))
CFG = tm.Config(layers=2)


def _plain():
  names = sorted(tm.param_shapes(CFG))
  specs = [tm.megatron_specs(CFG)[k] for k in names]
  step = tm.make_train_step(CFG, names)
  f = gs.function(step, mesh=MESH, in_shardings=(P(), P("data", None), P("data", None), *specs, *specs, *specs))
  return names, step, f


def test_plain_transformer_step_completes_without_fallback_and_matches():
  names, step, f = _plain()
  params = tm.init_params(CFG)
  tokens, targets = tm.synthetic_batch(CFG)
  state = [params[k] for k in names] + [np.zeros_like(params[k]) for k in names] * 2
  low = f.lower(tf.TensorSpec([], tf.int32), *[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype))
                                               for a in (tokens, targets, *state)])
  assert low.report.fallbacks == ()
  # Weights stay split: no all-gather of a Megatron-split weight.
  assert "all-gather" not in low.report.counts()
  # Per layer two activation all-reduces forward and two backward (the q, k and v input gradients summed before
  # their one all-reduce, rewriter/partition/sums.py), and the tied embedding's two gradients reduced as one.
  reduced = [c for c in low.report.collectives if c.kind == "all-reduce"]
  assert sum(c.axes == ("model",) for c in reduced) == 4 * CFG.layers
  assert sum("sum of 2 partial terms" in c.reason for c in reduced) == 1
  got = f(np.int32(0), tokens, targets, *state)
  want = step(tf.constant(0), tf.constant(tokens), tf.constant(targets), *[tf.constant(a) for a in state])
  assert_close(got[0].numpy(), want[0], rtol=1e-5)
  for g, w in zip(got[1:], want[1:]):
    assert_close(g.numpy(), w, rtol=1e-4, atol=1e-5)
  name = "l0/w1"
  assert got[1 + names.index(name)].sharding.spec == P(None, "model")


def test_keras_transformer_step_completes_without_fallback():
  keras = pytest.importorskip("keras")
  model = tm.keras_model(CFG)
  opt = keras.optimizers.Adam(1e-3)
  opt.build(model.trainable_variables)
  f = gs.function(tm.make_keras_train_step(model, opt), mesh=MESH, in_shardings=(P("data", None), P("data", None)))
  low = f.lower(*[tf.TensorSpec([CFG.batch, CFG.seq], tf.int32)] * 2)
  assert low.report.fallbacks == ()
  assert "all-gather" not in low.report.counts()
  by_handle = dict(zip(low.program.variable_names, low.program.variables))
  handle_of = {id(v): h for h, v in by_handle.items()}
  paths = [v.path for v in model.trainable_variables]
  ups = [handle_of[id(v.value)] for v in model.trainable_variables if v.path.endswith("_up/kernel")]
  assert len(ups) == CFG.layers and all(low.shardings[h].spec == P(None, "model") for h in ups)
  # Optimizer slots take their variable's sharding through the update.
  slots = [handle_of[id(s.value)] for k, path in enumerate(paths) if path.endswith("_up/kernel")
           for s in (opt._momentums[k], opt._velocities[k])]  # pylint: disable=protected-access
  assert len(slots) == 2 * CFG.layers and all(low.shardings[h].spec == P(None, "model") for h in slots)


def test_visualize():
  names, _, f = _plain()
  low = f.lower(tf.TensorSpec([], tf.int32), *[tf.TensorSpec([CFG.batch, CFG.seq], tf.int32)] * 2,
                          *[tf.TensorSpec(s) for _, s in sorted(tm.param_shapes(CFG).items())] * 3)
  text = gs.visualize_sharding(gs.Sharding.from_spec(MESH, P("data", "model")), (64, 1024), show=False)
  assert "dev 5" in text and "[32:64, 256:512]" in text
  text = low.visualize(low.program.input_names[3 + names.index("l0/w1")], show=False)
  assert "devs 0,4" in text and "[0:64, 0:64]" in text
