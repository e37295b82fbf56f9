"""Sharding values and their exact conversion to and from XLA's OpSharding."""

import itertools

import numpy as np
import pytest
from tensorflow.compiler.xla import xla_data_pb2
from tensorflow.python.compiler.xla.experimental import xla_sharding

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd._layout.sharding import to_annotation

MESH22 = gs.Mesh((2, 2), ("a", "b"))
MESH24 = gs.Mesh((2, 4), ("data", "model"))
MESH8 = gs.Mesh((8,), ("x",))
MESH222 = gs.Mesh((2, 2, 2), ("x", "y", "z"))


def _text(proto):
  dims = list(proto.tile_assignment_dimensions)
  devs = ",".join(str(d) for d in proto.tile_assignment_devices)
  return f"devices={dims}{devs}{' ltdr' if proto.replicate_on_last_tile_dim else ''}"


# The verified examples of gspmd-notes.md section 1.2.
@pytest.mark.parametrize("mesh,mapping,text", [
    (MESH22, [0, 1], "devices=[2, 2]0,1,2,3"),
    (MESH22, [1, 0], "devices=[2, 2]0,2,1,3"),
    (MESH22, [1, -1], "devices=[2, 1, 2]0,2,1,3 ltdr"),
    (MESH22, [-1, 0], "devices=[1, 2, 2]0,1,2,3 ltdr"),
    (MESH24, [-1, 1, 0], "devices=[1, 4, 2]0,4,1,5,2,6,3,7"),
])
def test_notes_examples(mesh, mapping, text):
  s = gs.Sharding.from_dims_mapping(mesh, mapping)
  assert _text(s.to_proto()) == text


def _all_mappings(mesh, rank):
  for mapping in itertools.product(range(-1, mesh.ndim), repeat=rank):
    used = [d for d in mapping if d >= 0]
    if len(used) == len(set(used)):
      yield list(mapping)


@pytest.mark.parametrize("mesh", [MESH22, MESH24, MESH8, MESH222], ids=str)
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_bytes_identical_to_tf_mesh_split(mesh, rank):
  for mapping in _all_mappings(mesh, rank):
    ours = gs.Sharding.from_dims_mapping(mesh, mapping).to_proto().SerializeToString()
    theirs = xla_sharding.mesh_split_sharding(mesh.device_ids, mapping).proto.SerializeToString()
    assert ours == theirs, mapping
    back = gs.Sharding.from_proto(theirs, mesh)
    assert back == gs.Sharding.from_dims_mapping(mesh, mapping), mapping


def test_round_trip_special_kinds():
  rep = gs.Sharding(MESH24)
  assert rep.to_proto().type == xla_data_pb2.OpSharding.REPLICATED
  assert gs.Sharding.from_proto(rep.to_proto(), MESH24) == rep
  assert rep.spec == P() and rep.is_replicated
  assert rep.to_proto() == xla_sharding.Sharding.replicate().proto
  m = gs.Sharding(MESH24, maximal=5)
  assert m.to_proto() == xla_sharding.Sharding.assign_device(5).proto
  assert gs.Sharding.from_proto(m.to_proto(), MESH24) == m
  assert m.spec is None and str(m) == "{maximal device=5}"


def test_multi_axis_dim_and_tf_split():
  s = gs.Sharding.from_spec(MESH24, P(("data", "model"), None))
  assert s.num_tiles == 8 and s.tiles(0) == 8
  split = xla_sharding.Sharding.split(np.zeros((16, 4)), 0, 8, input_shape=[16, 4]).proto
  assert gs.Sharding.from_proto(split, MESH24) == s
  assert s.to_proto().SerializeToString() == split.SerializeToString()


def test_partial_replication_and_spec():
  s = gs.Sharding.from_spec(MESH24, P(None, "model"))
  assert s.replicated_axes == ("data",) and s.num_tiles == 4
  assert s.spec == P(None, "model") and str(s) == "P(None, 'model')"
  assert s.shard_shape((64, 4096)) == (64, 1024)
  assert s.tile_index(6, 1) == 2 and s.tile_index(6, 0) == 0


def test_uneven_shard_shape():
  s = gs.Sharding.from_spec(gs.Mesh((4,), ("d",)), P("d", None))
  assert s.shard_shape((17, 33)) == (5, 33)


def test_permuted_device_order_is_read_back():
  # A device_mesh transposed relative to the mesh: the tile assignment still maps to mesh axes.
  proto = xla_sharding.mesh_split_sharding(MESH24.device_ids.T, [0, -1]).proto   # dim 0 over the 4-way axis
  assert gs.Sharding.from_proto(proto, MESH24) == gs.Sharding.from_spec(MESH24, P("model", None))


def test_inexpressible_order_is_rejected():
  proto = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.OTHER, tile_assignment_dimensions=[8],
                                  tile_assignment_devices=[1, 0, 2, 3, 4, 5, 6, 7])
  with pytest.raises(gs.SpecError, match="not expressible"):
    gs.Sharding.from_proto(proto, MESH24)


def test_values_are_hashable_and_frozen():
  a = gs.Sharding.from_spec(MESH24, P("data", None))
  b = gs.Sharding.from_spec(MESH24, P("data", None))
  assert a == b and hash(a) == hash(b) and len({a, b}) == 1
  with pytest.raises(Exception):
    a.maximal = 1
  assert repr(a) == "P('data', None)" and eval(repr(a), {"P": P}) == a.spec   # the form users write


@pytest.mark.parametrize("spec,msg", [
    (P("data", "data"), "used for dimensions 0 and 1"),
    (P("nope", None), "unknown mesh axis 'nope'"),
])
def test_spec_errors(spec, msg):
  with pytest.raises(gs.SpecError, match=msg):
    gs.Sharding.from_spec(MESH24, spec)


def test_spec_longer_than_rank():
  with pytest.raises(gs.SpecError, match="has rank 1"):
    gs.Sharding.from_spec(MESH24, P("data", None), rank=1, what="w")


def test_open_dims_only_where_completion_decides():
  with pytest.raises(gs.SpecError, match=r"leaves dimension 1 of w open \(P.UNCONSTRAINED\).*in_shardings"):
    gs.Sharding.from_spec(MESH24, P("data", P.UNCONSTRAINED), what="w")
  s, open_dims = to_annotation(P("data", P.UNCONSTRAINED), MESH24, rank=3)
  assert s == gs.Sharding.from_spec(MESH24, P("data", None, None)) and open_dims == (1,)
  assert to_annotation(P("data"), MESH24) == (gs.Sharding.from_spec(MESH24, P("data")), ())
  assert to_annotation(None, MESH24) == (None, ())
