"""The resharding planner (pure steps) and every resharding pair run on 8 logical CPUs."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.reshard import (AllGather, AllReduce, AllToAll, LocalSlice, ReduceScatter, Unpad,
                                       plan_reshard)

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
  # Uneven dims do not fuse (padding would cross shard boundaries): gather, then slice.
  assert plan_reshard((7, 6), S("model", None), S(None, "model")) == [AllGather(0, ("model",)), Unpad(0, 7),
                                                                      LocalSlice(1, ("model",))]
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
