"""Stateless random ops generated per shard, bit for bit the values of the unpartitioned op."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import check_partitioned
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.ops import random as random_rules

MESH = gs.Mesh((2, 4), ("data", "model"))
LINE = gs.Mesh((8,), ("d",))
SEED = np.array([7, 3], np.int32)

GENERATORS = {
    "uniform_f32": lambda s, seed: tf.random.stateless_uniform(s, seed=seed),
    "uniform_f64": lambda s, seed: tf.random.stateless_uniform(s, seed=seed, dtype=tf.float64),
    "normal_f32": lambda s, seed: tf.random.stateless_normal(s, seed=seed),
    "normal_f64": lambda s, seed: tf.random.stateless_normal(s, seed=seed, dtype=tf.float64),
    "truncated_f32": lambda s, seed: tf.random.stateless_truncated_normal(s, seed=seed),
    "truncated_f64": lambda s, seed: tf.random.stateless_truncated_normal(s, seed=seed, dtype=tf.float64),
    "int32": lambda s, seed: tf.random.stateless_uniform(s, seed=seed, minval=-5, maxval=1000, dtype=tf.int32),
    "int64": lambda s, seed: tf.random.stateless_uniform(s, seed=seed, minval=3, maxval=2**40, dtype=tf.int64),
    "full_int64": lambda s, seed: tf.random.stateless_uniform(s, seed=seed, minval=None, maxval=None,
                                                              dtype=tf.int64),
}

LAYOUTS = [
    (LINE, (16, 6), P("d")),                    # even leading split: one run per device
    (LINE, (10, 3, 5), P("d")),                 # uneven, 15-element rows: runs start inside a Philox group
    (MESH, (9, 7), P(("data", "model"))),       # uneven over both axes, odd rows
    (MESH, (6, 10, 3), P("data", "model")),     # two split dims: one run per leading row of the shard
    (MESH, (5, 12), P(None, "model")),          # a non-leading split: one run per row
]


def _ids(layout):
  mesh, shape, spec = layout
  return f"{mesh.shape}-{'x'.join(map(str, shape))}-{spec}"


def _random_ops(low):
  """[(op type, per-device shape of output 0)] of the stateless random ops of the per-device program."""
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(low.graph_def, name="")
  return [(op.type, tuple(op.outputs[0].shape.as_list())) for op in graph.get_operations()
          if op.type.startswith("Stateless") and op.type not in ("StatelessWhile", "StatelessIf", "StatelessCase")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
@pytest.mark.parametrize("kind", list(GENERATORS))
def test_each_device_generates_its_shard_bit_for_bit(kind, layout):
  mesh, shape, spec = layout
  gen = GENERATORS[kind]

  def fn(seed):
    return gen(shape, seed)

  low = check_partitioned(fn, [SEED], (P(),), mesh, out=spec, tol=0)
  whole = [s for op, s in _random_ops(low) if op != "StatelessRandomGetKeyCounter"]
  assert whole and shape not in whole        # generated per shard, never whole
  assert not low.report.warnings


@pytest.mark.parametrize("layout", LAYOUTS[:2] + LAYOUTS[3:4], ids=_ids)
def test_strict_accepts_them_and_the_program_holds_local_shapes(layout):
  mesh, shape, spec = layout

  def fn(seed):
    return tf.random.stateless_normal(shape, seed=seed) + tf.random.stateless_uniform(shape, seed=seed + 1)

  f = gs.function(fn, mesh=mesh, in_shardings=(P(),), out_shardings=spec, strict=True)
  assert np.array_equal(f(SEED).numpy(), fn(tf.constant(SEED)).numpy())
  low = f.lower(tf.TensorSpec([2], tf.int32))
  ops = _random_ops(low)
  assert {op for op, _ in ops} >= {"StatelessRandomNormalV2", "StatelessRandomUniformV2"}
  local = gs.Sharding.from_spec(mesh, spec, len(shape)).shard_shape(shape)
  for op, s in ops:
    if op != "StatelessRandomGetKeyCounter":
      assert s != shape and int(np.prod(s)) <= int(np.prod(local)) + 3   # at most a group's lead-in more


def test_a_constant_seed_of_a_large_output_is_generated_per_shard():
  """A seed that is a constant: an output over Grappler's folding limit stays an op, generated at its shard."""
  shape = (64, 512)

  def fn(x):
    return x + tf.random.stateless_uniform(shape, seed=[11, 12])

  x = np.zeros(shape, np.float32)
  low = check_partitioned(fn, [x], (P("data", None),), MESH, out=P("data", None), tol=0)
  ops = [s for op, s in _random_ops(low) if op == "StatelessRandomUniformV2"]
  assert ops == [(32, 512)]


