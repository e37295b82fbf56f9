"""Slice, StridedSlice (new axes, ellipsis, shrunk dims), its gradient, and pads: split dims take windows."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close, assert_report_counts_program, check_partitioned
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))
SPECS = [P(), P("data", "model"), P("model", None), P(None, ("data", "model"))]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_slices_and_pads(rng, spec):
  def fn(a):
    return (tf.slice(a, [0, 2], [8, 5]), a[:, 3:9], a[1], a[2:6, :], tf.pad(a, [[1, 2], [0, 0]]),
            tf.pad(a, [[0, 0], [3, 1]], constant_values=2.0))

  check_partitioned(fn, [rng.standard_normal((8, 12)).astype(np.float32)], (spec,), MESH)


def test_slices_and_pads_keep_the_operand_layout():
  def fn(a):
    return tf.identity(a[:, 3:9], name="s"), tf.identity(tf.pad(a, [[1, 1], [0, 0]]), name="p")

  low = gs.function(fn, mesh=MESH, in_shardings=P("data", "model")).lower(tf.TensorSpec([8, 12]))
  # GSPMD's rule: slices and pads keep the operand's layout (split dims take windows with halos).
  assert low.shardings["s"].spec == P("data", "model")
  assert low.shardings["p"].spec == P("data", "model")


@pytest.mark.parametrize("mesh_shape,spec,shape", [((4,), P("d", None), (17, 6)), ((8,), P("d", None), (16, 6)),
                                                   ((2, 4), P("b", "a"), (12, 6)), ((8,), P(None, "d"), (5, 24))],
                         ids=str)
def test_windowed_pad_and_slices_match(rng, mesh_shape, spec, shape):
  """Pad / Slice / StridedSlice along a split dim: halos from neighbours, or a gather when too far."""
  mesh = gs.Mesh(mesh_shape, ("d",) if len(mesh_shape) == 1 else ("a", "b"))
  x = rng.standard_normal(shape).astype(np.float32)
  n0, n1 = shape

  def fn(t):
    e = tf.exp(t)
    return (tf.pad(e, [[1, 2], [0, 1]], constant_values=3.0), tf.slice(e, [2, 1], [n0 - 3, n1 - 1]), e[1:-1],
            e[:, 2:], e[2:n0 - 1, 1:3])

  f = gs.function(fn, mesh=mesh, in_shardings=spec, out_shardings=spec)
  for got, want in zip(f(x), fn(tf.constant(x))):
    assert_close(got.numpy(), want, rtol=1e-6, atol=1e-6)


def test_pad_and_slice_along_split_dim_exchange_halos_only():
  mesh = gs.Mesh((4,), ("d",))
  f = gs.function(lambda t: (tf.pad(t, [[1, 1], [0, 0]]), t[1:15] * 2.0), mesh=mesh, in_shardings=P("d", None),
                  out_shardings=P("d", None))
  low = f.lower(tf.TensorSpec([16, 8]))
  assert set(low.report.counts()) == {"collective-permute"}
  # pad: 18 rows re-split 5 per device; device 1 takes 1 row from the next shard, device 2 takes 2 (rows before
  # the first and past the last are padding, so nothing is sent for them); slice: 1 row
  assert sorted(c.shape[0] for c in low.report.collectives) == [1, 2]


@pytest.mark.parametrize("index", ["ellipsis_new", "new_middle", "ellipsis_shrink", "new_and_range"])
def test_strided_slice_with_new_axes_and_ellipsis_keeps_the_split(rng, index):
  mesh = gs.Mesh((2, 4), ("data", "model"))
  x = rng.standard_normal((8, 12, 6)).astype(np.float32)
  fn = {"ellipsis_new": lambda a: a[..., None], "new_middle": lambda a: a[:, None, :, :],
        "ellipsis_shrink": lambda a: a[..., 2], "new_and_range": lambda a: a[:, :, None, 1:4]}[index]
  f = gs.function(fn, mesh=mesh, in_shardings=P("data", "model", None))
  low = f.lower(tf.TensorSpec(x.shape))
  assert low.report.collectives == (), str(low.report)   # no gather: the split dims pass through
  np.testing.assert_array_equal(f(x).numpy(), fn(tf.constant(x)).numpy())


@pytest.mark.parametrize("spec", [P(), P("data", "model"), P(None, "model")], ids=str)
def test_strided_slice_gradient(rng, spec):
  def fn(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.reduce_sum(x[:, 2:7] ** 2) + tf.reduce_sum(x[3] * 2.0) + tf.reduce_sum(x[:, ::2])
    return tape.gradient(y, x)

  x = rng.standard_normal((8, 12)).astype(np.float32)
  f = gs.function(fn, mesh=MESH, in_shardings=spec)
  assert_close(f(x).numpy(), fn(tf.constant(x)), rtol=1e-5)


# ---- narrowing a split dim moves the result, never the operand ------------------------------------------------
M8 = gs.Mesh((8,), ("m",))


def _moves_only_the_result(low, result_bytes):
  """The program sends what its report says, and no device sends more than twice the result's bytes."""
  assert_report_counts_program(low)
  moved = low.report.bytes_per_device()
  assert moved <= 2 * result_bytes, f"{moved} bytes moved for a result of {result_bytes}\n{low.report}"
  return moved


