"""ScatterNd, TensorScatter*, UnsortedSegmentSum (split ids: partial sums and one all-reduce)."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close, check_partitioned
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))


@pytest.mark.parametrize("spec", [P(), P("data"), P(("data", "model"))], ids=str)
def test_scatter_nd_and_tensor_scatter(rng, spec):
  idx = rng.integers(0, 10, size=(8, 1)).astype(np.int32)
  upd = rng.standard_normal((8, 6)).astype(np.float32)
  base = rng.standard_normal((10, 6)).astype(np.float32)

  def fn(i, u, b):
    return tf.scatter_nd(i, u, [10, 6]), tf.tensor_scatter_nd_add(b, i, u), tf.tensor_scatter_nd_update(b, i[:1], u[:1])

  f = gs.function(fn, mesh=MESH, in_shardings=(spec, spec, P(None, "model")))
  for got, want in zip(f(idx, upd, base), fn(idx, upd, base)):
    assert_close(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [P(), P("data"), P("model")], ids=str)
def test_segment_sum(rng, spec):
  ids = rng.integers(0, 6, size=(8,)).astype(np.int32)
  data = rng.standard_normal((8, 12)).astype(np.float32)
  check_partitioned(lambda i, d: tf.math.unsorted_segment_sum(d, i, 6), [ids, data],
                    (spec, P(spec[0] if spec else None, None)), MESH)


def test_segment_sum_over_split_ids_is_partial_sum_all_reduce(rng):
  ids = rng.integers(0, 5, size=(17,)).astype(np.int32)
  data = rng.standard_normal((17, 6)).astype(np.float32)
  low = check_partitioned(lambda i, d: tf.math.unsorted_segment_sum(d, i, 5), [ids, data],
                          (P("data"), P("data", None)), MESH)
  assert low.report.counts() == {"all-reduce": 1}
