"""Annotations inside tf.function: the attribute they write and the errors they raise."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.compiler.xla.experimental import xla_sharding

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd._layout.annotations import decode_spec

MESH = gs.Mesh((2, 4), ("data", "model"))


def _annotated_attr(fn, *specs):
  graph = tf.function(fn).get_concrete_function(*specs).graph
  attrs = [op.get_attr("_XlaSharding") for op in graph.get_operations() if "_XlaSharding" in op.node_def.attr]
  assert len(attrs) == 1
  return attrs[0]


def test_mesh_split_writes_what_tf_writes():
  spec = tf.TensorSpec([8, 16])
  ours = _annotated_attr(lambda x: gs.mesh_split(x, MESH.device_ids, [0, -1]) * 2, spec)
  theirs = _annotated_attr(lambda x: xla_sharding.mesh_split(x * 1, MESH.device_ids, [0, -1]) * 2, spec)
  assert ours == theirs


def test_shard_with_explicit_mesh_and_replicate():
  spec = tf.TensorSpec([8, 16])
  attr = _annotated_attr(lambda x: gs.shard(x, P(None, "model"), mesh=MESH) + 1, spec)
  assert attr == gs.Sharding.from_spec(MESH, P(None, "model")).to_proto().SerializeToString()
  attr = _annotated_attr(lambda x: gs.replicate(x) + 1, spec)
  assert attr == xla_sharding.Sharding.replicate().proto.SerializeToString()


def test_eager_annotation_is_identity():
  x = tf.ones([4, 4])
  assert gs.mesh_split(x, MESH.device_ids, [0, 1]) is not None
  np.testing.assert_array_equal(gs.shard(x, P("data"), mesh=MESH).numpy(), x.numpy())


def test_wrong_dims_mapping_length_names_tensor():
  @tf.function
  def f(x):
    return gs.mesh_split(tf.identity(x, name="act"), MESH.device_ids, [0])

  with pytest.raises(gs.SpecError, match=r"act:0.*1 entries but the tensor has rank 2"):
    f.get_concrete_function(tf.TensorSpec([4, 4]))


def test_mesh_axis_used_twice():
  @tf.function
  def f(x):
    return gs.mesh_split(x, MESH.device_ids, [1, 1])

  with pytest.raises(gs.SpecError, match="mesh dimension 1 for more than one"):
    f.get_concrete_function(tf.TensorSpec([4, 4]))


def test_unknown_axis_name():
  @tf.function
  def f(x):
    return gs.shard(tf.identity(x, name="h"), P("modle", None), mesh=MESH)

  with pytest.raises(gs.SpecError, match=r"h:0.*unknown mesh axis 'modle'.*\('data', 'model'\)"):
    f.get_concrete_function(tf.TensorSpec([4, 4]))


def test_shard_without_a_mesh_is_resolved_by_the_gs_function(rng):
  def f(x):
    return gs.shard(x * 2.0, P("data"), name="h") + 1.0

  # Plain TF runs it (the annotation waits for a mesh); a gs.function resolves it with its own mesh.
  x = rng.standard_normal((8, 4)).astype(np.float32)
  np.testing.assert_allclose(tf.function(f)(x).numpy(), x * 2 + 1)
  np.testing.assert_allclose(f(x).numpy(), x * 2 + 1)
  low = gs.function(tf.function(f), mesh=MESH).lower(tf.TensorSpec([8, 4]))
  assert low.shardings["h"].spec == P("data", None)


def test_unknown_rank_rejected():
  @tf.function
  def f(x):
    return gs.shard(x, P("data"), mesh=MESH)

  with pytest.raises(gs.ShapeError, match="unknown rank"):
    f.get_concrete_function(tf.TensorSpec(None))


@pytest.mark.parametrize("mesh", [MESH, None])
def test_gradient_of_an_annotation_is_annotated_alike(mesh):
  """On a GradientTape, the gradient of an annotated tensor carries the same annotation (and nothing else is added)."""
  attr = "_XlaSharding" if mesh is not None else "_gspmd_spec"

  @tf.function
  def f(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      h = gs.shard(tf.tanh(x), P("data", "model"), mesh=mesh, name="h")
      loss = tf.reduce_sum(h * h)
    return tape.gradient(loss, x)

  graph = f.get_concrete_function(tf.TensorSpec([8, 16])).graph
  annotated = [op for op in graph.get_operations() if attr in op.node_def.attr]
  assert [op.type for op in annotated] == ["Identity", "Identity"]
  forward, backward = annotated
  assert forward.name == "h" and forward.get_attr(attr) == backward.get_attr(attr)
  assert [c.type for c in backward.outputs[0].consumers()] == ["TanhGrad"]   # the gradient that reaches h
  assert "IdentityN" not in {op.type for op in graph.get_operations()}
  x = np.linspace(-1, 1, 128, dtype=np.float32).reshape(8, 16)
  np.testing.assert_allclose(f(x).numpy(), 2 * np.tanh(x) * (1 - np.tanh(x) ** 2), rtol=1e-5, atol=1e-6)
  if mesh is None:   # a gs.function resolves both with its mesh
    low = gs.function(f, mesh=MESH).lower(tf.TensorSpec([8, 16]))
    assert low.shardings["h"].spec == P("data", "model")
    assert low.shardings[backward.name].spec == P("data", "model")


def _sharding_ops(fn, *specs):
  graph = tf.function(fn).get_concrete_function(*specs).graph
  return [(op.type, op.get_attr("sharding"), list(op.get_attr("unspecified_dims")), op.get_attr("_XlaSharding"))
          for op in graph.get_operations() if op.type == "XlaSharding"]


def test_open_dims_write_what_tf_writes():
  """P.UNCONSTRAINED (gs.shard) and unspecified_dims (gs.mesh_split) write TF's XlaSharding op with its
  unspecified_dims, byte for byte what xla_sharding.mesh_split(..., unspecified_dims=...) writes."""
  spec = tf.TensorSpec([8, 16])
  theirs = _sharding_ops(lambda x: xla_sharding.mesh_split(x * 1, MESH.device_ids, [0, -1], use_sharding_op=True,
                                                           unspecified_dims=[1]) * 2, spec)
  ours = _sharding_ops(lambda x: gs.shard(x * 1, P("data", P.UNCONSTRAINED), mesh=MESH) * 2, spec)
  split = _sharding_ops(lambda x: gs.mesh_split(x * 1, MESH.device_ids, [0, -1], unspecified_dims=[1]) * 2, spec)
  assert ours == theirs == split and len(ours) == 1


def test_open_dims_without_a_mesh_wait_for_the_gs_function():
  def f(x):
    return gs.shard(x * 2.0, P(P.UNCONSTRAINED, "model"), name="h") + 1.0

  graph = tf.function(f).get_concrete_function(tf.TensorSpec([8, 16])).graph
  (op,) = [op for op in graph.get_operations() if "_gspmd_spec" in op.node_def.attr]
  assert decode_spec(op.get_attr("_gspmd_spec")) == P(P.UNCONSTRAINED, "model")
  low = gs.function(f, mesh=MESH, in_shardings=P("data", None)).lower(tf.TensorSpec([8, 16]))
  assert low.shardings["h"].spec == P("data", "model")   # dim 0 from the argument, dim 1 as annotated


def test_open_dims_out_of_range():
  with pytest.raises(gs.SpecError, match=r"open dims \[2\].*rank 2"):
    tf.function(lambda x: gs.mesh_split(x, MESH.device_ids, [0, -1], unspecified_dims=[2])).get_concrete_function(
        tf.TensorSpec([4, 4]))


@pytest.mark.parametrize("spec,msg", [
    ("data", r"the spec 'data' is a string; give gs.P\('data'\)"),   # not P('d', 'a', 't', 'a')
    (5, r"cannot read a partition spec from 5"),
])
def test_shard_reads_only_partition_specs(spec, msg):
  with pytest.raises(gs.SpecError, match=msg):
    gs.shard(np.ones((8, 4), np.float32), spec, mesh=MESH)
  with pytest.raises(gs.SpecError, match=msg):   # with no mesh (a no-op eagerly) the spec is still read
    gs.shard(np.ones((8, 4), np.float32), spec)


def test_annotations_name_a_mesh_or_tensor_that_is_not_one():
  with pytest.raises(gs.MeshError, match=r"shard\(mesh='m'\): give a gs.Mesh"):
    gs.shard(np.ones((8, 4), np.float32), P("data"), mesh="m")
  with pytest.raises(gs.MeshError, match=r"replicate\(mesh='m'\)"):
    gs.replicate(np.ones((8, 4), np.float32), mesh="m")
  with pytest.raises(gs.InputError, match="shard annotates a tensor; got object"):
    gs.shard(object(), P())


@pytest.mark.parametrize("dims,unspecified,msg", [
    (["a", -1], None, r"dims_mapping=\['a', -1\]: give one int per tensor dimension"),
    (5, None, "dims_mapping=5"),
    ([True, -1], None, "dims_mapping="),
    ([0, -1], "x", "unspecified_dims='x'"),
    ([0, -1], [1.5], r"unspecified_dims=\[1.5\]"),
])
def test_mesh_split_checks_its_lists(dims, unspecified, msg):
  with pytest.raises(gs.SpecError, match=msg):
    gs.mesh_split(np.ones((8, 4), np.float32), np.arange(8).reshape(2, 4), dims, unspecified_dims=unspecified)
