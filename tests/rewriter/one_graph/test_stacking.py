"""Stacking in the one graph of every device's program: the devices' copies of an op run as one op over a leading
device dimension (rules per op family, collectives as group gathers, replicated reads once); results equal the
unpartitioned program and TF's collectives path."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.graph import graph_view
from tf_gspmd.rewriter.one_graph import in_process
from tf_gspmd.runtime.state import storage_of

M8 = gs.Mesh((8,), ("d",))
M24 = gs.Mesh((2, 4), ("a", "b"))
RNG = np.random.default_rng(1)


def _normal(*shape):
  return RNG.standard_normal(shape).astype(np.float32)


def _graph(f, *args):
  return f.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args]).program.in_process.graph_def


def _ops(graph):
  return [n.op for n in graph.node]


def _both_paths(fn, mesh, args, ins, outs=None):
  """Results of `fn` through the one graph and through TF's collectives, checked against the unpartitioned."""
  want = tf.nest.map_structure(np.asarray, tf.function(fn)(*[tf.constant(a) for a in args]))
  got = {}
  for exchange in ("auto", "collectives"):
    f = gs.function(fn, mesh=mesh, in_shardings=ins, out_shardings=outs, exchange=exchange)
    got[exchange] = tf.nest.map_structure(lambda t: np.asarray(t.numpy()), f(*args))
    tf.nest.map_structure(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5), got[exchange], want)
  return got


def test_a_split_layer_runs_as_one_op_over_the_devices():
  def fn(x, w1, w2):
    h = tf.nn.relu(x @ w1)
    return tf.reduce_sum(tf.nn.softmax(h @ w2, axis=-1) * 3.0, axis=0)
  args = [_normal(8, 16), _normal(16, 32), _normal(32, 12)]
  ins = (P("a", None), P(None, "b"), P("b", None))
  f = gs.function(fn, mesh=M24, in_shardings=ins)
  ops = _ops(_graph(f, *args))
  # one BatchMatMulV2 per matmul of the per-device program, not one MatMul per device
  assert ops.count("MatMul") == 0 and ops.count("BatchMatMulV2") == 2, ops
  assert ops.count("Relu") == 1 and ops.count("Softmax") == 1
  _both_paths(fn, M24, args, ins)


# Collectives over each axis of (2, 4): over "a" a group's members are not neighbours in mesh order.
COLLECTIVES = [
    ("all-reduce sum over b", lambda x, w: x @ w, [_normal(8, 64), _normal(64, 16)], (P(None, "b"), P("b", None)),
     None),
    ("all-reduce sum over a", lambda x, w: x @ w, [_normal(8, 64), _normal(64, 16)], (P(None, "a"), P("a", None)),
     None),
    ("all-reduce max over a", lambda x: tf.reduce_max(x, axis=0), [_normal(64, 5)], P("a", None), None),
    ("all-gather over a", lambda x: x * 2.0, [_normal(64, 3)], P("a", None), P()),
    ("all-gather over both", lambda x: x * 2.0, [_normal(64, 3)], P(("a", "b"), None), P()),
    ("all-to-all over b", lambda x: x + 1.0, [_normal(8, 16)], P("b", None), P(None, "b")),
    ("all-to-all over a", lambda x: x + 1.0, [_normal(8, 16, 2)], P("a", None, None), P(None, "a", None)),
]


@pytest.mark.parametrize("name,fn,args,ins,outs", COLLECTIVES, ids=[c[0] for c in COLLECTIVES])
def test_collectives_run_over_the_device_dimension(name, fn, args, ins, outs):
  f = gs.function(fn, mesh=M24, in_shardings=ins, out_shardings=outs)
  graph = _graph(f, *args)
  # the collective is one set of ops on the stacked operand: no device's copy of it
  emitted = set(f.lower(*[tf.TensorSpec(a.shape) for a in args]).report.counts())
  assert emitted, name
  copies = [n.name for n in graph.node if n.name.startswith("d") and "gspmd/all" in n.name]
  assert not copies, (name, copies[:4])
  if "all-to-all" in name:   # one gather moves every member's chunks to the devices that take them
    exchange = [n.op for n in graph.node if n.name.startswith("stkh/") and "all_to_all" in n.name]
    assert exchange.count("GatherV2") == 1 and "Transpose" not in exchange, exchange
  got = _both_paths(fn, M24, args, ins, outs)
  if "reduce" not in name:   # data that only moves: the same bits on both paths
    np.testing.assert_array_equal(got["auto"], got["collectives"])


