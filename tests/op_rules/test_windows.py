"""Strided, dilated and padded convolutions and overlapping pooling windows with a split spatial dim, forward
and both gradients: only halos move (collective-permutes; the filter gradient's partial sum is one all-reduce),
and every result equals the unpartitioned program's."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_report_counts_program, check_partitioned
import tf_gspmd as gs
from tf_gspmd import P

M24 = gs.Mesh((2, 4), ("data", "spatial"))
M8 = gs.Mesh((8,), ("x",))
M2 = gs.Mesh((2,), ("x",))
M42 = gs.Mesh((4, 2), ("rows", "cols"))
M222 = gs.Mesh((2, 2, 2), ("data", "rows", "cols"))
ROWS24 = P("data", "spatial", None, None)
RC = P(None, "rows", "cols", None)   # rows and columns both split: halos along both dims


def _conv_step(stride, padding, dilation=1, pre_pad=None):
  def step(x, w):
    with tf.GradientTape() as tape:
      tape.watch([x, w])
      h = tf.pad(x, pre_pad) if pre_pad else x
      y = tf.nn.conv2d(h, w, stride, padding, dilations=dilation)
      loss = tf.reduce_sum(tf.tanh(y) * tf.cos(y))
    dx, dw = tape.gradient(loss, [x, w])
    return y, dx, dw
  return step


def _pool_step(pool, window, stride, padding):
  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = pool(x, window, stride, padding)
      loss = tf.reduce_sum(tf.sin(y) * y)
    return y, tape.gradient(loss, x)
  return step


def _halos_only(low, filter_gradient=False):
  """Every collective is a collective-permute, but the filter gradient's partial sum (one all-reduce of the
  filter) and scalar sums; the report counts what the program sends."""
  assert_report_counts_program(low)
  assert low.report.fallbacks == () and not low.report.warnings, str(low.report)
  for c in low.report.collectives:
    if c.kind == "all-reduce":
      assert (filter_gradient and "BackpropFilter" in c.source) or c.bytes <= 8, str(low.report)
    else:
      assert c.kind == "collective-permute", str(low.report)
  if filter_gradient:
    assert low.report.counts().get("all-reduce") == 1, str(low.report)


CONVS = {
    # name: (input shape, filter shape, stride, padding, dilation)
    "stem_7x7_s2_explicit": ((2, 32, 32, 3), (7, 7, 3, 8), 2, [[0, 0], [3, 3], [3, 3], [0, 0]], 1),
    "3x3_s2_same": ((2, 32, 30, 3), (3, 3, 3, 4), 2, "SAME", 1),
    "3x3_s2_same_uneven": ((2, 30, 17, 3), (3, 3, 3, 4), 2, "SAME", 1),
    "3x3_s2_valid": ((2, 33, 16, 3), (3, 3, 3, 4), 2, "VALID", 1),
    "5x5_s3_explicit_uneven": ((2, 31, 16, 3), (5, 5, 3, 4), 3, [[0, 0], [1, 2], [2, 0], [0, 0]], 1),
    "1x1_s2": ((2, 32, 16, 3), (1, 1, 3, 4), 2, "VALID", 1),
    "2x2_s3_same": ((2, 32, 16, 3), (2, 2, 3, 4), 3, "SAME", 1),
}


@pytest.mark.parametrize("mesh,spec", [(M24, ROWS24), (M42, RC)], ids=["rows", "rows_and_columns"])
@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv_and_gradients_exchange_halos_only(rng, name, mesh, spec):
  shape, fshape, stride, padding, dilation = CONVS[name]
  x = rng.standard_normal(shape).astype(np.float32)
  w = (rng.standard_normal(fshape) * 0.3).astype(np.float32)
  low = check_partitioned(_conv_step(stride, padding, dilation), [x, w], (spec, P()), mesh, out=(spec, spec, P()),
                          tol=1e-4)
  _halos_only(low, filter_gradient=True)
  assert low.report.counts().get("collective-permute") or name == "1x1_s2", str(low.report)
  assert low.report.bytes_per_device() < int(np.prod(shape)) * 4, str(low.report)   # less than the image


DILATED = {
    "3x3_d2_same": ((2, 32, 16, 3), (3, 3, 3, 4), 1, "SAME"),
    "3x3_d2_valid": ((2, 32, 16, 3), (3, 3, 3, 4), 1, "VALID"),
    "3x3_d2_s2_explicit": ((2, 32, 16, 3), (3, 3, 3, 4), 2, [[0, 0], [2, 1], [0, 3], [0, 0]]),
    "5x5_d3_same_uneven": ((2, 30, 16, 3), (5, 5, 3, 4), 1, "SAME"),
}


@pytest.mark.parametrize("name", sorted(DILATED))
def test_dilated_conv_exchanges_halos_only(rng, name):
  """Dilations: the window spans (k-1)*d+1 rows. TF's CPU kernels compute dilated convolutions forward only,
  so the gradients are checked for what they send, not run."""
  shape, fshape, stride, padding = DILATED[name]
  dilation = 3 if name.startswith("5x5") else 2
  x = rng.standard_normal(shape).astype(np.float32)
  w = (rng.standard_normal(fshape) * 0.3).astype(np.float32)
  low = check_partitioned(lambda a, k: tf.nn.conv2d(a, k, stride, padding, dilations=dilation), [x, w],
                          (ROWS24, P()), M24, out=ROWS24, tol=1e-4)
  _halos_only(low)
  halo = (fshape[0] - 1) * dilation
  assert all(c.shape[1] <= halo for c in low.report.collectives), str(low.report)   # rows, not shards
  step = gs.function(_conv_step(stride, padding, dilation), mesh=M24, in_shardings=(ROWS24, P()),
                     out_shardings=(ROWS24, ROWS24, P()))
  _halos_only(step.lower(tf.TensorSpec(shape), tf.TensorSpec(fshape)), filter_gradient=True)


@pytest.mark.parametrize("mesh,spec", [(M8, P(None, "x", None, None)), (M8, P(None, None, "x", None)),
                                       (M24, P("data", None, "spatial", None))], ids=str)
def test_strided_conv_on_other_meshes_and_columns(rng, mesh, spec):
  x = rng.standard_normal((4, 48, 48, 3)).astype(np.float32)   # 6 rows a device, 3 result rows
  w = (rng.standard_normal((5, 5, 3, 4)) * 0.3).astype(np.float32)
  low = check_partitioned(_conv_step(2, "SAME"), [x, w], (spec, P()), mesh, out=(spec, spec, P()), tol=1e-4)
  _halos_only(low, filter_gradient=True)


def test_result_shards_drifting_from_the_input_shards_gather(rng):
  """40 rows over 8 (5 a device) through a stride-2 SAME conv: 20 result rows split 3 a device, so result
  shard t reads input rows from 6t, drifting away from input shard t (at 5t) until no neighbour holds them.
  XLA's windowed input refuses this too; the dim is gathered and the report says so."""
  x = rng.standard_normal((4, 40, 8, 3)).astype(np.float32)
  w = (rng.standard_normal((5, 5, 3, 4)) * 0.3).astype(np.float32)
  spec = P(None, "x", None, None)
  low = check_partitioned(lambda a, k: tf.nn.conv2d(a, k, 2, "SAME"), [x, w], (spec, P()), M8, out=spec, tol=1e-4)
  assert "all-gather" in low.report.counts()
  assert any("reach past the neighbouring shards" in line for line in low.report.warnings), str(low.report)