def _nbytes(*arrays):
  """Bytes of the arrays as collectives carry them (an all-reduce sums bools as int32)."""
  return sum(np.asarray(a).size * (4 if np.asarray(a).dtype == np.bool_ else np.asarray(a).itemsize) for a in arrays)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_], ids=lambda d: np.dtype(d).name)
def test_last_token_of_a_split_sequence(rng, dtype):
  """x[:, -1, :] with the sequence (30 rows, uneven over 8) split: the owner's row, one result-sized all-reduce."""
  x = (rng.standard_normal((4, 30, 6)) * 4).astype(dtype)
  fn = lambda t: t[:, -1, :]  # noqa: E731
  low = check_partitioned(fn, [x], (P(None, "m", None),), M8)
  _moves_only_the_result(low, _nbytes(x[:, -1, :]))


@pytest.mark.parametrize("out", [None, P("m", None)], ids=["replicated_out", "split_out"])
def test_first_rows_of_a_split_batch(rng, out):
  x = rng.standard_normal((30, 6)).astype(np.float32)
  low = check_partitioned(lambda t: t[:4], [x], (P("m", None),), M8, out=out)
  _moves_only_the_result(low, _nbytes(x[:4]))


@pytest.mark.parametrize("out", [None, P(None, "m", None)], ids=["replicated_out", "split_out"])
def test_window_of_a_split_sequence(rng, out):
  """x[:, 100:164] of 300 split rows: no window reaches it from a neighbour, so each device takes its part."""
  x = rng.standard_normal((2, 300, 4)).astype(np.float32)
  low = check_partitioned(lambda t: t[:, 100:164], [x], (P(None, "m", None),), M8, out=out)
  _moves_only_the_result(low, _nbytes(x[:, 100:164]))


@pytest.mark.parametrize("index", ["slice", "stride", "negative_stride", "negative_begin", "new_axis_shrink",
                                   "empty"])
def test_strided_and_plain_slices_of_a_split_dim(rng, index):
  x = rng.standard_normal((4, 30, 6)).astype(np.float32)
  fn = {"slice": lambda t: tf.slice(t, [0, 5, 1], [4, 9, 4]), "stride": lambda t: t[:, 3:27:5],
        "negative_stride": lambda t: t[:, ::-7], "negative_begin": lambda t: t[:, -9:-2],
        "new_axis_shrink": lambda t: t[None, 1:3, 17, ::2], "empty": lambda t: t[:, 5:5]}[index]
  low = check_partitioned(fn, [x], (P(None, "m", None),), M8)
  _moves_only_the_result(low, _nbytes(fn(tf.constant(x)).numpy()))


def test_slice_of_two_split_dims(rng):
  """Both dims split (over different axes): the element's one owner contributes it; one all-reduce over both."""
  x = rng.standard_normal((30, 20)).astype(np.float32)
  fn = lambda t: t[:3, -5:]  # noqa: E731
  low = check_partitioned(fn, [x], (P("data", "model"),), MESH)
  _moves_only_the_result(low, _nbytes(x[:3, -5:]))


@pytest.mark.parametrize("kind", ["slice", "strided_index", "negative_index"])
def test_dynamic_slice_of_a_split_dim(rng, kind):
  """A start read at run time with a static size: the owners found by comparing offsets at run time."""
  x = rng.standard_normal((4, 30, 6)).astype(np.float32)
  b = np.int32({"slice": 13, "strided_index": 22, "negative_index": -3}[kind])
  fn = {"slice": lambda t, i: tf.slice(t, tf.stack([0, i, 0]), [4, 8, 6]),
        "strided_index": lambda t, i: t[:, i], "negative_index": lambda t, i: t[:, i]}[kind]
  low = check_partitioned(fn, [x, b], (P(None, "m", None), P()), M8)
  _moves_only_the_result(low, _nbytes(fn(tf.constant(x), tf.constant(b)).numpy()))