def test_a_small_variable_is_stored_stacked_and_read_and_written_in_one_op():
  v = tf.Variable(_normal(16, 8))
  w = tf.Variable(_normal(8, 8))
  v0, w0, x = v.numpy(), w.numpy(), _normal(4, 16)

  def step(x):
    y = tf.reduce_sum(x @ v @ w)
    v.assign_sub(0.01 * tf.ones_like(v) * y)
    return y

  f = gs.function(step, mesh=M8, in_shardings=P("d", None))
  graph = _graph(f, x)
  reads = [n for n in graph.node if n.op == "ReadVariableOp"]
  writes = [n for n in graph.node if n.op == "AssignSubVariableOp"]
  # one read of each variable's stack for every device (v's row 0 stands for its replicated value), one write
  assert len(reads) == 2 and len(writes) == 1, ([n.name for n in reads], len(writes))
  handles = [n for n in graph.node if n.op == "Placeholder" and n.attr["dtype"].type == tf.resource.as_datatype_enum]
  assert len(handles) == 2, [n.name for n in handles]
  y = f(x).numpy()
  np.testing.assert_allclose(y, np.sum(x @ v0 @ w0), rtol=1e-4)
  np.testing.assert_allclose(v.numpy(), v0 - 0.01 * y, rtol=1e-4, atol=1e-4)
  y2 = f(x).numpy()   # every device's copy was written: device 0 reads the new value
  np.testing.assert_allclose(y2, np.sum(x @ (v0 - 0.01 * y) @ w0), rtol=1e-4)
  storage = storage_of(v)
  assert storage.stacked and storage.stack.shape == (8, 16, 8)
  copies = [c.read_value().numpy() for c in storage.components]
  assert len(copies) == 8
  for c in copies:
    np.testing.assert_array_equal(c, copies[0])


def test_a_variable_another_op_takes_stays_per_device():
  """tf.gather on a variable takes its handle (ResourceGather): it is stored one per device, and the other
  variable of the step, only read and written whole, is stacked."""
  table = tf.Variable(_normal(32, 16))
  w = tf.Variable(_normal(16, 4))
  t0, w0 = table.numpy(), w.numpy()
  ids = np.array([[1, 5], [7, 30], [2, 2], [0, 31]], np.int32)

  def step(ids):
    gs.shard(table, P(None, "d"))
    y = tf.reduce_sum(tf.gather(table, ids) @ w)
    w.assign_add(0.01 * tf.ones_like(w) * y)
    return y

  f = gs.function(step, mesh=M8, in_shardings=P())
  graph = _graph(f, ids)
  assert _ops(graph).count("ResourceGather") == 8 and _ops(graph).count("AssignAddVariableOp") == 1
  y = f(ids).numpy()
  np.testing.assert_allclose(y, np.sum(t0[ids] @ w0), rtol=1e-4)
  np.testing.assert_allclose(w.numpy(), w0 + 0.01 * y, rtol=1e-4, atol=1e-4)
  assert storage_of(w).stacked and not storage_of(table).stacked


