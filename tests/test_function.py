"""gs.function end to end on 8 logical CPUs: every result compared with the unpartitioned program."""

import warnings

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.compiler.xla.experimental import xla_sharding

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

MESH24 = gs.Mesh((2, 4), ("data", "model"))
MESH8 = gs.Mesh((8,), ("batch",))
MESH222 = gs.Mesh((2, 2, 2), ("x", "y", "z"))


def mlp(x, w1, w2):
  return tf.nn.gelu(x @ w1) @ w2


def _mlp_inputs(rng):
  x = rng.standard_normal((64, 1024), np.float32)
  w1 = (rng.standard_normal((1024, 4096)) * 0.03).astype(np.float32)
  w2 = (rng.standard_normal((4096, 1024)) * 0.03).astype(np.float32)
  return x, w1, w2


def test_mlp_megatron_matches_xla(rng):
  """Workload 1: one all-reduce f32[32,1024] over `model` = 131,072 bytes per device."""
  f = gs.function(mlp, mesh=MESH24, in_shardings=(P("data", None), P(None, "model"), P("model", None)),
                  out_shardings=P("data", None))
  args = _mlp_inputs(rng)
  low = f.lower(*[tf.TensorSpec(a.shape) for a in args])
  assert low.report.counts() == {"all-reduce": 1}
  (c,) = low.report.collectives
  assert (c.kind, c.dtype, c.shape, c.group_size, c.axes) == ("all-reduce", "float32", (32, 1024), 4, ("model",))
  assert low.report.bytes_per_device() == 131072
  assert "matmul_1" in c.source and "partial" in c.reason
  y = f(*args)
  assert isinstance(y, gs.ShardedTensor) and y.sharding == gs.Sharding.from_spec(MESH24, P("data", None))
  assert [tuple(t.shape) for t in y.components] == [(32, 1024)] * 8
  assert_close(y.numpy(), mlp(*args))


def test_data_parallel_mlp_has_no_forward_collectives(rng):
  f = gs.function(mlp, mesh=MESH8, in_shardings=(P("batch", None), P(), P()))
  args = _mlp_inputs(rng)
  assert f.lower(*[tf.TensorSpec(a.shape) for a in args]).report.collectives == ()
  y = f(*args)
  assert y.sharding.spec == P("batch", None)
  assert_close(y.numpy(), mlp(*args))


@pytest.mark.parametrize("use_sharding_op", [False, True])
def test_tf_xla_sharding_annotations_work_unchanged(rng, use_sharding_op):
  ids = MESH24.device_ids

  def annotated(x, w1, w2):
    x = xla_sharding.mesh_split(tf.identity(x), ids, [0, -1], use_sharding_op=use_sharding_op)
    w1 = xla_sharding.mesh_split(tf.identity(w1), ids, [-1, 1], use_sharding_op=use_sharding_op)
    w2 = xla_sharding.mesh_split(tf.identity(w2), ids, [1, -1], use_sharding_op=use_sharding_op)
    y = tf.nn.gelu(x @ w1) @ w2
    return xla_sharding.mesh_split(tf.identity(y), ids, [0, -1], use_sharding_op=use_sharding_op)

  f = gs.function(annotated, mesh=MESH24)
  args = _mlp_inputs(rng)
  low = f.lower(*[tf.TensorSpec(a.shape) for a in args])
  assert low.report.counts() == {"all-reduce": 1} and low.report.bytes_per_device() == 131072
  assert low.in_shardings[0].spec == P("data", None)   # completion carried the annotation to the argument
  assert_close(f(*args).numpy(), mlp(*args))


def test_gs_annotations_inside_function(rng):
  def annotated(x, w1, w2):
    x = gs.shard(x, P("data", None))
    w1 = gs.mesh_split(w1, MESH24.device_ids, [-1, 1])
    w2 = gs.shard(w2, P("model", None))
    h = tf.identity(tf.nn.gelu(x @ w1), name="h")
    return gs.shard(h @ w2, P("data", None))

  f = gs.function(annotated, mesh=MESH24)
  args = _mlp_inputs(rng)
  low = f.lower(*[tf.TensorSpec(a.shape) for a in args])
  assert low.shardings["h"].spec == P("data", "model")
  assert low.report.counts() == {"all-reduce": 1}
  assert_close(f(*args).numpy(), mlp(*args))