@pytest.mark.parametrize("low_word", [0, 2**64 - 3, 2**64 - 1])
def test_the_counter_advances_with_a_carry_into_its_high_word(low_word):
  """The 128-bit counter (low, high uint64 words): a shard's counter past 2**64 carries into the high word."""
  shape = (64, 12)

  def fn(key, counter):
    return (tf.raw_ops.StatelessRandomUniformV2(shape=shape, key=key, counter=counter, alg=1),
            tf.raw_ops.StatelessTruncatedNormalV2(shape=shape, key=key, counter=counter, alg=1,
                                                  dtype=tf.float64))

  key = np.array([0x1234567890ABCDEF], np.uint64)
  counter = np.array([low_word, 41], np.uint64)
  check_partitioned(fn, [key, counter], (P(), P()), LINE, out=P("d"), tol=0)


def test_counter_arithmetic_tables():
  assert [random_rules.group_size(d) for d in (tf.float32, tf.float64, tf.int32, tf.int64, tf.half)] == [4, 2, 4, 2, 4]
  assert random_rules.counter_skip("StatelessTruncatedNormalV2", tf.float32) == 256
  assert random_rules.counter_skip("StatelessTruncatedNormalV2", tf.float64) == 128
  assert random_rules.counter_skip("StatelessRandomNormalV2", tf.float64) == 1
  k, runs, length = random_rules.shard_runs((5, 12), gs.Sharding.from_spec(MESH, P(None, "model"), 2), MESH.size)
  assert (k, length, runs.shape) == (1, 3, (8, 5))
  assert list(runs[1]) == [3, 15, 27, 39, 51]   # model position 1: columns 3..5 of each row


def test_a_late_split_of_many_rows_is_generated_whole_and_sliced():
  shape = (64, 16)

  def fn(seed):
    return tf.random.stateless_uniform(shape, seed=seed)

  low = check_partitioned(fn, [SEED], (P(),), MESH, out=P(None, "model"), tol=0)
  assert ("StatelessRandomUniformV2", shape) in _random_ops(low)
  assert any("generated whole" in w for w in low.report.warnings)


def test_keras_dropout_with_a_seed_matches_the_unpartitioned_layer():
  layer = keras.layers.Dropout(0.5, seed=3)
  layer.build((16, 64))

  def fn(x):
    return layer(x, training=True)

  x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
  state = layer.seed_generator.state.numpy()
  f = gs.function(fn, mesh=MESH, in_shardings=(P("data", "model"),), out_shardings=P("data", "model"), strict=True)
  got = f(x).numpy()
  layer.seed_generator.state.assign(state)
  want = tf.function(fn)(tf.constant(x)).numpy()
  assert np.array_equal(got, want)
  assert 0.3 < (got == 0).mean() < 0.7
  low = f.lower(tf.TensorSpec([16, 64], tf.float32))
  assert not low.report.warnings
  shapes = [s for op, s in _random_ops(low) if op == "StatelessRandomUniformV2"]
  assert shapes and (16, 64) not in shapes and all(int(np.prod(s)) == 16 for s in shapes)
