"""The in-process pass: on logical CPUs of one process every device's program runs as one graph whose
collectives are ordinary ops across device edges; results equal the collectives path and the unpartitioned
program."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.errors import InputError
from tf_gspmd.rewriter.one_graph import in_process
from tf_gspmd.rewriter.collectives.vocabulary import TF_COLLECTIVE_OPS

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

M8 = gs.Mesh((8,), ("d",))
M24 = gs.Mesh((2, 4), ("a", "b"))
RNG = np.random.default_rng(0)


def _normal(*shape):
  return RNG.standard_normal(shape).astype(np.float32)


def _conv(x, k):
  return tf.nn.conv1d(x, k, stride=1, padding="SAME")


# (name, fn, mesh, args, in_shardings, out_shardings, the collective kinds the report must hold)
PROGRAMS = [
    ("all-reduce sum", lambda x, w: x @ w, M24, [_normal(8, 64), _normal(64, 16)],
     (P(None, "b"), P("b", None)), None, {"all-reduce"}),
    ("all-reduce max", lambda x: tf.reduce_max(x, axis=0), M8, [_normal(64, 5)], P("d", None), None,
     {"all-reduce"}),
    ("all-gather", lambda x: x * 2.0, M8, [_normal(64, 3)], P("d", None), P(), {"all-gather"}),
    ("all-to-all", lambda x: x + 1.0, M24, [_normal(8, 16)], P("b", None), P(None, "b"), {"all-to-all"}),
    ("reduce-scatter", lambda x, w: x @ w, M24, [_normal(8, 64), _normal(64, 16)],
     (P(None, "b"), P("b", None)), P(None, "b"), {"reduce-scatter"}),
    ("size-1 axis", lambda x: x * 2.0, gs.Mesh((1, 8), ("a", "b")), [_normal(8, 16)], P("a", "b"), P(None, "b"),
     set()),   # (no collective: a group of one is its operand)
    ("halo exchange", _conv, M8, [_normal(2, 64, 3), _normal(3, 3, 4)], (P(None, "d", None), P()),
     P(None, "d", None), {"collective-permute"}),
]


@pytest.mark.parametrize("name,fn,mesh,args,ins,outs,kinds", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_each_collective_runs_in_process_with_the_collectives_results(name, fn, mesh, args, ins, outs, kinds):
  want = np.asarray(tf.function(fn)(*[tf.constant(a) for a in args]))
  got = {}
  for exchange in ("auto", "collectives"):
    f = gs.function(fn, mesh=mesh, in_shardings=ins, out_shardings=outs, exchange=exchange)
    low = f.lower(*[tf.TensorSpec(a.shape) for a in args])
    assert kinds <= set(low.report.counts()) and (kinds or not low.report.counts()), (name, low.report.counts())
    if exchange == "auto":
      graph = low.program.in_process.graph_def
      assert not [n.name for n in graph.node if n.op in TF_COLLECTIVE_OPS]
      # No variables: every node runs on the first device (the logical CPUs share the host).
      assert {n.device for n in graph.node} == {low.program.devices[0]}
    else:
      assert low.program.in_process is None
    got[exchange] = f(*args).numpy()
    np.testing.assert_allclose(got[exchange], want, rtol=1e-5, atol=1e-5, err_msg=f"{name} exchange={exchange}")
  if "all-reduce" not in kinds and "reduce-scatter" not in kinds:   # data that only moves: the same bits
    np.testing.assert_array_equal(got["auto"], got["collectives"])


def test_replicated_results_are_the_same_bits_on_every_device():
  f = gs.function(lambda x, w: x @ w, mesh=M24, in_shardings=(P(None, "b"), P("b", None)))
  out = f(_normal(8, 64), _normal(64, 16))
  comps = [c.numpy() for c in out.components]
  for c in comps[1:]:
    np.testing.assert_array_equal(c, comps[0])


def test_a_training_loop_in_process_follows_the_collectives_path():
  """Three Adam steps of a 2-layer transformer, results fed back: both paths and the unpartitioned one agree."""
  cfg = tm.Config(layers=2)
  fn, args, specs = tm.megatron_train_args(cfg)
  losses = {}
  for exchange in ("auto", "collectives", None):
    state = list(args[3:])
    f = tf.function(fn) if exchange is None else gs.function(fn, mesh=gs.Mesh((2, 4), ("data", "model")),
                                                             in_shardings=tuple(specs), exchange=exchange)
    losses[exchange] = []
    for step in range(3):
      out = tf.nest.flatten(f(np.int32(step), args[1], args[2], *state))
      losses[exchange].append(float(np.asarray(out[0])))
      state = out[1:]
  np.testing.assert_allclose(losses["auto"], losses[None], rtol=1e-4)
  np.testing.assert_allclose(losses["auto"], losses["collectives"], rtol=1e-5)
  assert losses["auto"][2] < losses["auto"][0]


@pytest.mark.parametrize("stacked", [False, True], ids=["per_device", "stacked"])
def test_variables_are_read_and_written_in_process(monkeypatch, stacked):
  """Stored per device (above the stacking limit), each device's read and write runs on its variable's device;
  stored stacked (runtime/state.py), one read and one write on the first device serve every device."""
  if not stacked:
    monkeypatch.setattr(in_process, "STACKED_VARIABLE_LIMIT", 0)
  v = tf.Variable(_normal(16, 8))
  v0, x = v.numpy(), _normal(4, 16)

  def step(x):
    y = tf.reduce_sum(x @ v)
    v.assign_sub(0.1 * tf.ones_like(v) * y)
    return y

  f = gs.function(step, mesh=M8, in_shardings=P(None, "d"))
  program = f.lower(tf.TensorSpec(x.shape)).program
  graph = program.in_process.graph_def
  touching = [n for n in graph.node if n.op in ("ReadVariableOp", "AssignVariableOp", "AssignSubVariableOp")]
  if stacked:
    assert sorted(n.op for n in touching) == ["AssignSubVariableOp", "ReadVariableOp"], touching
    assert {n.device for n in touching} == {program.devices[0]}
  else:
    assert len(touching) >= 16   # a read and a write per device, each on its variable's device
    for n in touching:
      assert n.device == program.devices[int(n.name.split("/")[0][1:])], n
  y = f(x).numpy()
  np.testing.assert_allclose(y, np.sum(x @ v0), rtol=1e-4)
  np.testing.assert_allclose(v.numpy(), v0 - 0.1 * y, rtol=1e-4, atol=1e-4)
  y2 = f(x).numpy()   # reads the written shards
  np.testing.assert_allclose(y2, np.sum(x @ (v0 - 0.1 * y)), rtol=1e-4)


def test_what_every_device_computes_alike_runs_once():
  """A replicated argument's copies are read from one device, so work on it (and on all-reduced values) is one
  node in the graph; split work is one node too, over the devices' stacked shards (rewriter/one_graph/stacking.py)."""
  def fn(x, w):
    h = tf.nn.relu(x) @ w
    return tf.math.tanh(tf.reduce_sum(h, axis=1))
  x, w = _normal(4, 16), _normal(16, 32)
  f = gs.function(fn, mesh=M8, in_shardings=(P(), P(None, "d")), out_shardings=P())
  graph = f.lower(tf.TensorSpec(x.shape), tf.TensorSpec(w.shape)).program.in_process.graph_def
  ops = [n.op for n in graph.node]
  assert ops.count("Relu") == 1 and ops.count("Tanh") == 1 and ops.count("MatMul") == 0
  assert ops.count("BatchMatMulV2") == 1
  out = f(x, w)
  np.testing.assert_allclose(out.numpy(), np.tanh(np.sum(np.maximum(x, 0) @ w, axis=1)), rtol=1e-5, atol=1e-5)
  for c in out.components:
    np.testing.assert_array_equal(c.numpy(), out.components[0].numpy())


def test_in_process_applies_only_to_cpus_of_one_process():
  f = gs.function(lambda x: tf.reduce_sum(x), mesh=M8, in_shardings=P("d"))
  assert f.lower(tf.TensorSpec([16])).program.in_process is not None
  assert f.lower(tf.TensorSpec([16]), processes=2).program.in_process is None   # planned for two hosts
  g = gs.function(lambda x: tf.reduce_sum(x), mesh=M8, in_shardings=P("d"), exchange="collectives")
  assert g.lower(tf.TensorSpec([16])).program.in_process is None


def test_exchange_must_be_auto_or_collectives():
  with pytest.raises(InputError, match="exchange"):
    gs.function(lambda x: x, mesh=M8, exchange="nccl")