def _program(x, w, b):
  h = tf.nn.relu(tf.nn.bias_add(x @ w, b))
  s = tf.reduce_sum(h, axis=1, keepdims=True)
  m = tf.reduce_max(h, axis=0)
  return tf.reduce_mean(h * 0.5 + s, axis=0) + m, tf.cast(h, tf.float64) * 2.0


@pytest.mark.parametrize("mesh,specs", [
    (MESH8, (P("batch", None), P(), P())),
    (MESH8, (P(None, "batch"), P("batch", None), P())),
    (MESH24, (P("data", "model"), P("model", None), P())),
    (MESH24, (P(None, "data"), P("data", "model"), P("model"))),
    (MESH222, (P(("x", "y"), "z"), P("z", None), P())),
    (MESH222, (P("x", None), P(None, ("y", "z")), P(("y", "z")))),
], ids=str)
def test_numerical_equivalence(rng, mesh, specs):
  x = rng.standard_normal((16, 24), np.float32)
  w = rng.standard_normal((24, 40), np.float32)
  b = rng.standard_normal((40,), np.float32)
  f = gs.function(_program, mesh=mesh, in_shardings=specs)
  a, c = f(x, w, b)
  ra, rc = _program(x, w, b)
  assert_close(a.numpy(), ra, rtol=1e-4, atol=1e-4)
  assert_close(c.numpy(), rc, rtol=1e-4, atol=1e-4)


def test_uneven_workload_masks_padding(rng):
  """Workload 7: x[17,33] over 4 devices; sum(exp(x), 0) and x@w replicated -> 532 bytes per device."""
  mesh = gs.Mesh((4,), ("data",))

  def uneven(x, w):
    return tf.reduce_sum(tf.exp(x), axis=0), x @ w

  f = gs.function(uneven, mesh=mesh, in_shardings=(P("data", None), P()), out_shardings=(P(), P()))
  x = rng.standard_normal((17, 33), np.float32)
  w = rng.standard_normal((33, 5), np.float32)
  low = f.lower(tf.TensorSpec([17, 33]), tf.TensorSpec([33, 5]))
  assert low.report.counts() == {"all-reduce": 1, "all-gather": 1}
  assert sorted(c.shape for c in low.report.collectives) == [(20, 5), (33,)]
  assert low.report.bytes_per_device() == 532
  y, z = f(x, w)
  ry, rz = uneven(x, w)
  assert_close(y.numpy(), ry, rtol=1e-5)
  assert_close(z.numpy(), rz, rtol=1e-5)


