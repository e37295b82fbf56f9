"""While and If: bodies completed and partitioned as per-device functions; nested calls are inlined."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.errors import ShapeError

MESH = gs.Mesh((2, 4), ("data", "model"))


@tf.function
def _inner(x):
  return x * 2.0


def _program(x, w, n):
  def body(i, y):
    return i + 1, tf.tanh(y) @ w

  _, y = tf.while_loop(lambda i, y: i < n, body, [0, x])
  z = tf.cond(n > 2, lambda: y * 2.0, lambda: tf.reduce_sum(y, 0, keepdims=True) + y)
  return _inner(z)


@pytest.mark.parametrize("specs", [(P("data", "model"), P("model", None), P()), (P("data"), P(), P()),
                                   (P(), P(None, "model"), P())], ids=str)
def test_while_and_cond_match(rng, specs):
  x = rng.standard_normal((8, 8)).astype(np.float32)
  w = (rng.standard_normal((8, 8)) * 0.5).astype(np.float32)
  f = gs.function(_program, mesh=MESH, in_shardings=specs)
  for n in (0, 1, 3):
    assert_close(f(x, w, np.int32(n)).numpy(), _program(x, w, tf.constant(n)), rtol=1e-5, atol=1e-5)
  low = f.lower(tf.TensorSpec([8, 8]), tf.TensorSpec([8, 8]), tf.TensorSpec([], tf.int32))
  assert low.report.fallbacks == ()
  ops = {n.op for n in low.graph_def.node}
  assert ops & {"While", "StatelessWhile"} and ops & {"If", "StatelessIf"}
  assert "PartitionedCall" not in ops   # the nested tf.function was inlined


def test_loop_variable_keeps_its_layout():
  def fn(x):
    return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, tf.nn.relu(y) * 0.5), [0, x])[1]

  low = gs.function(fn, mesh=MESH, in_shardings=P("data", "model")).lower(tf.TensorSpec([8, 8]))
  loop_out = [k for k in low.shardings if k.startswith("while:")]
  assert any(low.shardings[k].spec == P("data", "model") for k in loop_out)
  assert low.report.collectives == ()


def test_annotation_inside_body_reaches_the_loop():
  def fn(x):
    def body(i, y):
      return i + 1, gs.shard(tf.tanh(y), P(None, "model"), mesh=MESH)
    return tf.while_loop(lambda i, y: i < 2, body, [0, x])[1]

  f = gs.function(fn, mesh=MESH)
  low = f.lower(tf.TensorSpec([8, 8]))
  assert low.out_shardings[0].spec == P(None, "model")
  x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
  assert_close(f(x).numpy(), fn(tf.constant(x)), rtol=1e-6)


_LOOP_SPECS = (tf.TensorSpec([], tf.int32), tf.TensorSpec([None, 16]), tf.TensorSpec([16, 16]))
_LOOP_COND = tf.function(lambda i, y, w: i < 3).get_concrete_function(*_LOOP_SPECS)


def _loop_of_unknown_output_shapes(body):
  """A While whose `output_shapes` are all unknown, as Grappler leaves a gradient loop it rebuilds."""
  body = tf.function(body).get_concrete_function(*_LOOP_SPECS)

  def fn(x, w):
    _LOOP_COND.add_to_graph()
    body.add_to_graph()
    _, y, _ = tf.raw_ops.While(input=[tf.constant(0), x, w], cond=_LOOP_COND, body=body,
                               output_shapes=[tf.TensorShape(None)] * 3)
    return y * 2.0
  return fn


def test_loop_of_unknown_output_shapes_takes_the_shapes_its_body_keeps(rng, recwarn):
  """The body keeps every loop variable's shape, so the loop's outputs have their initial values' shapes: the loop
  and what reads it are partitioned (nothing runs whole for an unknown rank)."""
  fn = _loop_of_unknown_output_shapes(lambda i, y, w: (i + 1, tf.tanh(y @ w), w))
  f = gs.function(fn, mesh=MESH, in_shardings=(P("data", None), P(None, "model")))
  x = rng.standard_normal((8, 16)).astype(np.float32)
  w = (rng.standard_normal((16, 16)) * 0.3).astype(np.float32)
  assert_close(f(x, w).numpy(), tf.function(fn)(x, w), rtol=1e-5, atol=1e-6)
  low = f.lower(tf.TensorSpec([8, 16]), tf.TensorSpec([16, 16]))
  assert low.out_shardings[0].spec == P("data", "model")
  assert low.report.fallbacks == () and not [m for m in low.report.warnings if "unknown rank" in m]
  assert not [r for r in recwarn if "unknown rank" in str(r.message)]
  assert {c.kind for c in low.report.collectives} == {"all-gather"}   # of the activation only, in the body
  assert all(c.shape == (4, 16) for c in low.report.collectives)


def test_loop_whose_body_changes_a_shape_keeps_its_unknown_rank():
  """A loop variable that grows every iteration has no shape on exit: the result is a typed error, not a guess."""
  fn = _loop_of_unknown_output_shapes(lambda i, y, w: (i + 1, tf.concat([y, y], 0), w))
  f = gs.function(fn, mesh=MESH, in_shardings=(P("data", None), P(None, "model")))
  with pytest.raises(ShapeError, match="unknown rank"):
    f.lower(tf.TensorSpec([8, 16]), tf.TensorSpec([16, 16]))


@tf.function(experimental_attributes={"_noinline": True})
def _kept_call(x, w):
  return tf.nn.relu(x @ w)


def test_call_that_is_not_inlined_is_partitioned_through_its_body(rng):
  def fn(x, w):
    return _kept_call(x, w) * 2.0

  f = gs.function(fn, mesh=MESH, in_shardings=(P("data", None), P(None, "model")))
  low = f.lower(tf.TensorSpec([8, 16]), tf.TensorSpec([16, 8]))
  assert "PartitionedCall" in {n.op for n in low.global_graph_def.node}
  assert low.out_shardings[0].spec == P("data", "model") and low.report.collectives == ()
  x = rng.standard_normal((8, 16)).astype(np.float32)
  w = rng.standard_normal((16, 8)).astype(np.float32)
  assert_close(f(x, w).numpy(), fn(x, w), rtol=1e-5)


def test_variable_created_inside_the_program_holds_one_shard_per_device(rng):
  """Each device's copy of a VarHandleOp of the program (one shared_name) is a resource of its own: in the
  in-process graph it, and what reads and writes it, is placed on its own device (on one device the copies would
  be one variable whose writes race)."""
  def fn(x):
    v = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[8, 4], shared_name="gspmd_test_local_var")
    tf.raw_ops.AssignVariableOp(resource=v, value=x * 3.0)
    return gs.shard(tf.raw_ops.ReadVariableOp(resource=v, dtype=tf.float32), P("data", "model")) + 1.0

  f = gs.function(fn, mesh=MESH, in_shardings=P("data", "model"))
  low = f.lower(tf.TensorSpec([8, 4]))
  local = [n for n in low.graph_def.node if n.op == "VarHandleOp"]
  assert [list(d.size for d in n.attr["shape"].shape.dim) for n in local] == [[4, 1]]
  if f.options.exchange == "auto":   # logical CPUs of one process: the in-process graph
    devices = [tf.DeviceSpec.from_string(d).to_string() for d in low.program.devices]
    placed = [(int(n.name.split("/")[0][1:]), tf.DeviceSpec.from_string(n.device).to_string())
              for n in low.program.in_process.graph_def.node
              if n.op in ("VarHandleOp", "AssignVariableOp", "ReadVariableOp")]
    assert len(placed) == 3 * 8 and all(device == devices[p] for p, device in placed), placed
  x = rng.standard_normal((8, 4)).astype(np.float32)
  for _ in range(3):
    assert_close(f(x).numpy(), x * 3.0 + 1.0, rtol=1e-6)


def test_split_variable_read_inside_a_loop_body(rng):
  """A split variable captured by a tf.while_loop body (Keras's sampling loop reads every weight that way) is
  read there in its stored layout: the handle carries the variable's layout into the body, nothing gathered."""
  v = tf.Variable(rng.standard_normal((4, 12, 40)).astype(np.float32))

  def step(x):
    gs.shard(v, P("model", None, "data"))

    def body(i, acc):
      return i + 1, acc + tf.reshape(v, [48, 40]) * tf.cast(i, tf.float32)
    return tf.while_loop(lambda i, a: i < 3, body, (0, x))[1]

  x = rng.standard_normal((48, 40)).astype(np.float32)
  f = gs.function(step, mesh=MESH, in_shardings=(P(),))
  assert_close(f(x).numpy(), step(tf.constant(x)).numpy(), rtol=1e-5, atol=1e-5)
  low = f.lower(tf.TensorSpec(x.shape))
  assert "all-gather" not in low.report.counts(), str(low.report)