@pytest.mark.parametrize("read", ["some", "all"])
def test_split_pieces_of_a_split_dim(rng, read):
  """tf.split along the split dim: only the pieces read move (all of them: no more than the operand)."""
  x = rng.standard_normal((4, 30, 6)).astype(np.float32)

  def fn(t):
    a, b, c = tf.split(t, [2, 20, 8], axis=1)
    return (a, c) if read == "some" else (a, b, c)

  low = check_partitioned(fn, [x], (P(None, "m", None),), M8)
  _moves_only_the_result(low, _nbytes(*[y.numpy() for y in fn(tf.constant(x))]))


def test_corner_of_a_512_mib_variable_moves_a_few_bytes():
  """v[:8, :8] of a variable f32[8192, 16384] split by columns over 8 devices (lowered only: nothing runs, no
  value is allocated): each device takes its column, never the 512 MiB gathered."""
  from tf_gspmd._platform import compat as _compat  # pylint: disable=g-import-not-at-top
  v = _compat.uninitialized_variable((8192, 16384), tf.float32)

  def step():
    gs.shard(v, P(None, "m"))
    return v[:8, :8]

  low = gs.function(step, mesh=M8).lower()
  assert_report_counts_program(low)
  assert low.report.bytes_per_device() <= 8 * 8 * 4, str(low.report)
  assert not any(c.kind == "all-gather" for c in low.report.collectives), str(low.report)


def test_gradient_of_a_slice_with_new_axes_keeps_the_split(rng):
  """StridedSliceGrad of x[:, 1:, None, None] (new axes, a narrowed dim): the whole dim's split passes through,
  no gather of the gradient (the MoE gates' pattern)."""
  mesh = gs.Mesh((8,), ("d",))

  def fn(x, w):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.reduce_sum(x[:, 1:, None, None] * w)
    return tape.gradient(y, x)

  x = rng.standard_normal((16, 5)).astype(np.float32)
  w = rng.standard_normal((16, 4, 3, 2)).astype(np.float32)
  low = check_partitioned(fn, [x, w], (P("d", None), P("d", None, None, None)), mesh, out=P("d", None))
  assert "all-gather" not in low.report.counts()


@pytest.mark.parametrize("spec", [P("m", None, None), P(None, None, "m"), P(None, "m", None)])
def test_dynamic_update_slice_writes_where_the_data_lives(rng, spec):
  """XlaDynamicUpdateSlice (Keras's ops.slice_update, a KV cache's write at a step read at run time): dims the
  update covers whole keep their split, the written dim is whole everywhere."""
  from tensorflow.compiler.tf2xla.python import xla  # pylint: disable=g-import-not-at-top

  def fn(cache, update, step):
    return xla.dynamic_update_slice(cache, update, tf.stack([0, step[0], 0]))

  cache = rng.standard_normal((8, 6, 16)).astype(np.float32)
  update = rng.standard_normal((8, 1, 16)).astype(np.float32)
  upd_spec = P(*[None if d == 1 else a for d, a in enumerate(spec)])
  low = check_partitioned(fn, [cache, update, np.array([4], np.int32)], (spec, upd_spec, P()), M8)
  if spec != P(None, "m", None):   # splitting the written dim is not kept: resharded around the write
    assert low.report.collectives == (), str(low.report)


# ---- a pad and a slice next to each other take one halo exchange ----------------------------------------------
M24 = gs.Mesh((2, 4), ("data", "model"))


def _one_exchange(low):
  """The program sends what its report says, in one halo exchange: the collective-permutes of one op's window
  (one per direction rows come from)."""
  assert_report_counts_program(low)
  assert {c.kind for c in low.report.collectives} == {"collective-permute"}, str(low.report)
  assert len({c.source for c in low.report.collectives}) == 1, str(low.report)
  assert len(low.report.collectives) <= 2, str(low.report)


def test_pad_then_slice_shift_sends_the_rows_once(rng):
  """tf.pad(x, [[7, 0], [0, 0]])[:64], x [64,1024] over 8: each device takes the 7 rows before its own (XLA's one
  collective-permute, 28,672 B), not the pad's window and then the slice's (53,248 B in two exchanges)."""
  x = rng.standard_normal((64, 1024)).astype(np.float32)
  low = check_partitioned(lambda t: tf.pad(t, [[7, 0], [0, 0]])[:64], [x], (P("m", None),), M8, out=P("m", None))
  _one_exchange(low)
  assert len(low.report.collectives) == 1, str(low.report)
  assert low.report.bytes_per_device() <= 28_672, str(low.report)
  assert low.report.collectives[0].shape == (7, 1024)