def test_a_variable_alternates_between_stacked_and_per_device_storage():
  """One variable trained by a step run as one graph (stored stacked) and by the same step through TF's
  collectives (stored per device): each call converts it on the devices and continues from the other's value."""
  v = tf.Variable(_normal(16, 8))
  x = _normal(4, 16)
  want = v.numpy()

  def step(x):
    v.assign_sub(0.01 * tf.ones_like(v) * tf.reduce_sum(x @ v))
    return tf.reduce_sum(v)

  fs = {e: gs.function(step, mesh=M8, in_shardings=P("d", None), exchange=e) for e in ("auto", "collectives")}
  for exchange in ("auto", "collectives", "auto", "auto", "collectives"):
    want = want - 0.01 * np.sum(x @ want)
    got = fs[exchange](x).numpy()
    assert storage_of(v).stacked == (exchange == "auto")
    np.testing.assert_allclose(got, np.sum(want), rtol=1e-4)
  np.testing.assert_allclose(v.numpy(), want, rtol=1e-4, atol=1e-4)
  v.assign(np.zeros((16, 8), np.float32))   # an eager write reaches whichever storage the next step uses
  np.testing.assert_allclose(fs["auto"](x).numpy(), 0.0)
  np.testing.assert_allclose(fs["collectives"](x).numpy(), 0.0)


def test_an_op_without_a_rule_runs_per_device_between_packs():
  def fn(x):
    top = tf.math.top_k(x * 2.0, k=3).values   # TopKV2: no stacking rule
    return tf.nn.relu(top) + 1.0
  args = [_normal(16, 10)]
  f = gs.function(fn, mesh=M8, in_shardings=P("d", None))
  ops = _ops(_graph(f, *args))
  assert ops.count("TopKV2") == 8 and ops.count("Mul") == 1 and ops.count("Relu") == 1, ops
  assert ops.count("Unpack") >= 1 and ops.count("Pack") >= 1
  _both_paths(fn, M8, args, P("d", None))


def test_uneven_and_sliced_shards_follow_the_rules():
  """Slices, pads, concatenations, gathers, reshapes and reductions over a stacked dimension, on a layout that
  pads (10 rows over 4 devices)."""
  def fn(x, idx):
    y = tf.concat([x[:, 1:], x[:, :1] * 2.0], axis=1)
    y = tf.pad(y, [[0, 0], [1, 2]]) + tf.reduce_mean(y, axis=1, keepdims=True)
    g = tf.gather(y, idx, axis=1)
    return tf.reshape(tf.transpose(g), [-1]), tf.reduce_max(tf.expand_dims(y, 1), axis=[1, 2])
  args = [_normal(10, 6), np.array([0, 3, 8, 5], np.int32)]
  _both_paths(fn, M24, args, (P("b", None), P()))


