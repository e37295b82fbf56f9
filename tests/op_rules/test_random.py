"""Stateless random ops generated per shard, bit for bit the values of the unpartitioned op."""

import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import check_partitioned, loop_sizes, random_ops_made_whole
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


# Shards of more than MAX_RUNS runs of the flat output: uniform and ints computed in integer ops at the shard's
# groups, normals over the shard's span.
MANY_RUNS = [
    (MESH, (40, 24), P("data", "model")),                   # 2-D split: 20 rows a shard, 6-element runs
    (LINE, (33, 5, 7), P(None, "d")),                       # a middle dim split unevenly: devices 5..7 in padding
    (LINE, (20, 9), P(None, "d")),                          # 2-element runs at odd offsets (inside groups)
    (MESH, (3, 10, 6, 7), P(None, "data", None, "model")),  # 4-D, two non-leading splits, uneven last dim
    (MESH, (4, 12, 32), P("data", None, "model")),          # a Megatron FFN activation [batch, seq, 4d]
]
ALL_KINDS = {
    **GENERATORS,
    "uniform_f16": lambda s, seed: tf.random.stateless_uniform(s, seed=seed, dtype=tf.float16),
    "uniform_bf16": lambda s, seed: tf.random.stateless_uniform(s, seed=seed, dtype=tf.bfloat16),
    "normal_bf16": lambda s, seed: tf.random.stateless_normal(s, seed=seed, dtype=tf.bfloat16),
    "int32_full_range": lambda s, seed: tf.random.stateless_uniform(s, seed=seed, minval=-2**31, maxval=2**31 - 1,
                                                                    dtype=tf.int32),
    "full_int32": lambda s, seed: tf.random.stateless_uniform(s, seed=seed, minval=None, maxval=None,
                                                              dtype=tf.int32),
    "full_uint32": lambda s, seed: tf.random.stateless_uniform(s, seed=seed, minval=None, maxval=None,
                                                               dtype=tf.uint32),
    "full_uint64": lambda s, seed: tf.random.stateless_uniform(s, seed=seed, minval=None, maxval=None,
                                                               dtype=tf.uint64),
}
NORMALS = ("normal", "truncated")


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint8 if x.dtype.itemsize == 1 else f"u{x.dtype.itemsize}")


def _assert_bit_equal(got, want):
  """Equal bit for bit (so -0.0 differs from 0.0, and NaNs compare)."""
  assert got.shape == want.shape and got.dtype == want.dtype
  assert np.array_equal(_bits(got), _bits(want))


def _global_sized(low, shape):
  """The nodes of the per-device program with an output of the global element count (none when nothing of the
  global tensor is built)."""
  total = int(np.prod(shape))
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(low.graph_def, name="")
  return [(op.name, op.type) for op in graph.get_operations() for t in op.outputs
          if t.shape.rank is not None and t.shape.is_fully_defined() and t.shape.num_elements() == total]


def _partitioned(fn, args, specs, mesh, out):
  f = gs.function(fn, mesh=mesh, in_shardings=specs, out_shardings=out)
  got = f(*args)
  want = fn(*[tf.constant(a) for a in args])
  for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
    _assert_bit_equal(g.numpy(), w.numpy())
  return f.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])


@pytest.mark.parametrize("layout", MANY_RUNS, ids=_ids)
@pytest.mark.parametrize("kind", list(ALL_KINDS))
def test_a_shard_of_many_runs_is_generated_alone_bit_for_bit(kind, layout):
  mesh, shape, spec = layout
  gen = ALL_KINDS[kind]
  target = gs.Sharding.from_spec(mesh, spec, len(shape))
  assert random_rules.run_count(random_rules.shard_geometry(shape, target, mesh.size)) > random_rules.MAX_RUNS

  low = _partitioned(lambda seed: gen(shape, seed), [SEED], (P(),), mesh, spec)
  assert not low.report.warnings
  assert not _global_sized(low, shape)
  if kind.startswith(NORMALS):   # the kernel run by run in a loop: one run (and a group) at a time
    length = random_rules.shard_runs(shape, target, mesh.size)[2]
    sizes = _kernel_sizes_in_functions(low)
    assert sizes and max(sizes) <= length + random_rules.PHILOX_WORDS - 1, sizes
    return
  assert not [op for op, _ in _random_ops(low) if op != "StatelessRandomGetKeyCounter"]   # no kernel op at all


