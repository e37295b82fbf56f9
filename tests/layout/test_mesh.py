"""Mesh and P: validation, hashing, text."""

import pickle

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd._platform import cluster as _cluster


def test_mesh_values():
  mesh = gs.Mesh((2, 4), ("data", "model"))
  assert mesh.size == 8 and mesh.ndim == 2
  assert mesh.axis_size("model") == 4
  assert str(mesh) == "Mesh(data=2, model=4)"
  assert hash(mesh) == hash(gs.Mesh([2, 4], ["data", "model"]))
  assert mesh == gs.Mesh([2, 4], ["data", "model"])
  np.testing.assert_array_equal(mesh.device_ids, np.arange(8).reshape(2, 4))
  assert tuple(mesh.coords(6)) == (1, 2)


def test_mesh_frozen():
  mesh = gs.Mesh((8,), ("x",))
  with pytest.raises(Exception):
    mesh.shape = (4,)


@pytest.mark.parametrize("shape,names,msg", [
    ((2, 4), ("a",), "axis names"),
    ((2, 2), ("a", "a"), "unique"),
    ((0,), ("a",), "positive"),
    ((), (), "non-empty"),
    ((2, 4), ("a,b", "c"), "may not contain ','"),
])
def test_mesh_rejects(shape, names, msg):
  with pytest.raises(gs.MeshError, match=msg):
    gs.Mesh(shape, names)


def test_mesh_larger_than_devices():
  mesh = gs.Mesh((16,), ("x",))
  with pytest.raises(gs.MeshError, match="needs 16 devices but only 8") as e:
    mesh.resolve_devices()
  assert "set_logical_device_configuration" in str(e.value)


def test_mesh_explicit_devices():
  devs = [f"/device:CPU:{i}" for i in (3, 2, 1, 0)]
  mesh = gs.Mesh((4,), ("x",), devices=devs)
  assert mesh.resolve_devices()[0] == "/job:localhost/replica:0/task:0/device:CPU:3"
  with pytest.raises(gs.MeshError, match="needs 4 devices but 2"):
    gs.Mesh((4,), ("x",), devices=devs[:2])


def test_partition_spec():
  assert P("data", None) == ("data", None)
  assert repr(P("data", ("a", "b"))) == "P('data', ('a', 'b'))"
  assert P(("a",)) == P("a")
  assert P("a", None).axes(0) == ("a",) and P("a").axes(3) == ()
  assert hash(P("a", None)) == hash(P("a", None))
  with pytest.raises(gs.SpecError, match="entries"):
    P(3)


def test_unconstrained_entry():
  spec = P("data", P.UNCONSTRAINED, ("a", "b"))
  assert spec.open_dims == (1,) and spec.axes(1) == () and spec.closed() == P("data", None, ("a", "b"))
  assert repr(spec) == "P('data', P.UNCONSTRAINED, ('a', 'b'))"
  assert pickle.loads(pickle.dumps(spec)) == spec and P(P.UNCONSTRAINED) != P(None)
  assert hash(P("a", P.UNCONSTRAINED)) == hash(P("a", P.UNCONSTRAINED))


def test_a_mesh_over_absent_devices_is_planned_but_refuses_to_run():
  mesh = gs.Mesh((2,), ("d",), devices=["/device:GPU:0", "/device:GPU:1"])   # this machine has CPUs only
  f = gs.function(lambda x: x * 2.0, mesh=mesh, in_shardings=gs.P("d"))
  assert f.lower(tf.TensorSpec([8])).report is not None     # planning needs no devices
  with pytest.raises(gs.MeshError, match=r"does not have: '/job:localhost/replica:0/task:0/device:GPU:0' and 1 "
                                         r"more \(it has 8 CPU\).*f\.lower"):
    f(np.ones(8, np.float32))
  cpus = gs.Mesh((2,), ("d",), devices=["/device:CPU:6", "/device:CPU:7"])
  assert _cluster.runnable_devices(cpus) == cpus.resolve_devices()
  np.testing.assert_array_equal(gs.function(lambda x: x * 2.0, mesh=cpus, in_shardings=gs.P("d"))(
      np.ones(8, np.float32)).numpy(), np.full(8, 2.0))


@pytest.mark.parametrize("shape,names,msg", [
    ("24", ("a", "b"), "positive ints.*'24'"),          # int() would read the string as (2, 4)
    ((2.5, 4), ("a", "b"), r"\(2.5, 4\)"),             # and truncate a fraction
    ((True, 4), ("a", "b"), "True"),
    (8, ("a",), "got 8"),
    ((2, 4), None, "axis names"),
])
def test_mesh_shape_and_names_are_checked_not_converted(shape, names, msg):
  with pytest.raises(gs.MeshError, match=msg):
    gs.Mesh(shape, names)
  assert gs.Mesh((np.int64(2), 4.0), ("a", "b")).shape == (2, 4)   # whole numbers of any numeric type


def test_device_names_and_positions_are_checked():
  with pytest.raises(gs.MeshError, match="'garbage' is not a device name"):
    gs.Mesh((1,), ("a",), devices=["garbage"])
  mesh = gs.Mesh((2, 4), ("data", "model"))
  for position in (8, -1, "1", 1.5):
    with pytest.raises(gs.MeshError, match="is not a device of Mesh.*0..7"):
      mesh.coords(position)
  assert tuple(mesh.coords(np.int64(7))) == (1, 3)
