"""Cross-mesh resharding (runtime/cross_mesh.py): values equal, and every destination device receives exactly the
bytes of its slice, assembled from pieces its senders hold."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.runtime import cross_mesh

import cluster_runs

DEVS = [d.name for d in tf.config.list_logical_devices("CPU")]


def _mesh(shape, names, first):
  n = int(np.prod(shape))
  return gs.Mesh(shape, names, devices=DEVS[first:first + n])


def _placed(x, mesh, spec):
  """`x` laid out as `spec` over `mesh` by a gs.function (the runtime's own values)."""
  return gs.function(tf.identity, mesh=mesh, in_shardings=spec, out_shardings=spec)(x)


CASES = [   # (shape, source mesh (shape, names, first device), source spec, destination mesh, destination spec)
    ((7, 5), ((2, 2), ("a", "b"), 0), P("a", None), ((3,), ("c",), 3), P(None, "c")),          # overlap, uneven
    ((16, 8), ((8,), ("x",), 0), P("x", None), ((2, 2), ("a", "b"), 4), P("a", "b")),           # 8 -> 4 devices
    ((4, 16), ((1, 2), ("d", "m"), 0), P(None, "m"), ((2, 2), ("d", "m"), 2), P("d", None)),    # disjoint
    ((6, 10), ((2, 2), ("a", "b"), 0), P(), ((2,), ("m",), 4), P(None, "m")),                   # from replicated
    ((5, 7), ((2,), ("x",), 0), P("x", None), ((3, 2), ("b", "a"), 2), P("b", "a")),            # uneven both ways
    ((3, 5, 6), ((2, 2), ("a", "b"), 4), P("b", None, "a"), ((2, 4), ("p", "q"), 0), P("q", "p", None)),  # 3-D
    ((9, 4), ((4,), ("x",), 0), P("x", None), ((4,), ("y",), 4), P()),                          # to replicated
]


@pytest.mark.parametrize("shape,src,src_spec,dst,dst_spec", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_each_destination_receives_exactly_its_slice(shape, src, src_spec, dst, dst_spec, dtype):
  x = np.arange(int(np.prod(shape))).reshape(shape).astype(dtype)
  a, b = _mesh(*src), _mesh(*dst)
  sx = _placed(x, a, src_spec)
  log = gs.TransferLog()
  y = gs.reshard(sx, b, dst_spec, log)
  np.testing.assert_array_equal(y.numpy(), x)
  want = gs.Sharding.from_spec(b, dst_spec, rank=len(shape))
  assert y.sharding == want
  received = log.bytes_received()
  src_devices = a.resolve_devices()
  for shard in gs.shards_of(y):
    # each destination device: its slice's bytes, no more, and its values
    assert received.get(shard.device, 0) == int(np.prod(shard.shape)) * x.itemsize, (shard, str(log))
    np.testing.assert_array_equal(shard.numpy(), x[shard.index])
  for c, d in zip(y.components, b.resolve_devices()):
    assert c.shape == want.shard_shape(shape) and c.device == d
  src_index = {s.position: s.index for s in gs.shards_of(sx)}
  for t in log.transfers:
    # every piece lies in the tile its sender holds and in the slice its receiver keeps
    assert t.src_device == src_devices[t.src_position]
    for piece, held in zip(t.index, src_index[t.src_position]):
      assert held.start <= piece.start and piece.stop <= held.stop
  assert log.total_bytes == sum(int(np.prod(s.shape)) for s in gs.shards_of(y)) * x.itemsize


def test_the_result_runs_on_the_destination_mesh():
  x = np.random.default_rng(0).normal(size=(6, 10)).astype(np.float32)
  a, b = _mesh((2, 2), ("a", "b"), 0), _mesh((2, 2), ("p", "q"), 4)
  y = gs.reshard(_placed(x, a, P("a", "b")), b, P("q", "p"))
  f = gs.function(lambda v: tf.tanh(v) * 2.0, mesh=b, in_shardings=P("q", "p"), out_shardings=P("q", "p"))
  np.testing.assert_allclose(f(y).numpy(), np.tanh(x) * 2.0, rtol=1e-6)


def test_replicas_share_the_sending():
  """A replicated source on 4 devices, sent to 4 other devices each wanting a quarter: one piece from each."""
  x = np.ones((8, 4), np.float32)
  log = gs.TransferLog()
  gs.reshard(_placed(x, _mesh((4,), ("x",), 0), P()), _mesh((4,), ("y",), 4), P("y", None), log)
  assert sorted(log.bytes_sent().values()) == [32, 32, 32, 32]
  assert log.moved_bytes == 8 * 4 * 4


def test_a_device_that_holds_its_slice_copies_it_locally():
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  a, b = _mesh((8,), ("x",), 0), _mesh((2, 4), ("u", "v"), 0)
  log = gs.TransferLog()
  y = gs.reshard(_placed(x, a, P("x", None)), b, P(("u", "v"), None), log)   # the same rows on the same devices
  np.testing.assert_array_equal(y.numpy(), x)
  assert log.moved_bytes == 0 and log.total_bytes == x.nbytes
  assert all(t.local for t in log.transfers)


def test_plan_needs_no_devices():
  """The plan alone, for 64 devices that do not exist: per destination the pieces of its slice."""
  names = [f"/job:worker/replica:0/task:{k // 8}/device:CPU:{k % 8}" for k in range(64)]
  a = gs.Mesh((8, 8), ("a", "b"), devices=names)
  b = gs.Mesh((4, 8), ("p", "q"), devices=names[32:])
  src = gs.Sharding.from_spec(a, P("a", "b"))
  dst = gs.Sharding.from_spec(b, P("q", "p"))
  plan = gs.plan_transfer((100, 36), tf.float32, src, dst, names, names[32:])
  for q, pieces in plan.items():
    starts, lengths = cross_mesh.tile_extent(dst, (100, 36), q)
    assert sum(t.bytes for t in pieces) == int(np.prod(lengths)) * 4
    covered = np.zeros(lengths, bool)
    for t in pieces:
      box = tuple(slice(s.start - a0, s.stop - a0) for s, a0 in zip(t.index, starts))
      assert not covered[box].any()
      covered[box] = True
    assert covered.all()


def test_errors():
  a, b = _mesh((2,), ("x",), 0), _mesh((2,), ("y",), 2)
  with pytest.raises(gs.InputError, match="ShardedTensor"):
    gs.reshard(np.ones((4, 4), np.float32), b, P("y"))
  sx = _placed(np.ones((4, 4), np.float32), a, P("x"))
  with pytest.raises(gs.SpecError, match="unknown mesh axis 'x'"):
    gs.reshard(sx, b, P("x"))
  with pytest.raises(gs.SpecError, match="rank 2"):
    gs.reshard(sx, b, P("y", None, None))


def test_between_processes_each_destination_receives_its_slice(exchange):
  """2 processes x 4 CPUs (tests/cluster_programs/cross_mesh_move.py): meshes within one process, across both,
  uneven and 3-D; every destination shard holds its slice, received as exactly its bytes, and only the pieces
  the slices need cross between the processes (none when the receiving process holds a replica)."""
  if exchange == "collectives":
    pytest.skip("a move between meshes runs no gs.function: the same under either option; run once")
  results = cluster_runs.launch(2, "cross_mesh_move.py")
  for k, r in results.items():
    for name, case in r.items():
      if name == "process":
        continue
      assert case["values"], (k, name, case)
      assert all(got == want for got, want in case["received"]), (k, name, case)
      assert case["crossing"] == case["need"], (k, name, case)
  assert results[1]["p0_to_p1_uneven"]["received"] == [[56, 56], [56, 56], [28, 28], [0, 0]]   # 5 cols over 4
  assert results[0]["p1_to_p0_3d"]["shards"] == 4 and results[1]["p1_to_p0_3d"]["shards"] == 0
  assert results[0]["replicated_stays_in_process"]["crossing"] == 0
  assert results[1]["replicated_stays_in_process"]["crossing"] == 0
  both = results[0]["both_to_both"]
  assert 0 < both["crossing"] < both["whole_value_bytes"]


def _random_case(rng):
  """A random (shape, source mesh and spec, destination mesh and spec): 1 to 3 dims of 1 to 9, meshes of 1 to 3
  axes over random subsets of the 8 devices (any order), each dim split over a random subset of axes."""
  def mesh(names):
    shape = [(1, 2, 4, 8), (2, 2, 2, 4), (2, 2, 2)][rng.integers(3)][:rng.integers(1, 4)]
    while int(np.prod(shape)) > 8:
      shape = shape[:-1]
    devices = [DEVS[k] for k in rng.permutation(8)[:int(np.prod(shape))]]
    return gs.Mesh(tuple(shape), names[:len(shape)], devices=devices)

  def spec(m, rank):
    axes = list(m.axis_names)
    rng.shuffle(axes)
    dims = [[] for _ in range(rank)]
    for a in axes:
      k = rng.integers(rank + 1)
      if k < rank:
        dims[k].append(a)
    return P(*[tuple(d) if d else None for d in dims])

  shape = tuple(int(n) for n in rng.integers(1, 10, size=rng.integers(1, 4)))
  a, b = mesh(("a", "b", "c")), mesh(("x", "y", "z"))
  return shape, a, spec(a, len(shape)), b, spec(b, len(shape))


@pytest.mark.parametrize("seed", range(24))
def test_random_pairs(seed):
  rng = np.random.default_rng(seed)
  shape, a, sa, b, sb = _random_case(rng)
  x = rng.normal(size=shape).astype(np.float32)
  log = gs.TransferLog()
  y = gs.reshard(_placed(x, a, sa), b, sb, log)
  np.testing.assert_array_equal(y.numpy(), x)
  received = log.bytes_received()
  for shard in gs.shards_of(y):
    assert received.get(shard.device, 0) == int(np.prod(shard.shape)) * 4, (shape, sa, sb, str(log))
    np.testing.assert_array_equal(shard.numpy(), x[shard.index])
