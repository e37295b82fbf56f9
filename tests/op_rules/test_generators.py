"""Fill, Range and Shape-family constants (the global shape, never the shard's)."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close, check_partitioned
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))


@pytest.mark.parametrize("spec", [P(), P("data", "model"), P(("model", "data"))], ids=str)
def test_fill_range_shape(rng, spec):
  def fn(x):
    return (x + tf.fill([8, 12], 3.0), tf.cast(tf.range(12), tf.float32) * x, x * tf.cast(tf.size(x), tf.float32),
            tf.zeros_like(x) + tf.cast(tf.shape(x)[0], tf.float32))

  x = rng.standard_normal((8, 12)).astype(np.float32)
  f = gs.function(fn, mesh=MESH, in_shardings=spec, out_shardings=spec)
  for got, want in zip(f(x), fn(x)):
    assert_close(got.numpy(), want, rtol=1e-6)


def test_shape_of_a_split_tensor_is_the_global_shape():
  low = gs.function(lambda x: tf.shape(x), mesh=MESH, in_shardings=P("data", "model")).lower(
      tf.TensorSpec([8, 12]))
  shapes = {n.op for n in low.graph_def.node}
  assert "Shape" not in shapes


# ---- Range split: each device computes its own piece --------------------------------------------------------------
# Ranges above grappler_view.LIMIT_BYTES reach the partitioner as Range ops (smaller ones are folded to constants).

def _shapes(low):
  """{op: the per-device shape of its output 0} of the per-device program."""
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(low.graph_def, name="")
  return {op.name: tuple(op.outputs[0].shape.as_list()) for op in graph.get_operations() if op.outputs}


@pytest.mark.parametrize("start,limit,delta,dtype", [
    (0, 32768, 1, tf.int32),              # even: 4096 per device
    (5, 5 + 3 * 20001, 3, tf.int32),      # uneven: 2501 per device, the last holds 2494 and padding
    (100000, 100000 - 20001, -1, tf.int64),
    (2.5, 2.5 - 0.75 * 20001, -0.75, tf.float32),
    (-1.0, 1.0, 1.0 / 16384, tf.float64),
], ids=["even", "uneven", "negative_int64", "negative_float", "float64"])
@pytest.mark.parametrize("spec", [P("d"), P(("data", "model"))], ids=str)
def test_a_split_range_is_computed_per_device(rng, start, limit, delta, dtype, spec):
  mesh = gs.Mesh((8,), ("d",)) if spec == P("d") else MESH
  n = len(np.arange(start, limit, delta))

  def fn(x):
    r = tf.range(tf.constant(start, dtype), tf.constant(limit, dtype), tf.constant(delta, dtype))
    return x * tf.cast(r, tf.float64)

  x = rng.standard_normal(n)
  low = check_partitioned(fn, [x], (spec,), mesh, out=spec, tol=1e-12)
  shapes = _shapes(low)
  assert shapes["range"] == (-(-n // 8),)   # the device's piece
  assert (n,) not in shapes.values()        # never the whole range
  assert low.report.counts() == {}
  # at most the device's own indices, which TF's optimizer may fold into a constant (a piece of the size, never n)
  assert low.report.constants.bytes <= -(-n // 8) * 8 + 1024


def test_a_split_range_holds_what_slicing_the_whole_range_holds_padding_included():
  """The values of every device's shard, padding included: 0 past the end (as a slice of the padded range)."""
  mesh = gs.Mesh((8,), ("d",))
  n = 20001
  f = gs.function(lambda: gs.shard(tf.range(7, 7 + 2 * n, 2), P("d")), mesh=mesh, out_shardings=P("d"))
  out = f()
  assert np.array_equal(out.numpy(), np.arange(7, 7 + 2 * n, 2))
  c = -(-n // 8)
  padded = np.zeros(8 * c, np.int32)
  padded[:n] = np.arange(7, 7 + 2 * n, 2)
  for p, shard in enumerate(out.components):   # the device at mesh position p holds shard p
    assert np.array_equal(shard.numpy(), padded[p * c:(p + 1) * c])

def test_a_replicated_range_stays_whole(rng):
  n = 20000
  x = rng.standard_normal(n).astype(np.float32)
  low = check_partitioned(lambda x: x + tf.cast(tf.range(n), tf.float32), [x], (P(),), MESH, tol=1e-6)
  assert _shapes(low)["range"] == (n,)