def test_pad_then_valid_stride_2_conv(rng):
  """ResNet's stem written as tf.pad then a VALID stride-2 conv: the pad needs no rows from a neighbour (its
  new rows are padding), the conv takes its halo."""
  x = rng.standard_normal((2, 32, 32, 3)).astype(np.float32)
  w = (rng.standard_normal((7, 7, 3, 8)) * 0.3).astype(np.float32)
  low = check_partitioned(_conv_step(2, "VALID", pre_pad=[[0, 0], [3, 3], [3, 3], [0, 0]]), [x, w], (ROWS24, P()),
                          M24, out=(ROWS24, ROWS24, P()), tol=1e-4)
  _halos_only(low, filter_gradient=True)


POOLS = {
    "max_3x3_s2_same": (tf.nn.max_pool2d, 3, 2, "SAME", (2, 32, 30, 3)),
    "avg_3x3_s2_same": (tf.nn.avg_pool2d, 3, 2, "SAME", (2, 32, 30, 3)),
    "max_3x3_s2_same_uneven": (tf.nn.max_pool2d, 3, 2, "SAME", (2, 29, 17, 3)),
    "avg_3x3_s2_same_uneven": (tf.nn.avg_pool2d, 3, 2, "SAME", (2, 29, 17, 3)),
    "max_3x3_s1_same": (tf.nn.max_pool2d, 3, 1, "SAME", (2, 32, 16, 3)),
    "avg_2x2_s1_same": (tf.nn.avg_pool2d, 2, 1, "SAME", (2, 32, 16, 3)),
    "max_3x3_s2_valid": (tf.nn.max_pool2d, 3, 2, "VALID", (2, 33, 16, 3)),
    "avg_5x5_s3_same": (tf.nn.avg_pool2d, 5, 3, "SAME", (2, 32, 16, 3)),
    "max_explicit": (tf.nn.max_pool2d, 3, 2, [[0, 0], [1, 0], [0, 1], [0, 0]], (2, 32, 16, 3)),
}