def _kernel_sizes_in_functions(low):
  """Element counts the normal kernels inside the per-device program's loops are asked for (`loop_sizes`)."""
  kernels = [n for f in low.graph_def.library.function for n in f.node_def
             if n.op in ("StatelessRandomNormalV2", "StatelessTruncatedNormalV2")]
  return loop_sizes(low.graph_def) if kernels else []


def test_a_normal_of_a_late_split_is_generated_run_by_run_not_over_its_span():
  """P(None, "model") on [64, 96]: 64 runs of 24 elements a device; no kernel op larger than a run and a group."""
  shape = (64, 96)

  def fn(seed):
    return tf.random.stateless_normal(shape, seed=seed)

  low = _partitioned(fn, [SEED], (P(),), MESH, P(None, "model"))
  assert not [op for op, _ in _random_ops(low) if op == "StatelessRandomNormalV2"]
  assert max(_kernel_sizes_in_functions(low)) == 24 + 3


@pytest.mark.parametrize("low_word", [2**64 - 3, 2**64 - 1])
def test_the_counter_carries_into_its_high_word_in_integer_ops_too(low_word):
  shape = (12, 64)

  def fn(key, counter):
    return (tf.raw_ops.StatelessRandomUniformV2(shape=shape, key=key, counter=counter, alg=1, dtype=tf.float64),
            tf.raw_ops.StatelessRandomUniformFullIntV2(shape=shape, key=key, counter=counter, alg=3,
                                                       dtype=tf.uint32),
            tf.raw_ops.StatelessTruncatedNormalV2(shape=shape, key=key, counter=counter, alg=1))

  key = np.array([0xFEDCBA0987654321], np.uint64)
  counter = np.array([low_word, 2**64 - 1], np.uint64)
  _partitioned(fn, [key, counter], (P(), P()), LINE, (P(None, "d"),) * 3)


OLDER = {
    "StatelessRandomUniform": lambda s, seed: tf.raw_ops.StatelessRandomUniform(shape=s, seed=seed),
    "StatelessRandomNormal": lambda s, seed: tf.raw_ops.StatelessRandomNormal(shape=s, seed=seed, dtype=tf.float64),
    "StatelessTruncatedNormal": lambda s, seed: tf.raw_ops.StatelessTruncatedNormal(shape=s, seed=seed),
    "StatelessRandomUniformInt": lambda s, seed: tf.raw_ops.StatelessRandomUniformInt(
        shape=s, seed=seed, minval=tf.constant(-7, tf.int64), maxval=tf.constant(2**35, tf.int64)),
    "StatelessRandomUniformFullInt": lambda s, seed: tf.raw_ops.StatelessRandomUniformFullInt(
        shape=s, seed=seed, dtype=tf.int32),
}


@pytest.mark.parametrize("layout", [LAYOUTS[1], LAYOUTS[3], MANY_RUNS[0], MANY_RUNS[2]], ids=_ids)
@pytest.mark.parametrize("op", list(OLDER))
def test_the_older_ops_of_a_seed_are_generated_per_shard(op, layout):
  mesh, shape, spec = layout
  low = _partitioned(lambda seed: OLDER[op](shape, seed), [SEED.astype(np.int64)], (P(),), mesh, spec)
  assert shape not in [s for _, s in _random_ops(low)]
  assert op not in [t for t, _ in _random_ops(low)]   # the V2 form, at the seed's key and counter