@pytest.mark.parametrize("rows", [3, 13])
def test_uneven_contracting_dim_is_masked(rng, rows):
  mesh = gs.Mesh((4,), ("d",))
  f = gs.function(lambda a, b: tf.exp(a) @ tf.exp(b), mesh=mesh, in_shardings=(P(None, "d"), P("d", None)))
  a = rng.standard_normal((5, rows), np.float32)
  b = rng.standard_normal((rows, 6), np.float32)
  assert_close(f(a, b).numpy(), tf.exp(a) @ tf.exp(b), rtol=1e-5)


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
def test_inf_and_nan_in_padding_never_leak(rng, mesh_shape):
  """Padding of an uneven split holds whatever ops make of it (log(0) = -inf, 1/0 = inf, 0/0 = NaN): reductions
  and contractions over the split dim select it away, so the finite real values give finite results."""
  mesh = gs.Mesh(mesh_shape, ("a",) if len(mesh_shape) == 1 else ("a", "b"))
  spec = P(None, "a") if len(mesh_shape) == 1 else P(None, ("a", "b"))
  x = rng.uniform(0.5, 2.0, (6, 13)).astype(np.float32)          # 13 columns over 8 devices: 3 padded
  w = rng.standard_normal((13, 5)).astype(np.float32)

  def fn(a, b):
    logs, inv, nan = tf.math.log(a), 1.0 / a, a / a              # padding (zeros): -inf, inf, NaN
    return (tf.reduce_sum(logs, 1), tf.reduce_max(inv, 1), tf.reduce_min(logs, 1), tf.reduce_mean(nan, 1),
            tf.reduce_prod(nan, 1), inv @ b, tf.argmax(inv, 1), tf.nn.softmax(logs)[:, :4])

  f = gs.function(fn, mesh=mesh, in_shardings=(spec, P(spec[1], None)), out_shardings=P())
  for got, want in zip(f(x, w), fn(tf.constant(x), tf.constant(w))):
    assert np.all(np.isfinite(got.numpy()))
    assert_close(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exchange", ["auto", "collectives"])
def test_sharded_tensor_passes_back_without_moving_data(rng, exchange):
  f = gs.function(lambda x: x * 2.0, mesh=MESH24, in_shardings=P("data", "model"), exchange=exchange)
  x = rng.standard_normal((8, 8), np.float32)
  y = f(x)
  g = gs.function(lambda x: x + 1.0, mesh=MESH24, exchange=exchange)
  low = g.lower(tf.TensorSpec([8, 8]), arg_shardings=[y.sharding])
  assert low.report.collectives == () and low.in_shardings[0] == y.sharding
  exe = low.executable()
  if exchange == "auto":   # one graph for all devices: the result's own per-device tensors go in
    assert exe.components(y, y.sharding, tf.TensorSpec([8, 8]), "x") is y.components
  else:
    packed = y._packed[1]  # pylint: disable=protected-access
    assert exe.place(y, y.sharding, tf.TensorSpec([8, 8]), "x") is packed   # the result's own parallel tensor
  z = g(y)
  assert z.sharding == y.sharding
  assert_close(z.numpy(), x * 2 + 1)



def test_in_process_result_fed_to_collectives_is_packed_once(rng):
  """A value laid out by an in-process call (per-device tensors, no parallel tensor) is packed on its first call
  through TF's collectives and kept packed: the next call fed it packs nothing. The in-process graph's results
  are held by the first device; packed, each component is on its own device, where its program reads it."""
  x = rng.standard_normal((8, 8), np.float32)
  y = gs.function(lambda x: x * 2.0, mesh=MESH24, in_shardings=P("data", "model"), exchange="auto")(x)
  g = gs.function(lambda x: tf.reduce_sum(x, 0), mesh=MESH24, exchange="collectives")
  first = g(y)
  packed = y._packed  # pylint: disable=protected-access
  assert packed is not None
  held = [tf.DeviceSpec.from_string(c.device) for c in packed[0].unpack(packed[1])]
  assert held == [tf.DeviceSpec.from_string(d) for d in MESH24.resolve_devices()]
  second = g(y)
  assert y._packed is packed   # pylint: disable=protected-access
  for z in (first, second):
    assert_close(z.numpy(), (x * 2).sum(0), rtol=1e-5, atol=1e-5)
  assert_close(y.numpy(), x * 2)

def test_sharded_tensor_with_other_sharding_is_resharded_inside(rng):
  f = gs.function(lambda x: x * 2.0, mesh=MESH24, in_shardings=P("data", "model"))
  x = rng.standard_normal((8, 8), np.float32)
  y = f(x)
  g = gs.function(lambda x: x + 1.0, mesh=MESH24, in_shardings=P(), out_shardings=P())
  z = g(y)
  assert z.sharding.is_replicated
  assert_close(z.numpy(), x * 2 + 1)
  low = g.lower(tf.TensorSpec([8, 8]), arg_shardings=[y.sharding])
  assert low.report.counts() == {"all-gather": 1}   # both split dims gathered in one collective


def test_fallback_is_correct_reported_and_warned_once(rng, monkeypatch):
  from tf_gspmd.rewriter.partition import partition  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(partition, "_warned_fallback", set())   # (other tests may have met ReverseSequence first)

  def f(x):   # ReverseSequence has no rule
    return tf.reverse_sequence(tf.exp(x), [16, 9, 3, 1], seq_axis=0, batch_axis=1) * 2.0

  g = gs.function(f, mesh=MESH8, in_shardings=P("batch", None), out_shardings=P("batch", None))
  x = rng.standard_normal((16, 4), np.float32)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    low = g.lower(tf.TensorSpec([16, 4]))
  assert [op for _, op in low.report.fallbacks] == ["ReverseSequence"]
  assert any("ReverseSequence" in str(w.message) for w in caught)
  assert low.report.counts() == {"all-gather": 1}
  assert_close(g(x).numpy(), f(x))
  strict = gs.function(f, mesh=MESH8, in_shardings=P("batch", None), strict=True)
  with pytest.raises(gs.UnsupportedOpError, match=r"ReverseSequence.*strict=True"):
    strict.lower(tf.TensorSpec([16, 4]))


def test_dynamic_shape_is_a_typed_error():
  f = gs.function(lambda x: x * 2.0, mesh=MESH8)
  with pytest.raises(gs.ShapeError, match="dynamic shape"):
    f.lower(tf.TensorSpec([None, 4]))

  @tf.function
  def unique(x):
    return tf.unique(x)[0] * 2

  g = gs.function(unique, mesh=MESH8)
  with pytest.raises(gs.ShapeError, match=r"Unique.*dynamic shape.*static shapes"):
    g.lower(tf.TensorSpec([16], tf.int32))


def test_mesh_larger_than_device_count_plans_but_does_not_run(rng):
  mesh = gs.Mesh((4, 4), ("data", "model"))
  f = gs.function(mlp, mesh=mesh, in_shardings=(P("data", None), P(None, "model"), P("model", None)))
  args = _mlp_inputs(rng)
  low = f.lower(*[tf.TensorSpec(a.shape) for a in args])
  assert low.report.counts() == {"all-reduce": 1}
  with pytest.raises(gs.MeshError, match="needs 16 devices but only 8"):
    f(*args)


def test_wrong_number_of_in_shardings():
  f = gs.function(lambda a, b: a + b, mesh=MESH8, in_shardings=(P("batch"),))
  with pytest.raises(gs.InputError, match="1 entries but the function was called with 2"):
    f.lower(tf.TensorSpec([8]), tf.TensorSpec([8]))


def test_lower_of_sharded_tensors_is_the_lowering_their_call_runs(rng):
  spec = P("data", None)
  x = gs.function(lambda a: a, mesh=MESH24, in_shardings=spec, out_shardings=spec)(
      rng.standard_normal((8, 16)).astype(np.float32))
  f = gs.function(lambda a: tf.nn.relu(a) * 2.0, mesh=MESH24, in_shardings=P(None, "model"))
  low = f.lower(x)
  assert low.program.arriving_in == (x.sharding.with_rank(2),)
  got = f(x)
  assert len(f._cache) == 1 and f.lower(x) is low   # the call lowered nothing more  # pylint: disable=protected-access
  assert f.lower(tf.TensorSpec(x.shape, x.dtype)).program.arriving_in == (None,)   # a spec arrives whole
  assert_close(got.numpy(), np.maximum(x.numpy(), 0) * 2.0)


def _regression_step(v):
  """A training step of a linear model: the weight `w` passes through as an argument and a result, the bias is the
  variable `v` (updated in place)."""

  def step(x, y, w):
    with tf.GradientTape() as tape:
      tape.watch(w)
      loss = tf.reduce_mean(tf.square(x @ w + v - y))
    gw, gv = tape.gradient(loss, [w, v])
    v.assign_sub(0.1 * gv)
    return w - 0.1 * gw, loss

  return step


@pytest.mark.parametrize("exchange", ["auto", "collectives"])
def test_a_training_loop_lowers_once(rng, monkeypatch, exchange):
  """Step 0 gets the weight as a host value, later steps the ShardedTensor the step before returned (in the layout
  the program takes) and a variable the first step stored sharded: one lowering serves them all, and every call
  runs under one configuration (TF instantiates the program once; a call under other options would instantiate
  and optimize it again)."""
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  from tf_gspmd._platform import compat as _compat  # pylint: disable=g-import-not-at-top
  from tf_gspmd.rewriter import pipeline  # pylint: disable=g-import-not-at-top
  lowered, configs = [], []
  run, call_flat = pipeline.run, _compat.call_flat

  def counting_run(program):
    lowered.append(program.arriving_in)
    return run(program)

  def recording_call_flat(fn, args):
    configs.append(context.context().function_call_options.config_proto_serialized)
    return call_flat(fn, args)

  monkeypatch.setattr(pipeline, "run", counting_run)
  monkeypatch.setattr(_compat, "call_flat", recording_call_flat)
  xs = [rng.standard_normal((16, 32)).astype(np.float32) for _ in range(3)]
  ys = [rng.standard_normal((16, 8)).astype(np.float32) for _ in range(3)]
  w0 = (rng.standard_normal((32, 8)) * 0.1).astype(np.float32)
  v = tf.Variable(np.zeros(8, np.float32))
  f = gs.function(_regression_step(v), mesh=MESH24, in_shardings=(P("data", None), P("data", None), P(None, "model")),
                  out_shardings=(P(None, "model"), P()), exchange=exchange)
  v_ref = tf.Variable(np.zeros(8, np.float32))
  ref = tf.function(_regression_step(v_ref))
  w, w_ref = w0, tf.constant(w0)
  for x, y in zip(xs, ys):
    w, loss = f(x, y, w)
    w_ref, loss_ref = ref(tf.constant(x), tf.constant(y), w_ref)
    assert isinstance(w, gs.ShardedTensor)
    assert_close(loss.numpy(), loss_ref.numpy())
  assert lowered == [(None, None, None)]   # the first step's lowering ran every step
  assert_close(w.numpy(), w_ref.numpy())
  assert_close(v.numpy(), v_ref.numpy())
  assert len(configs) == 3 and len(set(configs)) == 1
  config = tf.compat.v1.ConfigProto.FromString(configs[0])
  assert config.graph_options.rewrite_options.disable_meta_optimizer   # optimized once, at lowering


def test_a_sharded_tensor_in_another_layout_is_lowered_for(rng, monkeypatch):
  """A ShardedTensor in a layout other than the one the cached program takes gets a lowering of its own."""
  from tf_gspmd.rewriter import pipeline  # pylint: disable=g-import-not-at-top
  lowered = []
  run = pipeline.run
  monkeypatch.setattr(pipeline, "run", lambda program: lowered.append(program.arriving_in) or run(program))
  x = rng.standard_normal((8, 8)).astype(np.float32)
  g = gs.function(lambda a: a + 1.0, mesh=MESH24, in_shardings=P(), out_shardings=P())
  assert_close(g(x).numpy(), x + 1)
  y = gs.function(lambda a: a * 2.0, mesh=MESH24, in_shardings=P("data", "model"))(x)
  lowered.clear()
  assert_close(g(y).numpy(), x * 2 + 1)
  assert lowered == [(y.sharding.with_rank(2),)]
  replicated = g(x)   # the result of the first lowering, in the layout it takes
  lowered.clear()
  assert_close(g(replicated).numpy(), x + 2)
  assert lowered == []


def test_lowered_inspection(rng):
  f = gs.function(mlp, mesh=MESH24, in_shardings=(P("data", None), P(None, "model"), P("model", None)))
  args = _mlp_inputs(rng)
  low = f.lower(*[tf.TensorSpec(a.shape) for a in args])
  names = {n.name for n in low.global_graph_def.node}
  assert set(low.shardings) >= names - {n for n in names if low.program.ir.node(n).outputs == ()}
  assert low.shardings["matmul"].spec == P("data", "model")
  assert "CollectiveReduceV2" in low.as_text()
  assert "matmul" in low.explain()
  assert {n.op for n in low.graph_def.node} >= {"MatMul", "CollectiveReduceV2", "Placeholder"}


def test_tf_mesh_split_directly_on_arguments(rng):
  """Attribute-form annotations land on the argument Placeholders themselves."""
  ids = MESH24.device_ids

  def annotated(x, w1, w2):
    x = xla_sharding.mesh_split(x, ids, [0, -1])
    w1 = xla_sharding.mesh_split(w1, ids, [-1, 1])
    w2 = xla_sharding.mesh_split(w2, ids, [1, -1])
    return xla_sharding.mesh_split(tf.nn.gelu(x @ w1) @ w2, ids, [0, -1])

  f = gs.function(annotated, mesh=MESH24)
  args = _mlp_inputs(rng)
  low = f.lower(*[tf.TensorSpec(a.shape) for a in args])
  assert [s.spec for s in low.in_shardings] == [P("data", None), P(None, "model"), P("model", None)]
  assert low.report.counts() == {"all-reduce": 1} and low.report.bytes_per_device() == 131072
  assert_close(f(*args).numpy(), mlp(*args))


def test_tf_function_dict_outputs_int_dtypes_and_maximal():
  @tf.function
  def g(a, b):
    return {"s": a + b, "m": tf.reduce_max(a, axis=0)}

  h = gs.function(g, mesh=MESH24, in_shardings=(gs.Sharding(MESH24, maximal=3), P("model")))
  a = np.arange(16, dtype=np.int32).reshape(4, 4)
  b = np.arange(4, dtype=np.int32)
  out = h(a, b)
  assert set(out) == {"s", "m"} and out["s"].dtype == tf.int32
  np.testing.assert_array_equal(out["s"].numpy(), a + b)
  np.testing.assert_array_equal(out["m"].numpy(), a.max(axis=0))
  assert gs.sharding_of(out["s"]) == out["s"].sharding and gs.sharding_of(a) is None


def test_indexed_slices_result_is_returned_dense(rng):
  """The gradient of a gather with respect to its table (IndexedSlices) comes back dense, repeated ids summed."""
  def grad(table, ids):
    with tf.GradientTape() as tape:
      tape.watch(table)
      loss = tf.reduce_sum(tf.gather(table, ids) ** 2)
    return {"loss": loss, "grad": tape.gradient(loss, table), "nothing": None}

  table = rng.standard_normal((16, 4)).astype(np.float32)
  ids = np.array([1, 3, 3, 15], np.int32)
  want = grad(tf.constant(table), tf.constant(ids))
  assert isinstance(want["grad"], tf.IndexedSlices)
  for specs in [(P("batch", None), P()), (P(None, "batch"), P("batch"))]:
    f = gs.function(grad, mesh=MESH8, in_shardings=specs, out_shardings=(specs[0], P()))   # grad, loss
    got = f(table, ids)
    assert got["nothing"] is None and got["grad"].sharding.spec == specs[0]
    assert_close(got["grad"].numpy(), tf.convert_to_tensor(want["grad"]))
    assert_close(got["loss"].numpy(), want["loss"])


@pytest.mark.parametrize("kind,fn,fix", [
    ("SparseTensor", lambda x: (x, tf.SparseTensor([[0, 0], [1, 2]], x[:2], [8, 8])), "tf.sparse.to_dense"),
    ("RaggedTensor", lambda x: tf.RaggedTensor.from_row_lengths(x, [2, 6]), r"x.to_tensor\(\)"),
])
def test_other_composite_results_are_a_typed_error(kind, fn, fix):
  with pytest.raises(gs.InputError, match=rf"result {1 if kind == 'SparseTensor' else 0} of .*{kind}.*{fix}"):
    gs.function(fn, mesh=MESH8, in_shardings=P("batch")).lower(tf.TensorSpec([8]))


WORDS = np.array([b"a", b"bb", b"ccc", b"", b"e", b"ff", b"g", b"hhhh"])


def test_split_string_argument_is_a_typed_error():
  f = gs.function(lambda x: tf.strings.length(x), mesh=MESH8, in_shardings=P("batch"))
  with pytest.raises(gs.InputError, match=r"argument 0 \(x\) is a string tensor laid out as P\('batch'\).*"
                                          r"pass it replicated"):
    f(WORDS)
  with pytest.raises(gs.InputError, match=r"argument 0 \(x\)"):
    f.lower(tf.TensorSpec([8], tf.string))


def test_replicated_strings_pass_through_and_feed_ops():
  def fn(x, y):
    return x, tf.strings.length(x) + y, tf.strings.join([x, x])

  f = gs.function(fn, mesh=MESH8, in_shardings=(None, P("batch")))
  y = np.arange(8, dtype=np.int32)
  for got, want in zip(f(WORDS, y), fn(tf.constant(WORDS), tf.constant(y))):
    np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_splitting_a_string_annotation_is_a_typed_error():
  f = gs.function(lambda x: tf.strings.length(gs.shard(tf.identity(x, name="w"), P("batch"), name="ws")),
                  mesh=MESH8)
  with pytest.raises(gs.SpecError, match=r"ws is a string tensor, which cannot be split"):
    f.lower(tf.TensorSpec([8], tf.string))


def test_dtype_collectives_cannot_carry_names_the_argument(rng):
  x = (rng.standard_normal(8) + 1j * rng.standard_normal(8)).astype(np.complex64)
  f = gs.function(lambda a: a * a, mesh=MESH8, in_shardings=P("batch"))   # element-wise: nothing to move
  assert_close(f(x).numpy(), x * x)
  f = gs.function(lambda a: tf.reduce_sum(a * a), mesh=MESH8, in_shardings=P("batch"))
  with pytest.raises(gs.PartitionError, match=r"complex64.*argument 0 \(a\), complex64 split as P\('batch'\).*"
                                              r"tf.math.real"):
    f.lower(tf.TensorSpec([8], tf.complex64))


OPEN_COLUMNS = {   # rows pinned to "data", columns left to completion: both spellings
    "gs.shard": lambda t: gs.shard(t, P("data", P.UNCONSTRAINED)),
    "xla_sharding": lambda t: xla_sharding.mesh_split(t, MESH24.device_ids, [0, -1], use_sharding_op=True,
                                                      unspecified_dims=[1]),
}


@pytest.mark.parametrize("spelling", sorted(OPEN_COLUMNS))
def test_open_dims_are_completed_and_honoured(rng, spelling):
  """An annotation with an open dim: the pinned dim stays, the open one is split as the program wants, and the
  partitioned step (forward and gradient) gives the unpartitioned results."""
  def step(x, w1, w2):
    with tf.GradientTape() as tape:
      tape.watch(w1)
      h = tf.identity(OPEN_COLUMNS[spelling](tf.nn.gelu(x @ w1)), name="h")
      loss = tf.reduce_sum((h @ w2) ** 2)
    return loss, tape.gradient(loss, w1)

  f = gs.function(step, mesh=MESH24, in_shardings=(None, P(None, "model"), None))
  x = rng.standard_normal((8, 16)).astype(np.float32)
  w1 = (rng.standard_normal((16, 32)) * 0.2).astype(np.float32)
  w2 = (rng.standard_normal((32, 4)) * 0.2).astype(np.float32)
  low = f.lower(*[tf.TensorSpec(a.shape) for a in (x, w1, w2)])
  assert low.shardings["h"].spec == P("data", "model")       # columns over "model" from w1; rows as annotated
  assert low.shardings["x"].spec == P("data", None) and low.shardings["w2"].spec == P("model", None)
  for got, want in zip(f(x, w1, w2), tf.function(step)(x, w1, w2)):
    assert_close(got.numpy(), want, rtol=1e-4, atol=1e-4)


def test_open_dim_after_a_contraction_emits_what_xla_emits():
  """mesh_split(h, [0, -1], unspecified_dims=[1]) on a matmul whose contraction is split: the open columns stay
  free, so the partial sum needs one all-reduce (XLA's choice), not an all-gather to replicated columns."""
  def fn(x, w):
    h = xla_sharding.mesh_split(x @ w, MESH24.device_ids, [0, -1], use_sharding_op=True, unspecified_dims=[1])
    return tf.nn.relu(h)

  f = gs.function(fn, mesh=MESH24, in_shardings=(P("data", "model"), P("model", None)))
  low = f.lower(tf.TensorSpec([8, 16]), tf.TensorSpec([16, 8]))
  assert low.report.counts() == {"all-reduce": 1}


def test_open_in_shardings_take_an_arriving_layout_that_keeps_the_pinned_dims(rng):
  f = gs.function(lambda x: x * 2.0, mesh=MESH24, in_shardings=P("data", P.UNCONSTRAINED))
  x = rng.standard_normal((8, 8)).astype(np.float32)
  assert_close(f(x).numpy(), x * 2.0)   # scattered in the completed layout
  for layout, moved in ((P("data", "model"), False), (P("model", None), True)):
    arg = gs.function(tf.identity, mesh=MESH24, in_shardings=layout)(x)
    low = f.lower(tf.TensorSpec([8, 8]), arg_shardings=(arg.sharding,))
    assert bool(low.report.collectives) == moved
    assert_close(f(arg).numpy(), x * 2.0)


def test_the_sessions_exchange_is_the_one_its_programs_take(rng, exchange):
  """`pytest --exchange=collectives` runs every gs.function left at exchange='auto' through TF's collective ops: the
  lowering holds no in-process graph, and the result is the same."""
  x = rng.standard_normal((8, 16)).astype(np.float32)
  w = rng.standard_normal((16, 4)).astype(np.float32)
  f = gs.function(lambda a, b: a @ b, mesh=gs.Mesh((2, 4), ("data", "model")),
                  in_shardings=(P(None, "model"), P("model", None)))
  np.testing.assert_allclose(f(x, w).numpy(), x @ w, rtol=1e-5, atol=1e-5)
  low = f.lower(tf.TensorSpec(x.shape), tf.TensorSpec(w.shape))
  assert (low.program.device_program.in_process is None) == (exchange == "collectives")


@pytest.mark.parametrize("value,kind,fix", [
    (lambda: tf.ragged.constant([[1.0], [2.0, 3.0]]), "RaggedTensor", "to_tensor"),
    (lambda: tf.sparse.from_dense(tf.ones([4, 4])), "SparseTensor", "tf.sparse.to_dense"),
    (lambda: {"a": tf.ones([4])}, "dict", "separate arguments"),
    (lambda: [tf.ones([4]), tf.ones([4])], "list", "separate arguments"),
    (lambda: object(), "object", "numpy array"),
], ids=["ragged", "sparse", "dict", "list", "object"])
def test_arguments_that_are_not_dense_tensors_are_typed_errors(value, kind, fix):
  f = gs.function(lambda x: x * 2.0, mesh=MESH8)
  with pytest.raises(gs.InputError, match=rf"argument 1 is a {kind}|argument 1 \({kind}\)") as e:
    f(tf.ones([8]), value())
  assert fix in str(e.value) and e.value.node == "argument 1"


def test_the_users_own_error_surfaces_unchanged():
  def own(x):
    raise KeyError("no such feature: 'age'")

  def shapes(x):
    return x + tf.ones([3])

  for fn in (own, shapes):
    with pytest.raises(Exception) as plain:
      tf.function(fn)(tf.ones([8]))
    with pytest.raises(Exception) as ours:
      gs.function(fn, mesh=MESH8)(tf.ones([8]))
    assert type(ours.value) is type(plain.value) and not isinstance(ours.value, gs.ShardingError)
    assert str(plain.value).splitlines()[-1] == str(ours.value).splitlines()[-1]
  with pytest.raises(KeyError, match="no such feature"):
    gs.function(own, mesh=MESH8).lower(tf.TensorSpec([8]))


@pytest.mark.parametrize("name", ["in_shardings", "out_shardings"])
@pytest.mark.parametrize("value", [42, 1.5, (P("batch"), 7), {"x": P()}])
def test_shardings_of_the_wrong_type_are_refused_at_construction(name, value):
  with pytest.raises(gs.InputError, match=rf"{name}=.*is not a sharding; give None.*gs\.P") as e:
    gs.function(lambda x: x, mesh=MESH8, **{name: value})
  assert e.value.node == name
  # What they accept: one spec, a tuple of specs, a spec tuple per value.
  gs.function(lambda x: x, mesh=MESH8, **{name: (P("batch"), None, ("batch", None))})


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "10", True])
def test_collective_timeout_must_be_positive_seconds(timeout):
  with pytest.raises(gs.InputError, match="collective_timeout=.*positive number") as e:
    gs.function(lambda x: x, mesh=MESH8, collective_timeout=timeout)
  assert e.value.node == "collective_timeout"


def test_memory_budget_takes_sizes_with_units():
  from tf_gspmd._function import parse_bytes  # pylint: disable=g-import-not-at-top
  assert parse_bytes("64MB", "m") == 64_000_000 and parse_bytes("2GiB", "m") == 2 << 30
  assert parse_bytes("1.5 kib", "m") == 1536 and parse_bytes(4096, "m") == 4096 and parse_bytes(" 7 ", "m") == 7
  assert parse_bytes(np.int64(5), "m") == 5 and parse_bytes(None, "m") is None
  f = gs.function(lambda x: x * 2.0, mesh=MESH24, in_shardings="auto", memory_budget="64MB")
  assert f._auto.memory_budget == 64_000_000   # pylint: disable=protected-access
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  np.testing.assert_array_equal(f(x).numpy(), x * 2.0)
  for bad in ("64 parsecs", "MB", "-3GB", "0", 0, -1.0, [64]):
    with pytest.raises(gs.InputError, match=r"memory_budget=.*\"64MB\"") as e:
      gs.function(lambda x: x, mesh=MESH24, in_shardings="auto", memory_budget=bad)
    assert e.value.node == "memory_budget"
