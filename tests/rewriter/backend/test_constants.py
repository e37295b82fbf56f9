"""The constants pass: the per-device program's constants in the report; strict=True refuses one above 1 MiB."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import check_partitioned
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.errors import PartitionError
from tf_gspmd.rewriter.backend import constants

M8 = gs.Mesh((8,), ("d",))


def test_strict_refuses_a_two_mib_literal_constant_and_names_it(rng):
  table = rng.standard_normal((512, 1024)).astype(np.float32)   # 2 MiB of literal values: held whole everywhere
  x = rng.standard_normal((512, 1024)).astype(np.float32)

  def fn(x):
    return x + tf.constant(table, name="table")

  low = check_partitioned(fn, [x], (P("d", None),), M8, out=P("d", None))   # accepted without strict=True
  (largest, *_) = low.report.constants.largest
  assert (largest.name, largest.dtype, largest.shape, largest.bytes) == ("table", "float32", (512, 1024), 2 << 20)
  strict = gs.function(fn, mesh=M8, in_shardings=P("d", None), out_shardings=P("d", None), strict=True)
  with pytest.raises(PartitionError) as e:
    strict.lower(tf.TensorSpec([512, 1024]))
  message = str(e.value)
  assert e.value.node == "table"
  assert "float32[512,1024]" in message and "2,097,152 B" in message and "tf.fill" in message


def test_strict_accepts_a_splat_constant_of_the_same_size(rng):
  """A splat is filled per device ([64, 1024] each): nothing for strict=True to refuse."""
  x = rng.standard_normal((512, 1024)).astype(np.float32)
  fn = lambda x: x * tf.constant(np.full((512, 1024), 0.5, np.float32))   # noqa: E731
  f = gs.function(fn, mesh=M8, in_shardings=P("d", None), out_shardings=P("d", None), strict=True)
  np.testing.assert_allclose(f(x).numpy(), x * 0.5)
  assert f.lower(tf.TensorSpec([512, 1024])).report.constants.bytes < 1024


def test_constants_inside_a_loop_body_are_counted_under_the_function():
  table = np.arange(300 * 1000, dtype=np.float32).reshape(300, 1000)

  def fn(x):
    return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y + tf.constant(table, name="table")), (0, x))[1]

  low = gs.function(fn, mesh=M8, in_shardings=P("d", None), out_shardings=P("d", None)).lower(
      tf.TensorSpec([300, 1000]))
  (largest, *_) = low.report.constants.largest
  assert largest.name.endswith("/table") and largest.shape == (300, 1000) and largest.bytes == 1_200_000
  assert low.report.constants.bytes >= 1_200_000


def test_summary_totals_and_keeps_the_largest():
  nodes = [constants.ConstantNode(f"c{k}", "float32", (k,), 4 * k) for k in range(6)]
  summary = constants.summarize(nodes)
  assert summary.bytes == 60 and summary.count == 6
  assert [c.name for c in summary.largest] == ["c5", "c4", "c3"]
  assert str(summary) == ("constants: 60 B per device in 6 node(s); largest: c5 float32[5] 20 B; c4 float32[4] 16 B; "
                          "c3 float32[3] 12 B")