def test_bounds_out_of_order_fail_as_the_kernel_does():
  shape = (40, 24)

  def fn(seed, lo, hi):
    return tf.random.stateless_uniform(shape, seed=seed, minval=lo, maxval=hi, dtype=tf.int32)

  f = gs.function(fn, mesh=MESH, in_shardings=(P(), P(), P()), out_shardings=P("data", "model"))
  assert np.array_equal(f(SEED, np.int32(3), np.int32(9)).numpy(), fn(SEED, np.int32(3), np.int32(9)).numpy())
  with pytest.raises(tf.errors.InvalidArgumentError, match="minval < maxval"):
    f(SEED, np.int32(9), np.int32(9))


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16, tf.float16])
def test_dropout_of_a_megatron_activation_split_over_its_last_dim_builds_nothing_global(dtype):
  """[batch, seq, 4d] split over (data, model) on batch and 4d: 48 runs a shard, each device draws only its own
  keep mask."""
  shape = (4, 24, 64)

  def fn(x, seed):
    return tf.nn.experimental.stateless_dropout(x, rate=0.25, seed=seed)

  x = np.random.default_rng(1).standard_normal(shape).astype(dtype.as_numpy_dtype)
  low = _partitioned(fn, [x, SEED], (P("data", None, "model"), P()), MESH, P("data", None, "model"))
  assert not low.report.warnings
  assert not _global_sized(low, shape)


def test_a_draw_of_many_runs_in_a_loop_body_is_generated_per_shard_each_iteration():
  shape = (40, 24)

  def fn(x, seed):
    def body(i, acc):
      noise = tf.random.stateless_uniform(shape, seed=seed + i) + tf.random.stateless_normal(shape, seed=seed - i)
      return i + 1, acc + noise
    return tf.while_loop(lambda i, _: i < 3, body, (tf.constant(0), x))[1]

  x = np.zeros(shape, np.float32)
  spec = P("data", "model")
  _partitioned(fn, [x, SEED], (spec, P()), MESH, spec)


# ---- whole programs: no split random value is generated whole on a device ------------------------------------

def _oracle_program(name):
  tools = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools")
  if tools not in sys.path:
    sys.path.insert(0, tools)
  import oracle_programs  # pylint: disable=g-import-not-at-top
  job = oracle_programs.PROGRAMS[name]()
  f = gs.function(job.fn, mesh=job.mesh, in_shardings=job.in_specs, out_shardings=job.out_specs)
  return f.lower(*[tf.TensorSpec(a.shape, a.dtype) for a in job.args])


def _transformer_step(layout):
  """The transformer binary's Keras step with --dropout (on each MLP's hidden activation) in `layout`."""
  import keras  # pylint: disable=g-import-not-at-top
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  cfg = tm.Config(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=8, dropout=0.1)
  keras.utils.set_random_seed(0)
  model = tm.keras_model(cfg, activations=tm.ACTIVATIONS_2D if layout == "2d" else None)
  optimizer = keras.optimizers.Adam(1e-3)
  optimizer.build(model.trainable_variables)
  f = gs.function(tm.make_keras_train_step(model, optimizer, layout=layout), mesh=gs.Mesh((2, 4), ("data", "model")),
                  in_shardings=(P("data", None), P("data", None)))
  tokens, targets = tm.synthetic_batch(cfg)
  return f.lower(tf.TensorSpec(tokens.shape, tf.int32), tf.TensorSpec(targets.shape, tf.int32))


@pytest.mark.parametrize("program", ["oracle:megatron_dropout", "oracle:mlp_2d_dropout", "binary:megatron",
                                     "binary:2d"])
def test_no_device_draws_a_split_random_value_at_its_global_size(program):
  """The oracle's dropout programs and the transformer binary's step with --dropout in both layouts: no device runs
  a random kernel over a split random value's global element count (tests/differential checks its generated
  programs alike; tools/xla_oracle.py and the binary's check compare the results with the unpartitioned ones)."""
  kind, name = program.split(":")
  low = _oracle_program(name) if kind == "oracle" else _transformer_step(name)
  split, whole = random_ops_made_whole(low)
  assert split   # the program draws random values the plan splits
  assert not whole, whole
