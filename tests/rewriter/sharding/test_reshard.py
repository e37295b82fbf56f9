"""The resharding planner (pure steps) and every resharding pair run on 8 logical CPUs."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.sharding.reshard import (AllGather, AllGatherDims, AllReduce, AllToAll, LocalSlice,
                                                ReduceScatter, Unpad, plan_bytes, plan_reshard)

MESH = gs.Mesh((2, 4), ("data", "model"))


def S(*spec, mesh=MESH):
  return gs.Sharding.from_spec(mesh, P(*spec))


def test_plan_gather_and_slice():
  assert plan_reshard((8, 8), S("data", None), S(None, None)) == [AllGather(0, ("data",))]
  assert plan_reshard((8, 8), S(None, None), S("data", "model")) == [LocalSlice(0, ("data",)),
                                                                      LocalSlice(1, ("model",))]
  assert plan_reshard((8, 8), S("data", None), S(None, "data")) == [AllToAll(0, 1, ("data",))]
  assert plan_reshard((8, 8), S(("data", "model"), None), S("data", "model")) == [AllToAll(0, 1, ("model",))]
  assert plan_reshard((8, 8), S("model", None), S(None, ("model", "data"))) == [AllToAll(0, 1, ("model",)),
                                                                                LocalSlice(1, ("data",))]
  # Uneven dims move by all-to-all too: the newly split dim is padded to whole chunks, the gathered one unpadded.
  assert plan_reshard((7, 6), S("model", None), S(None, "model")) == [AllToAll(0, 1, ("model",))]
  # A partial gather that would misalign (17 over 8 = 3 a shard, over 2 = 9 != 4 * 3) gathers whole instead.
  assert plan_reshard((17, 3), S(("data", "model"), None), S(None, "data")) == [
      AllGather(0, ("data", "model")), Unpad(0, 17), LocalSlice(1, ("data",))]
  assert plan_reshard((8, 8), S("data", None), S("data", None)) == []


def test_plan_partial_sum_all_reduces_first():
  assert plan_reshard((8, 8), S("data", None), S("data", None), partial=(("model",), "Add")) == [
      AllReduce(("model",), "Add")]


def test_plan_partial_sum_wanted_split_is_a_reduce_scatter():
  assert plan_reshard((8, 8), S("data", None), S("data", "model"), partial=(("model",), "Add")) == [
      ReduceScatter(1, ("model",), "Add")]
  assert plan_reshard((8, 8), S(), S(None, ("model", "data")), partial=(("model",), "Max")) == [
      ReduceScatter(1, ("model",), "Max"), LocalSlice(1, ("data",))]
  # 6 rows do not split evenly 4 ways: all-reduce, then slice locally.
  assert plan_reshard((8, 6), S(), S(None, "model"), partial=(("model",), "Add")) == [
      AllReduce(("model",), "Add"), LocalSlice(1, ("model",))]


def test_plan_slices_a_partial_value_by_unused_axes_before_reducing_it():
  """A sum pending over `data`, wanted split over `model`: each device keeps its rows first, and the all-reduce
  carries a quarter of the value. An axis the value still uses elsewhere is free only after its gather: the slice by
  it stays behind the reduction."""
  assert plan_reshard((8, 8), S(), S("model", None), partial=(("data",), "Add")) == [
      LocalSlice(0, ("model",)), AllReduce(("data",), "Add")]
  assert plan_bytes((8, 8), 4, S(), S("model", None), partial=(("data",), "Add")) == 64
  steps = plan_reshard((8, 8), S(None, "model"), S("model", None), partial=(("data",), "Add"))
  assert steps[0] == AllReduce(("data",), "Add"), steps


@pytest.mark.parametrize("src", [P("data", "model"), P("model", None, "data"), P(None, "data", "model")], ids=str)
def test_gathers_of_several_dims_are_one_all_gather(rng, src):
  """Each member's shard arrives once: one all-gather over both axes, its result the whole value's bytes."""
  shape = (8, 12, 8)[:len(src)]
  assert [type(st) for st in plan_reshard(shape, S(*src), S())] == [AllGatherDims]
  x = rng.standard_normal(shape).astype(np.float32)
  f = gs.function(tf.identity, mesh=MESH, in_shardings=src, out_shardings=P())
  assert_close(f(x).numpy(), x, rtol=0, atol=0)
  report = f.lower(tf.TensorSpec(shape)).report
  assert report.counts() == {"all-gather": 1} and report.bytes_per_device() == x.nbytes, str(report)


@pytest.mark.parametrize("out", [P(None, "model"), P("model", None), P("data", "model"), P(None, ("model", "data"))],
                         ids=str)
def test_reduce_scatter_matches(rng, out):
  x = rng.standard_normal((8, 16)).astype(np.float32)
  w = rng.standard_normal((16, 12)).astype(np.float32)
  f = gs.function(lambda a, b: a @ b, mesh=MESH, in_shardings=(P(None, "model"), P("model", None)),
                  out_shardings=out)
  assert_close(f(x, w).numpy(), x @ w, rtol=1e-5, atol=1e-5)


def test_plan_gathers_only_minor_axes_when_aligned():
  assert plan_reshard((16, 4), S(("data", "model"), None), S("data", None)) == [AllGather(0, ("model",))]
  assert plan_reshard((16, 4), S("data", None), S(("data", "model"), None)) == [LocalSlice(0, ("model",))]


def test_plan_uneven_gathers_whole_dim_and_unpads():
  mesh = gs.Mesh((4,), ("d",))
  assert plan_reshard((17, 3), S("d", None, mesh=mesh), S(None, None, mesh=mesh)) == [AllGather(0, ("d",)),
                                                                                       Unpad(0, 17)]
  # 17 over 8 = 3 per shard; 17 over 2 = 9 != 4 * 3, so a partial gather would misalign: gather whole.
  steps = plan_reshard((17, 3), S(("data", "model"), None), S("data", None))
  assert steps == [AllGather(0, ("data", "model")), Unpad(0, 17), LocalSlice(0, ("data",))]


SPECS = [P(), P("data"), P("model"), P(None, "data"), P(None, "model"), P("data", "model"), P("model", "data"),
         P(("data", "model")), P(None, ("model", "data"))]


@pytest.mark.parametrize("shape", [(8, 12), (7, 5)], ids=str)
def test_every_resharding_pair(rng, shape):
  x = rng.standard_normal(shape).astype(np.float32)
  for src, dst in itertools.product(SPECS, SPECS):
    f = gs.function(lambda t: tf.identity(t), mesh=MESH, in_shardings=src, out_shardings=dst)
    y = f(x)
    assert y.sharding == gs.Sharding.from_spec(MESH, dst, rank=2), (src, dst)
    assert_close(y.numpy(), x, rtol=0, atol=0)
    for comp in y.components:
      assert tuple(comp.shape) == y.sharding.shard_shape(shape), (src, dst)


def test_three_d_mesh_pairs(rng):
  mesh = gs.Mesh((2, 2, 2), ("x", "y", "z"))
  x = rng.standard_normal((6, 5, 4)).astype(np.float32)
  specs = [P(), P("x", "y", "z"), P(("x", "y"), None, "z"), P("z", ("y", "x")), P(None, None, ("x", "y", "z"))]
  for src, dst in itertools.product(specs, specs):
    f = gs.function(lambda t: tf.identity(t), mesh=mesh, in_shardings=src, out_shardings=dst)
    assert_close(f(x).numpy(), x, rtol=0, atol=0)


def test_partial_sum_wanted_split_on_another_dim_moves_by_all_to_all_not_gather(rng):
  """A gradient partial over `data` and split by rows over `model`, wanted as P('data', 'model'): the row split
  moves to the columns by one all-to-all, then the partial sums are reduce-scattered (nothing gathered)."""
  assert plan_reshard((8, 8), S("model", None), S("data", "model"), partial=(("data",), "Add")) == [
      AllToAll(0, 1, ("model",)), ReduceScatter(0, ("data",), "Add")]
  a = rng.standard_normal((8, 16)).astype(np.float32)
  b = rng.standard_normal((16, 12)).astype(np.float32)
  f = gs.function(lambda x, y: x @ y, mesh=MESH, in_shardings=(P("model", "data"), P("data", None)),
                  out_shardings=P("data", "model"))
  assert_close(f(a, b).numpy(), a @ b, rtol=1e-5, atol=1e-5)
  counts = f.lower(tf.TensorSpec([8, 16]), tf.TensorSpec([16, 12])).report.counts()
  assert "all-gather" not in counts and counts.get("reduce-scatter") == 1, counts


def test_uneven_all_to_all_values_and_bytes(rng):
  """7 rows over 4 and 6 columns over 4 (neither divides): rows -> columns is one all-to-all of the padded shard
  (2 x 8 floats, the columns padded to 2 a member), not a gather of the whole (8 x 6); the values are exact."""
  assert plan_reshard((7, 6), S("model", None), S(None, "model")) == [AllToAll(0, 1, ("model",))]
  assert plan_bytes((7, 6), 4, S("model", None), S(None, "model")) == 2 * 8 * 4
  assert plan_bytes((7, 6), 4, S("model", None), S(None, None)) == 8 * 6 * 4   # a gather sends the padding too
  x = rng.standard_normal((7, 6)).astype(np.float32)
  for src, dst in ((P("model", None), P(None, "model")), (P(None, "model"), P("model", None)),
                   (P("model", None), P("data", "model"))):
    f = gs.function(lambda t: tf.identity(t), mesh=MESH, in_shardings=src, out_shardings=dst)
    assert_close(f(x).numpy(), x, rtol=0, atol=0)
    report = f.lower(tf.TensorSpec([7, 6])).report
    assert report.counts() == {"all-to-all": 1}, (src, dst, report.counts())


def test_moe_dispatch_with_fewer_experts_and_groups_than_devices_moves_by_all_to_all(rng):
  """GShard's dispatch and combine on 8 devices with 4 experts and 4 groups (both split unevenly, half the
  devices hold padding): the dispatch einsum runs where its operands are (groups split) and its result moves to
  the expert split by one all-to-all, as GShard does, instead of gathering the dispatch mask and the tokens;
  the result matches the unpartitioned program."""
  mesh = gs.Mesh((8,), ("expert",))
  g, s, e, c, m, h = 4, 6, 4, 3, 5, 7
  dispatch = (rng.random((g, s, e, c)) < 0.3).astype(np.float32)
  combine = dispatch * rng.random((g, s, e, c)).astype(np.float32)
  x = rng.standard_normal((g, s, m)).astype(np.float32)
  w = rng.standard_normal((e, m, h)).astype(np.float32)

  def moe(dispatch, combine, x, w):
    expert_in = gs.shard(tf.einsum("gsec,gsm->egcm", dispatch, x, name="dispatch"), P("expert", None, None, None))
    hidden = tf.nn.relu(tf.einsum("egcm,emh->egch", expert_in, w))
    expert_out = gs.shard(tf.einsum("egch,ehm->egcm", hidden, tf.transpose(w, [0, 2, 1])),
                          P("expert", None, None, None))
    return tf.einsum("gsec,egcm->gsm", combine, expert_out, name="combine")

  specs = (P("expert", None, None, None), P("expert", None, None, None), P("expert", None, None),
           P("expert", None, None))
  f = gs.function(moe, mesh=mesh, in_shardings=specs, out_shardings=P("expert", None, None))
  assert_close(f(dispatch, combine, x, w).numpy(), moe(dispatch, combine, x, w), rtol=1e-5, atol=1e-5)
  report = f.lower(*[tf.TensorSpec(a.shape) for a in (dispatch, combine, x, w)]).report
  assert "all-gather" not in report.counts(), report
  (moved,) = [r for r in report.collectives if r.source.startswith("dispatch")]
  # The dispatch's result [e, g, c, m] split by groups, one group a device: its 4 experts padded to one a member.
  assert (moved.kind, tuple(moved.shape), moved.bytes) == ("all-to-all", (8, 1, c, m), 8 * 1 * c * m * 4), moved
  assert report.bytes_per_device() <= 2 * 8 * 1 * c * m * 4, report