FOLDED = {
    # pad -> slice
    "pad_slice_uneven": (lambda t: tf.pad(t, [[3, 2], [0, 1]], constant_values=2.0)[1:31, :], (30, 6), M8,
                         P("m", None)),
    "pad_slice_2x4": (lambda t: tf.pad(t, [[0, 0], [2, 1]])[:, 1:24], (12, 22), M24, P("data", "model")),
    "pad_slice_both_ends": (lambda t: tf.pad(t, [[2, 3], [0, 0]], constant_values=-1.0)[4:37], (40, 5), M8,
                            P("m", None)),
    # slice -> pad
    "slice_pad": (lambda t: tf.pad(t[3:60], [[5, 2], [0, 0]]), (64, 16), M8, P("m", None)),
    "slice_pad_uneven": (lambda t: tf.pad(t[2:27, 1:5], [[1, 3], [0, 0]], constant_values=-1.0), (30, 6), M8,
                         P("m", None)),
    "slice_pad_2x4": (lambda t: tf.pad(t[:, 3:20], [[0, 0], [2, 2]], constant_values=0.5), (12, 22), M24,
                      P("data", "model")),
    # slice -> slice
    "slice_slice": (lambda t: t[1:50][3:45], (48 + 8, 4), M8, P("m", None)),
}


@pytest.mark.parametrize("name", sorted(FOLDED))
def test_pad_and_slice_pairs_take_one_exchange(rng, name):
  """A pad or slice whose only reader is a slice or pad along the same split dim: the pair's windows compose
  into one window of the first op's operand, so one collective-permute moves the rows each device lacks."""
  fn, shape, mesh, spec = FOLDED[name]
  x = (rng.standard_normal(shape) * 3).astype(np.float32)
  low = check_partitioned(lambda t: fn(tf.exp(t) - 4.0), [x], (spec,), mesh, out=spec)
  _one_exchange(low)


def test_pad_read_whole_by_its_slice_is_emitted_first(rng):
  """A pad whose slice reader is not split along the padded dim (replicated result): the pad is emitted as it
  stands for the slice to read, with the same values."""
  x = rng.standard_normal((30, 6)).astype(np.float32)
  fn = lambda t: tf.pad(t, [[3, 2], [0, 0]], constant_values=2.0)[1:30:2]  # noqa: E731
  low = check_partitioned(fn, [x], (P("m", None),), M8, out=P())
  assert_report_counts_program(low)
  assert any(c.source == "PadV2" for c in low.report.collectives), str(low.report)
  names = [nd.name for nd in low.graph_def.node]
  assert any(n.startswith("PadV2/gspmd/") for n in names)   # under its own name, not inside its reader's scope
  assert not any(n.startswith("strided_slice/") and "PadV2/" in n for n in names)


@pytest.mark.parametrize("exchange_rows", [5, 9])
def test_pad_whose_folded_window_reaches_too_far_is_emitted_first(rng, exchange_rows):
  """tf.pad(x, [[k, 0], [0, 0]])[:30], x [30,6] over 8 (4 rows a shard): the shift by k > 4 rows is past the
  neighbouring shard, so the pad is emitted and its slice reads it as before; the values are the same."""
  x = rng.standard_normal((30, 6)).astype(np.float32)
  fn = lambda t: tf.pad(t, [[exchange_rows, 0], [0, 0]])[:30]  # noqa: E731
  low = check_partitioned(fn, [x], (P("m", None),), M8, out=P("m", None))
  assert_report_counts_program(low)
  assert any(c.source == "Pad" for c in low.report.collectives), str(low.report)


def test_pad_then_slice_inside_a_loop_body(rng):
  """The shift folded inside a while loop's body: one exchange per iteration, the unpartitioned values."""
  x = rng.standard_normal((32, 6)).astype(np.float32)

  def fn(t):
    body = lambda i, y: (i + 1, tf.pad(y, [[1, 0], [0, 0]])[:32] * 0.5 + y)  # noqa: E731
    return tf.while_loop(lambda i, y: i < 3, body, (0, t))[1]

  low = check_partitioned(fn, [x], (P("m", None),), M8, out=P("m", None))
  assert_report_counts_program(low)
  assert [c.kind for c in low.report.collectives] == ["collective-permute"], str(low.report)
  assert "Pad" in low.report.collectives[0].reason, str(low.report)