@pytest.mark.parametrize("mesh,spec", [(M24, ROWS24), (M42, RC)], ids=["rows", "rows_and_columns"])
@pytest.mark.parametrize("name", sorted(POOLS))
def test_overlapping_pooling_and_gradient_exchange_halos_only(rng, name, mesh, spec):
  pool, window, stride, padding, shape = POOLS[name]
  x = rng.standard_normal(shape).astype(np.float32)
  low = check_partitioned(_pool_step(pool, window, stride, padding), [x], (spec,), mesh, out=(spec, spec))
  _halos_only(low)


def test_max_pool_with_infinities_and_ties(rng):
  """-inf inputs and tied maxima across a shard boundary: the gradient goes where the unpartitioned op sends
  it (padding is selected to the lowest value, never a multiplied mask)."""
  x = np.round(rng.standard_normal((2, 32, 16, 3))).astype(np.float32)   # many ties
  x[0, 7:9, 3:5, 1] = -np.inf
  x[1, 8, 0, 0] = np.inf
  check_partitioned(_pool_step(tf.nn.max_pool2d, 3, 2, "SAME"), [x], (P(None, "x", None, None),), M8,
                    out=(P(None, "x", None, None),) * 2)


def test_conv_with_an_inf_next_to_a_shard_edge(rng):
  x = rng.standard_normal((2, 32, 16, 3)).astype(np.float32)
  x[1, 7, 5, 1] = np.inf   # the last row of shard 1 of 8: in shard 2's halo
  w = np.abs(rng.standard_normal((3, 3, 3, 4))).astype(np.float32)
  spec = P(None, "x", None, None)
  f = gs.function(lambda a, k: tf.nn.conv2d(a, k, 2, "SAME"), mesh=M8, in_shardings=(spec, P()), out_shardings=spec)
  want = tf.nn.conv2d(x, w, 2, "SAME").numpy()
  assert np.isinf(want).any() and not np.isnan(want).any()
  np.testing.assert_allclose(f(x, w).numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_window_past_the_neighbours_gathers_and_says_so(rng):
  """A 7x7 window over rows split 2 a device needs 3 rows from each side: more than a neighbour holds."""
  x = rng.standard_normal((2, 16, 8, 3)).astype(np.float32)
  w = (rng.standard_normal((7, 7, 3, 4)) * 0.3).astype(np.float32)
  spec = P(None, "x", None, None)
  low = check_partitioned(lambda a, k: tf.nn.conv2d(a, k, 1, "SAME"), [x, w], (spec, P()), M8, out=spec, tol=1e-4)
  assert "all-gather" in low.report.counts()
  assert any("reach past the neighbouring shards" in line for line in low.report.warnings), str(low.report)


def _stem(x, w):
  return tf.nn.conv2d(x, w, 2, [[0, 0], [3, 3], [3, 3], [0, 0]])


STEM = (tf.TensorSpec([8, 224, 224, 3]), tf.TensorSpec([7, 7, 3, 64]))
ROW = 8 * 224 * 3 * 4   # one input row of the stem, bytes


def test_resnet_stem_moves_halos_not_the_input():
  """ResNet's 7x7/2 stem on rows split over 2: device 1 needs input rows 109..225 (3 of device 0's), device 0
  rows -3..113 (2 of device 1's): 5 rows, XLA's 107,520 B, instead of gathering the 4.8 MB input."""
  spec = P(None, "x", None, None)
  f = gs.function(_stem, mesh=M2, in_shardings=(spec, P()), out_shardings=spec)
  low = f.lower(*STEM)
  _halos_only(low)
  assert low.report.logical_bytes_per_device() == 5 * ROW
  assert low.report.bytes_per_device() == 3 * ROW + 4   # each device sends one way, and a token the other


def test_resnet_stem_gradients_move_halos_only():
  spec = P(None, "x", None, None)

  def step(x, w):
    with tf.GradientTape() as tape:
      tape.watch([x, w])
      y = _stem(x, w)
      loss = tf.reduce_sum(y * y)
    return (y,) + tuple(tape.gradient(loss, [x, w]))

  f = gs.function(step, mesh=M2, in_shardings=(spec, P()), out_shardings=(spec, spec, P()))
  low = f.lower(*STEM)
  _halos_only(low, filter_gradient=True)
  # forward halo (reused by the filter gradient) + the input gradient's 3 rows of d_out [8,112,112,64]
  dy_row = 8 * 112 * 64 * 4
  assert low.report.logical_bytes_per_device() == 5 * ROW + 3 * dy_row + 7 * 7 * 3 * 64 * 4
  assert low.report.bytes_per_device() < 10 * ROW + 2 * dy_row + 7 * 7 * 3 * 64 * 4


def test_resnet_max_pool_moves_halos_only():
  """3x3/2 SAME max-pool of the stem's [8,112,112,64] over 2: forward 1 row; the gradient 3 input rows and 1
  row of d_out (the pooled result is recomputed from the input window, not exchanged)."""
  spec = P(None, "x", None, None)
  row = 8 * 112 * 64 * 4

  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.nn.max_pool2d(x, 3, 2, "SAME")
      loss = tf.reduce_sum(y * y)
    return y, tape.gradient(loss, x)

  fwd = gs.function(lambda x: tf.nn.max_pool2d(x, 3, 2, "SAME"), mesh=M2, in_shardings=spec, out_shardings=spec)
  low = fwd.lower(tf.TensorSpec([8, 112, 112, 64]))
  _halos_only(low)
  assert low.report.logical_bytes_per_device() == row
  low = gs.function(step, mesh=M2, in_shardings=spec, out_shardings=(spec, spec)).lower(
      tf.TensorSpec([8, 112, 112, 64]))
  _halos_only(low)
  assert low.report.logical_bytes_per_device() == row + 3 * row + row // 2


def test_an_input_whole_along_the_split_dim_is_sliced_locally(rng):
  """The conv's result rows are split but its input's are whole on every device: each device slices its
  window (halo included) from its own copy, with no exchange (the pool after it, on split rows, exchanges)."""
  x = rng.standard_normal((2, 32, 16, 3)).astype(np.float32)
  w = (rng.standard_normal((3, 3, 3, 4)) * 0.3).astype(np.float32)
  spec = P(None, "x", None, None)
  low = check_partitioned(lambda a, k: tf.nn.max_pool2d(tf.nn.conv2d(a, k, 2, "SAME"), 3, 2, "SAME"), [x, w],
                          (P(), P()), M8, out=spec, tol=1e-4)
  assert [c.source for c in low.report.collectives] == ["MaxPool2d"], str(low.report)


def test_transposed_stride_2_conv_and_gradients(rng):
  """conv2d_transpose is Conv2DBackpropInput forward (its gradients a Conv2D and a filter gradient): the same
  windows, read the other way."""
  x = rng.standard_normal((2, 16, 8, 4)).astype(np.float32)
  w = (rng.standard_normal((3, 3, 3, 4)) * 0.3).astype(np.float32)

  def step(a, k):
    with tf.GradientTape() as tape:
      tape.watch([a, k])
      y = tf.nn.conv2d_transpose(a, k, [2, 32, 16, 3], 2, "SAME")
      loss = tf.reduce_sum(tf.tanh(y) * tf.cos(y))
    return (y,) + tuple(tape.gradient(loss, [a, k]))

  low = check_partitioned(step, [x, w], (ROWS24, P()), M24, out=(ROWS24, ROWS24, P()), tol=1e-4)
  _halos_only(low, filter_gradient=True)


# ---- a pad before a convolution or pooling: one halo exchange for both ------------------------------------------
PADDED = {
    # name: (ops after the pad, pads, input shape, mesh, layout)
    "conv_3x3_uneven": (lambda h, w: tf.nn.conv2d(h, w, 1, "VALID"), [[0, 0], [1, 1], [1, 1], [0, 0]],
                        (2, 30, 9, 3), M8, P(None, "x", None, None)),
    "conv_7x7_s2_2x4": (lambda h, w: tf.nn.conv2d(h, w, 2, "VALID"), [[0, 0], [3, 3], [3, 3], [0, 0]],
                        (4, 32, 12, 3), M24, ROWS24),
    "conv_5x5_lopsided": (lambda h, w: tf.nn.conv2d(h, w, 1, "VALID"), [[0, 0], [3, 1], [2, 2], [0, 0]],
                          (2, 24, 8, 3), M8, P(None, "x", None, None)),
}


@pytest.mark.parametrize("name", sorted(PADDED))
def test_pad_then_valid_conv_takes_one_exchange(rng, name):
  """tf.pad then a VALID convolution: the conv's window reads the pad's operand directly (the pad's rows are its
  fill), so the pair sends what the same convolution with the padding as its own (EXPLICIT) sends."""
  conv, pads, shape, mesh, spec = PADDED[name]
  x = rng.standard_normal(shape).astype(np.float32)
  k = 7 if "7x7" in name else 5 if "5x5" in name else 3
  w = (rng.standard_normal((k, k, 3, 4)) * 0.3).astype(np.float32)
  low = check_partitioned(lambda a, b: conv(tf.pad(a, pads), b), [x, w], (spec, P()), mesh, out=spec, tol=1e-4)
  assert_report_counts_program(low)
  assert {c.kind for c in low.report.collectives} == {"collective-permute"}, str(low.report)
  assert {c.source for c in low.report.collectives} == {"Conv2D"}, str(low.report)
  stride = 2 if "s2" in name else 1
  explicit = gs.function(lambda a, b: tf.nn.conv2d(a, b, stride, pads), mesh=mesh, in_shardings=(spec, P()),
                         out_shardings=spec).lower(tf.TensorSpec(shape), tf.TensorSpec(w.shape))
  assert low.report.bytes_per_device() == explicit.report.bytes_per_device(), (str(low.report), str(explicit.report))


def test_zero_pad_then_max_pool_keeps_both_fills(rng):
  """tf.pad (zeros) then a SAME max-pool of negative values: the pad's rows are 0 and win the max, the pool's
  own padding is never read; one halo exchange of the pad's operand."""
  x = -np.abs(rng.standard_normal((2, 29, 7, 3))).astype(np.float32) - 1.0
  spec = P(None, "x", None, None)
  low = check_partitioned(lambda a: tf.nn.max_pool2d(tf.pad(a, [[0, 0], [2, 1], [0, 0], [0, 0]]), 3, 2, "SAME"),
                          [x], (spec,), M8, out=spec)
  assert_report_counts_program(low)
  assert {c.source for c in low.report.collectives} == {"MaxPool2d"}, str(low.report)


def test_pad_then_conv_and_its_filter_gradient_share_one_exchange(rng):
  """ResNet's stem as tf.pad then a VALID 7x7/2 conv, with gradients: the conv's window (3 rows before, 2 after,
  of the unpadded image) is exchanged once and read by the filter gradient too; the pad itself moves nothing."""
  x = rng.standard_normal((2, 32, 32, 3)).astype(np.float32)
  w = (rng.standard_normal((7, 7, 3, 8)) * 0.3).astype(np.float32)
  low = check_partitioned(_conv_step(2, "VALID", pre_pad=[[0, 0], [3, 3], [3, 3], [0, 0]]), [x, w], (ROWS24, P()),
                          M24, out=(ROWS24, ROWS24, P()), tol=1e-4)
  assert_report_counts_program(low)
  forward = [c for c in low.report.collectives if c.source == "Conv2D"]
  assert sorted(c.shape for c in forward) == [(1, 2, 32, 3), (1, 3, 32, 3)], str(low.report)
  assert not any(c.source.startswith("Pad") for c in low.report.collectives), str(low.report)
  assert [c.kind for c in low.report.collectives if "BackpropFilter" in c.source] == ["all-reduce"], str(low.report)


@pytest.mark.parametrize("reader", ["conv_same", "max_pool_same"])
def test_slice_then_windowed_op_takes_one_exchange(rng, reader):
  """Rows 3..28 of an image (rows split over 8) convolved or max-pooled with SAME padding: the op's window reads
  the image's rows directly (its padding rows, outside the slice, take the op's own fill: 0 or -inf)."""
  x = (rng.standard_normal((2, 32, 6, 3)) - 3.0).astype(np.float32)
  w = (rng.standard_normal((3, 3, 3, 4)) * 0.3).astype(np.float32)
  spec = P(None, "x", None, None)
  if reader == "conv_same":
    fn = lambda a, b: tf.nn.conv2d(a[:, 3:29], b, 1, "SAME")  # noqa: E731
  else:
    fn = lambda a, b: tf.nn.max_pool2d(a[:, 3:29], 3, 1, "SAME") + tf.reduce_sum(b)  # noqa: E731
  low = check_partitioned(fn, [x, w], (spec, P()), M8, out=spec, tol=1e-4)
  assert_report_counts_program(low)
  permutes = [c for c in low.report.collectives if c.kind == "collective-permute"]
  assert permutes and len({c.source for c in permutes}) == 1, str(low.report)
  assert "strided_slice" not in permutes[0].source, str(low.report)


# ---- rows and columns both split: halos along both dims, corners with the second exchange ----------------------
def test_batch_rows_and_columns_split_at_once(rng):
  spec = P("data", "rows", "cols", None)
  x = rng.standard_normal((4, 20, 18, 3)).astype(np.float32)
  w = (rng.standard_normal((3, 3, 3, 4)) * 0.3).astype(np.float32)
  low = check_partitioned(_conv_step(1, "SAME"), [x, w], (spec, P()), M222, out=(spec, spec, P()), tol=1e-4)
  _halos_only(low, filter_gradient=True)


def test_a_corner_comes_with_the_second_exchange(rng):
  """A 3x3 SAME conv over a (4, 2) grid of shards: each device receives its row halos, then column halos one
  row longer at each end (the corners); nothing is gathered."""
  x = rng.standard_normal((1, 16, 8, 1)).astype(np.float32)
  x[0, 3, 3, 0] = 1e3   # a corner of device (0, 0)'s shard, read by the diagonal neighbour (1, 1)
  w = np.ones((3, 3, 1, 1), np.float32)
  low = check_partitioned(lambda a, k: tf.nn.conv2d(a, k, 1, "SAME"), [x, w], (RC, P()), M42, out=RC, tol=1e-4)
  _halos_only(low)
  permutes = [c for c in low.report.collectives if c.kind == "collective-permute"]
  assert any(c.shape[1] == 4 + 2 and c.shape[2] == 1 for c in permutes), str(low.report)   # rows and corners


# ---- 3-D: a U-Net block's volume split over its three spatial dims --------------------------------------------------
VOL = P(None, "data", "rows", "cols", None)


@pytest.mark.parametrize("stride,padding", [(1, "SAME"), (2, "SAME"), (1, "VALID")], ids=str)
def test_conv3d_over_three_spatial_dims_exchanges_halos_only(rng, stride, padding):
  x = rng.standard_normal((2, 12, 10, 9, 3)).astype(np.float32)
  w = (rng.standard_normal((3, 3, 3, 3, 4)) * 0.3).astype(np.float32)

  def step(a, k):
    with tf.GradientTape() as tape:
      tape.watch([a, k])
      y = tf.nn.conv3d(a, k, [1, stride, stride, stride, 1], padding)
      loss = tf.reduce_sum(tf.tanh(y) * tf.cos(y))
    da, dk = tape.gradient(loss, [a, k])
    return y, da, dk

  low = check_partitioned(step, [x, w], (VOL, P()), M222, out=(VOL, VOL, P()), tol=1e-4)
  _halos_only(low, filter_gradient=True)
  assert "Conv3DBackpropFilterV2" in str(low.report)


@pytest.mark.parametrize("pool", [tf.nn.max_pool3d, tf.nn.avg_pool3d], ids=["max", "avg"])
def test_pool3d_over_three_spatial_dims_exchanges_halos_only(rng, pool):
  x = rng.standard_normal((2, 12, 10, 9, 3)).astype(np.float32)

  def step(a):
    with tf.GradientTape() as tape:
      tape.watch(a)
      y = pool(a, 3, 2, "SAME")
      loss = tf.reduce_sum(tf.sin(y) * y)
    return y, tape.gradient(loss, a)

  low = check_partitioned(step, [x], (VOL,), M222, out=(VOL, VOL))
  _halos_only(low)