def test_reads_and_writes_of_one_shape_cross_between_devices_together(monkeypatch):
  """Three split variables of one shape (a weight and two moments, as an optimizer keeps them) stored per device
  (as a variable above the stacking limit is): each device's reads reach the first device as one tensor, and the
  written values come back as one."""
  monkeypatch.setattr(in_process, "STACKED_VARIABLE_LIMIT", 0)
  w, m, s = (gs.variable(k, (16, 8), mesh=M8, spec=P("d", None), seed=k) for k in (0.5, 0.1, 1.0))
  w0, m0, s0, x = w.numpy(), m.numpy(), s.numpy(), _normal(4, 16)

  def step(x):
    g = tf.ones_like(w) * tf.reduce_sum(x @ w)
    m.assign(0.9 * m + g)
    s.assign(0.5 * s + g * g)
    w.assign_sub(0.01 * m / (tf.sqrt(s) + 1.0))
    return tf.reduce_sum(w)

  f = gs.function(step, mesh=M8, in_shardings=P())
  graph = _graph(f, x)
  nodes = {n.name: n for n in graph.node}
  crossing = [(nodes[i.lstrip("^").split(":")[0]].op, n.op) for n in graph.node for i in n.input
              if i.lstrip("^").split(":")[0] in nodes and nodes[i.lstrip("^").split(":")[0]].device != n.device]
  reads = [n for n in graph.node if n.op == "ReadVariableOp"]
  assert len(reads) >= 3 * 8
  assert len(crossing) < len(reads), crossing   # not one crossing per read
  y = f(x).numpy()
  g = np.ones_like(w0) * np.sum(x @ w0)
  m1, s1 = 0.9 * m0 + g, 0.5 * s0 + g * g
  w1 = w0 - 0.01 * m1 / (np.sqrt(s1) + 1.0)
  np.testing.assert_allclose(m.numpy(), m1, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(s.numpy(), s1, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(w.numpy(), w1, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(y, np.sum(w1), rtol=1e-4)


@pytest.mark.parametrize("stacked", [False, True], ids=["per_device", "stacked"])
def test_groups_that_would_close_a_cycle_fall_back_to_one_crossing_per_value(monkeypatch, stacked):
  """Y and X are each written and read back at one level (their reads join); X's and Z's writes sit at one height
  (they join), and Z is written from Y's read: X's write would wait for Z's value, which waits for the joined
  reads, one of which waits for X's write. The graph is built again without groups, and results hold. Stored
  stacked, each read and write is one op for every device, ordered as the per-device program orders them."""
  if not stacked:
    monkeypatch.setattr(in_process, "STACKED_VARIABLE_LIMIT", 0)
  x_var, y_var, z_var = (gs.variable(0.0, (16, 4), mesh=M8, spec=P("d", None)) for _ in range(3))

  def step(x):
    y_var.assign(x * 2.0)
    a = y_var.read_value()
    x_var.assign(x * 3.0)
    b = x_var.read_value()
    z_var.assign(a + 1.0)
    return tf.identity(b), tf.identity(z_var.read_value())

  f = gs.function(step, mesh=M8, in_shardings=P("d", None), out_shardings=(P("d", None), P("d", None)))
  x = np.arange(64, dtype=np.float32).reshape(16, 4)
  graph = _graph(f, x)
  assert not [n.name for n in graph.node if n.name.startswith(("stk_reads/", "stk_writes/"))]
  assert _ops(graph).count("ReadVariableOp") == 3 * (1 if stacked else 8)
  assert _ops(graph).count("AssignVariableOp") == 3 * (1 if stacked else 8)
  b, c = f(x)
  np.testing.assert_array_equal(b.numpy(), x * 3.0)
  np.testing.assert_array_equal(c.numpy(), x * 2.0 + 1.0)
  np.testing.assert_array_equal(z_var.numpy(), x * 2.0 + 1.0)


def test_large_tensors_stay_per_device():
  """Above STACK_LIMIT elements per device a copy into a stacked tensor costs more than the ops it saves: a
  layer of 256 x 512 per-device activations and its all-reduce run per device, as before stacking."""
  from tf_gspmd.rewriter.one_graph import stacking  # pylint: disable=g-import-not-at-top
  def fn(x, w):
    return tf.nn.relu(x @ w)
  args = [_normal(256, 64), _normal(64, 512)]
  assert 256 * 512 > stacking.STACK_LIMIT
  f = gs.function(fn, mesh=M8, in_shardings=(P(None, "d"), P("d", None)), out_shardings=P())
  ops = _ops(_graph(f, *args))
  assert ops.count("MatMul") == 8 and ops.count("BatchMatMulV2") == 0 and "Pack" not in ops, ops
  assert ops.count("AddN") == 1   # the all-reduce: one sum that every device reads
  _both_paths(fn, M8, args, (P(None, "d"), P("d", None)), P())


# ---- every rule's one-graph form --------------------------------------------------------------------------------

def test_every_form_a_rule_states_has_a_method_that_writes_it():
  from tf_gspmd.ops import registry  # pylint: disable=g-import-not-at-top
  from tf_gspmd.rewriter.one_graph import stacking_rules  # pylint: disable=g-import-not-at-top
  stated = {op: registry.lookup(op).stacked_form(op) for op in registry.registered_ops()}
  unknown = {op: f for op, f in stated.items() if f is not None and f not in registry.STACKED_FORMS}
  assert not unknown, f"forms not in ops/registry.STACKED_FORMS: {unknown}"
  missing = [f for f in sorted(registry.STACKED_FORMS) if not hasattr(stacking_rules.Rules, f"_stack_{f}")]
  assert not missing, f"forms without a Rules._stack_<form> method: {missing}"
  assert stated["MatMul"] == "matmul" and stated["ResourceGather"] is None and stated["BatchMatMul"] is None


def _elementwise_ops():
  from tf_gspmd.ops import registry  # pylint: disable=g-import-not-at-top
  return [op for op in registry.registered_ops() if registry.lookup(op).elementwise]


_TYPES = (tf.float32, tf.int32, tf.bool, tf.complex64)


def _elementwise_case(op):
  """(dtype, number of operands, extra attrs, scalar operands after the first) of element-wise `op`, for a call
  through tf.raw_ops with operands of one dtype."""
  from tf_gspmd._platform import compat  # pylint: disable=g-import-not-at-top
  od = compat.op_def(op)
  attrs = {a.name: a for a in od.attr}
  type_attr = od.input_arg[0].type_attr
  allowed = [tf.as_dtype(t) for t in attrs[type_attr].allowed_values.list.type] if type_attr in attrs else []
  if od.input_arg[0].type:   # a fixed type (LogicalAnd's bool)
    allowed = [tf.as_dtype(od.input_arg[0].type)]
  dtype = next(t for t in _TYPES if not allowed or t in allowed)
  extra = {"DstT": tf.float64} if op == "Cast" else {"message": "checked"} if op == "CheckNumerics" else {}
  n = 2 if od.input_arg[0].number_attr else len(od.input_arg)
  return dtype, n, extra, op == "ClipByValue", [a.name for a in od.input_arg]


def _value(dtype, shape, low=0.2, high=0.8):
  if dtype == tf.bool:
    return RNG.random(shape) > 0.5
  if dtype.is_integer:
    return RNG.integers(1, 4, shape).astype(dtype.as_numpy_dtype)
  if dtype.is_complex:
    return (RNG.uniform(low, high, shape) + 1j * RNG.uniform(low, high, shape)).astype(dtype.as_numpy_dtype)
  return RNG.uniform(low, high, shape).astype(dtype.as_numpy_dtype)


@pytest.mark.parametrize("dtype", _TYPES, ids=lambda t: t.name)
def test_every_registered_elementwise_op_stacks(dtype):
  """Each op its rule in ops/ calls element-wise, on operands split over the devices, runs once over the device
  dimension in the one graph (or is optimized away), never once per device; results equal TF's."""
  cases = {op: _elementwise_case(op) for op in _elementwise_ops()}
  cases = {op: c for op, c in cases.items() if c[0] == dtype}
  assert cases or dtype == tf.complex64
  if not cases:
    return
  n_args = max(c[1] for c in cases.values())
  args = [_value(dtype, (8, 3)) for _ in range(n_args)] + [_value(dtype, (), 0.3, 0.4), _value(dtype, (), 0.6, 0.7)]

  def fn(*xs):
    out = {}
    for op, (_, n, extra, scalars, names) in cases.items():
      operands = [xs[0], xs[-2], xs[-1]] if scalars else list(xs[:n])
      given = {names[0]: operands} if len(names) == 1 and n > 1 else dict(zip(names, operands))   # AddN's list
      out[op] = getattr(tf.raw_ops, op)(**given, **extra)
    return out

  ins = tuple([P("d", None)] * n_args + [P(), P()])
  f = gs.function(fn, mesh=M8, in_shardings=ins)
  graph = f.lower(*[tf.TensorSpec(a.shape, dtype) for a in args]).program.in_process.graph_def
  # An op TF marks stateful keeps its side effect on each device (of these, only CheckNumerics).
  stateful = {op for op in cases if graph_view.is_stateful(op)}
  assert stateful <= {"CheckNumerics"}, stateful
  per_device = sorted({n.op for n in graph.node if n.op in set(cases) - stateful and not n.name.startswith("stk")})
  assert not per_device, f"element-wise ops that run once per device in the one graph: {per_device}"
  stacked = {n.op for n in graph.node if n.name.startswith("stk/")}
  assert stacked & set(cases), "no element-wise op was stacked"
  want = tf.function(fn)(*[tf.constant(a) for a in args])
  got = f(*args)
  for op in cases:
    np.testing.assert_allclose(np.asarray(got[op].numpy()), np.asarray(want[op]), rtol=1e-5, atol=1e-6,
                               err_msg=op)
