"""The collectives backend on 8 logical CPUs: exact collective-permutes, every dtype at its own width."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import wrap_function

import tf_gspmd as gs
from tf_gspmd.runtime import parallel
from tf_gspmd.rewriter.collectives import widths
from tf_gspmd.rewriter.collectives.builders import Backend
from tf_gspmd.rewriter.report import ReportBuilder

M8 = gs.Mesh((8,), ("d",))
M24 = gs.Mesh((2, 4), ("a", "b"))


def _run(mesh, body, values, processes=None, devices=None):
  """body(backend, x) built into one per-device program and run on every device of `mesh` (x: values[p] on
  device p). `processes`: per position, the process the backend is told drives it (all run in this one);
  `devices`: the mesh's devices (default: the first CPUs in order). Returns (the per-device results, the report)."""
  devices = devices or tuple(d.name for d in tf.config.list_logical_devices("CPU"))[:mesh.size]
  graph, report = tf.Graph(), ReportBuilder()
  with graph.as_default():
    pid = tf.compat.v1.placeholder(tf.int32, [], name="pid")
    x = tf.compat.v1.placeholder(tf.as_dtype(values[0].dtype), values[0].shape, name="x")
    backend = Backend(mesh, devices, pid, lambda table, name: tf.gather(tf.constant(table, name=name), pid), report,
                      processes)
    tf.identity(body(backend, x), name="out")
  fn = wrap_function.function_from_graph_def(graph.as_graph_def(), ["pid:0", "x:0"], ["out:0"])
  where = parallel.local(devices)
  pd, packed_pid = where.pd, where.pid
  comps = []
  for d, v in zip(devices, values):
    with tf.device(d):
      comps.append(tf.identity(tf.constant(v)))
  with tf.device(pd._name):  # pylint: disable=protected-access
    (out,) = fn(packed_pid, pd.pack(comps))
  return [t.numpy() for t in pd.unpack(out)], report.build()


def _members(mesh, axes):
  """Per device: (its group's members in mesh order, its number in the group)."""
  of, members = Backend(mesh, None, None, None, ReportBuilder()).groups(axes)
  return {p: (m, m.index(p)) for m in members for p in m}


@pytest.mark.parametrize("kind", ["all-reduce", "all-gather", "all-to-all", "reduce-scatter"])
def test_a_group_of_one_emits_nothing(kind):
  """Over axes of size 1 each collective is its operand: no op, no report entry (an all-reduce of one replica)."""
  mesh = gs.Mesh((1, 8), ("one", "d"))
  build = {"all-reduce": lambda b, x: b.all_reduce(x, ("one",), "Add", "s", "r"),
           "all-gather": lambda b, x: b.all_gather(x, 0, ("one",), "s", "r"),
           "all-to-all": lambda b, x: b.all_to_all(x, 0, 1, ("one",), "s", "r"),
           "reduce-scatter": lambda b, x: b.reduce_scatter(x, 1, ("one",), "Add", "s", "r")}[kind]
  values = [np.arange(12, dtype=np.float32).reshape(3, 4) * (p + 1) for p in range(8)]
  got, report = _run(mesh, build, values)
  for p in range(8):
    np.testing.assert_array_equal(got[p], values[p])
  assert not report.collectives
  # Over an axis of size 8 the same call does emit one.
  _, report = _run(mesh, lambda b, x: b.all_reduce(x, ("d",), "Add", "s", "r"), values)
  assert len(report.collectives) == 1


@pytest.mark.parametrize("mesh,axes", [(M8, ("d",)), (M24, ("a",)), (M24, ("b",))], ids=["8", "2x4:a", "2x4:b"])
@pytest.mark.parametrize("shift,cyclic", [(1, False), (-1, False), (1, True), (-1, True), (2, False)], ids=str)
def test_permute_shifts(mesh, axes, shift, cyclic):
  """Member k's tensor arrives at member k + shift; with no wrap-around the edge members get the fill."""
  values = [np.full((3, 5), p, np.float32) + np.arange(15, dtype=np.float32).reshape(3, 5) for p in range(8)]
  for _ in range(3):   # the same program again: fresh instances, no race between a send and its token
    got, report = _run(mesh, lambda b, x: b.collective_permute(x, axes, shift=shift, cyclic=cyclic, fill=-7.0,
                                                               source="s", reason="r"), values)
    for p, (members, k) in _members(mesh, axes).items():
      src = k - shift
      if cyclic:
        src %= len(members)
      want = values[members[src]] if 0 <= src < len(members) else np.full((3, 5), -7.0, np.float32)
      np.testing.assert_array_equal(got[p], want, err_msg=f"device {p}")
  (c,) = report.collectives
  assert c.kind == "collective-permute" and c.bytes == 60
  assert {op.op for op in c.ops} <= {"CollectiveBcastSendV2", "CollectiveBcastRecvV2"}
  moves = cyclic or abs(shift) < c.group_size   # else every member only sends a token (4 bytes)
  assert report.bytes_per_device() == report.wire_bytes_per_device() == (60 if moves else 4)  # to one peer each


def test_non_cyclic_shift_sends_nothing_from_the_edge():
  """Right shift over 8: devices 0..6 send their buffer; device 7 sends only a one-element token to device 0."""
  x = [np.full((4, 1024), p, np.float32) for p in range(8)]
  got, report = _run(M8, lambda b, x: b.collective_permute(x, ("d",), shift=1, source="s", reason="r"), x)
  assert [float(g[0, 0]) for g in got] == [0.0, 0, 1, 2, 3, 4, 5, 6]
  send, recv = report.collectives[0].ops
  assert (send.op, send.bytes, send.device_bytes) == ("CollectiveBcastSendV2", 16384, (16384,) * 7 + (4,))
  assert (recv.op, recv.bytes) == ("CollectiveBcastRecvV2", 0)
  assert report.bytes_per_device() == 16384


@pytest.mark.parametrize("pairs", [[(0, 0), (1, 2), (2, 1), (5, 7)], [(k, (k + 1) % 6) for k in range(6)], []],
                         ids=["partial", "cycle_of_6", "none"])
def test_permute_pairs(pairs):
  """Arbitrary pairs: a member sending to itself keeps its value; one without a sender gets the fill."""
  values = [np.full((2, 3), p, np.int32) for p in range(8)]
  got, _ = _run(M8, lambda b, x: b.collective_permute(x, ("d",), pairs=pairs, fill=-1, source="s", reason="r"),
                values)
  want = {b: a for a, b in pairs}
  assert [int(g[0, 0]) for g in got] == [want.get(p, -1) for p in range(8)]
  assert all((g == g[0, 0]).all() for g in got)


def test_permute_pairs_must_be_a_partial_permutation_leaving_no_single_member_alone():
  with pytest.raises(gs.PartitionError, match="each member may send once"):
    _run(M8, lambda b, x: b.collective_permute(x, ("d",), pairs=[(0, 1), (2, 1)]), [np.zeros(2, np.float32)] * 8)
  with pytest.raises(gs.PartitionError, match="leave only member 7 without a peer"):
    _run(M8, lambda b, x: b.collective_permute(x, ("d",), pairs=[(k, (k + 1) % 7) for k in range(7)]),
         [np.zeros(2, np.float32)] * 8)


def test_halo_edges_are_selected_not_multiplied():
  """An inf next to the group's edge never turns the edge members' zero halos into NaN."""
  values = [np.full((2, 4), np.inf if p in (0, 7) else p, np.float32) for p in range(8)]
  got, report = _run(M8, lambda b, x: b.halo_exchange(x, 0, ("d",), 1, 1, "s", "r"), values)
  assert got[0].shape == (4, 4) and not np.isnan(np.stack(got)).any()
  np.testing.assert_array_equal(got[0][0], 0)
  np.testing.assert_array_equal(got[7][3], 0)
  np.testing.assert_array_equal(got[1][0], np.inf)
  assert report.counts() == {"collective-permute": 2} and report.bytes_per_device() == 2 * 4 * 4


DTYPES = [tf.bool, tf.int8, tf.uint8, tf.int16, tf.uint16, tf.bfloat16, tf.uint32, tf.float16, tf.int32, tf.int64,
          tf.float32, tf.float64]


def _values(dtype, shape):
  base = np.arange(np.prod(shape)).reshape(shape)
  if dtype == tf.bool:
    return [(base + p) % 3 == 0 for p in range(8)]
  return [((base + 7 * p) % 100).astype(dtype.as_numpy_dtype) for p in range(8)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_data_moves_at_its_own_width(dtype):
  """All-gather, all-to-all and collective-permute move every dtype bit for bit and send its own width (plus at
  most three bytes of packing per device), whatever dtypes TF's ops take."""
  xs = _values(dtype, (5, 3))
  width = 1 if dtype == tf.bool else dtype.size
  got, report = _run(M8, lambda b, x: b.all_gather(x, 1, ("d",), "s", "r"), xs)
  for g in got:
    np.testing.assert_array_equal(g, np.concatenate(xs, axis=1))
  assert 8 * 15 * width <= report.bytes_per_device() <= 8 * (15 * width + 3)

  ys = [np.concatenate([x] * 8) for x in xs]   # [40, 3]: chunk k of 5 rows goes to member k
  got, report = _run(M8, lambda b, x: b.all_to_all(x, 1, 0, ("d",), "s", "r"), ys)
  for p, g in enumerate(got):
    np.testing.assert_array_equal(g, np.concatenate([y[5 * p:5 * p + 5] for y in ys], axis=1))
  assert 8 * 15 * width <= report.bytes_per_device() <= 8 * (15 * width + 3)

  got, report = _run(M8, lambda b, x: b.collective_permute(x, ("d",), shift=1, cyclic=True, source="s", reason="r"),
                     xs)
  for p, g in enumerate(got):
    np.testing.assert_array_equal(g, xs[(p - 1) % 8])
  assert 15 * width <= report.bytes_per_device() <= 15 * width + 3
  (c,) = report.collectives
  assert c.differs == (dtype not in widths.takes("CollectiveBcastSendV2"))


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != tf.bool], ids=lambda d: d.name)
def test_reductions_keep_their_results_and_name_wider_carriers(dtype):
  """Reduce-scatter moves the dtype's own width and combines locally as before; an all-reduce carries a dtype
  CollectiveReduceV2 cannot sum in a wider one (bfloat16 sums as float32), and the report says so."""
  xs = _values(dtype, (40, 3))
  exact = np.int64 if dtype.is_integer else np.float64   # integer sums wrap on the way back, as TF's casts do
  total = sum(x.astype(exact) for x in xs).astype(dtype.as_numpy_dtype)
  got, report = _run(M8, lambda b, x: b.reduce_scatter(x, 0, ("d",), "Add", "s", "r"), xs)
  for p, g in enumerate(got):
    np.testing.assert_array_equal(g, total[5 * p:5 * p + 5])
  width = dtype.size
  assert 120 * width <= report.bytes_per_device() <= 120 * width + 8 * 3
  got, report = _run(M8, lambda b, x: b.all_reduce(x, ("d",), "Add", "s", "r"), xs)
  for g in got:
    np.testing.assert_array_equal(g, total)
  (c,) = report.collectives
  (op,) = c.ops
  native = dtype in widths.takes("CollectiveReduceV2") and dtype != tf.bfloat16
  assert (op.dtype == dtype.name) == native and bool(c.note) == (not native)
  assert report.bytes_per_device() == 120 * tf.as_dtype(op.dtype).size


def test_bfloat16_max_travels_as_bfloat16():
  xs = _values(tf.bfloat16, (4,))
  got, report = _run(M8, lambda b, x: b.all_reduce(x, ("d",), "Max", "s", "r"), xs)
  np.testing.assert_array_equal(got[0], np.max(np.stack(xs), axis=0))
  assert report.collectives[0].ops[0].dtype == "bfloat16" and report.bytes_per_device() == 8


# ---- across processes: two levels -------------------------------------------------------------------------------
# The backend is told which process drives each device; all of them run here, in one process, so the two-level
# collectives run for real on 8 CPUs and are checked against numpy (the multi-process runs are in test_cluster.py).

def _hosts(n, size=8):
  """Per position: its process, `n` processes holding size / n consecutive positions each."""
  return tuple(p // (size // n) for p in range(size))


def _levels_of(report):
  return [(op.kind, op.level, op.cross_process, op.group_size) for c in report.collectives for op in c.ops]


HIERARCHIES = [(M8, ("d",), 2), (M8, ("d",), 4), (M24, ("a", "b"), 2), (M24, ("b",), 4)]
HIERARCHY_IDS = ["8/2", "8/4", "2x4:a,b/2", "2x4:b/4"]


@pytest.mark.parametrize("mesh,axes,n", HIERARCHIES, ids=HIERARCHY_IDS)
@pytest.mark.parametrize("reverse", [False, True], ids=["in_order", "devices_reversed"])
def test_collectives_across_processes_run_in_two_levels_and_cross_with_one_slice(mesh, axes, n, reverse):
  """With L members of each group in every process, an all-reduce, an all-gather and a reduce-scatter give what
  the flat collective gives, and what crosses processes per device is 1/L of it (the flat size padded to L)."""
  devices = tuple(d.name for d in tf.config.list_logical_devices("CPU"))[:8]
  devices = tuple(reversed(devices)) if reverse else devices   # runtime rank order against mesh order
  members = _members(mesh, axes)
  size = len(members[0][0])
  hosts = _hosts(n)
  local = sum(hosts[q] == hosts[0] for q in members[0][0])   # members of a group in each process
  xs = [np.arange(15, dtype=np.float32).reshape(5, 3) * (p + 1) + p for p in range(8)]   # 15: padded to `local`

  got, report = _run(mesh, lambda b, x: b.all_reduce(x, axes, "Add", "s", "r"), xs, _hosts(n), devices)
  for p in range(8):
    np.testing.assert_allclose(got[p], sum(xs[q] for q in members[p][0]), rtol=1e-6)
  assert _levels_of(report) == [("all-to-all", "within", False, local), ("all-reduce", "across", True, size // local),
                                ("all-gather", "within", False, local)]
  assert report.cross_process_bytes_per_device() == -(-15 // local) * 4
  assert "hierarchical" in report.collectives[0].note

  got, report = _run(mesh, lambda b, x: b.all_gather(x, 1, axes, "s", "r"), xs, _hosts(n), devices)
  for p in range(8):
    np.testing.assert_array_equal(got[p], np.concatenate([xs[q] for q in members[p][0]], axis=1))
  assert [lv for _, lv, _, _ in _levels_of(report)] == ["across", "within"]
  assert report.cross_process_bytes_per_device() == 15 * 4 * size // local

  ys = [np.concatenate([x] * size) for x in xs]   # chunk k of 5 rows is member k's
  got, report = _run(mesh, lambda b, x: b.reduce_scatter(x, 0, axes, "Add", "s", "r"), ys, _hosts(n), devices)
  for p in range(8):
    group, k = members[p]
    np.testing.assert_allclose(got[p], sum(ys[q] for q in group)[5 * k:5 * k + 5], rtol=1e-6)
  assert [lv for _, lv, _, _ in _levels_of(report)] == ["within", "across"]
  assert report.cross_process_bytes_per_device() == 15 * 4 * size // local


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != tf.bool], ids=lambda d: d.name)
def test_two_level_reductions_take_every_dtype_the_flat_ones_take(dtype):
  """Sums (and maxima) in two levels equal the flat ones for every dtype, carried as the flat path carries it."""
  xs = _values(dtype, (40, 3))
  exact = np.int64 if dtype.is_integer else np.float64
  total = sum(x.astype(exact) for x in xs).astype(dtype.as_numpy_dtype)
  got, report = _run(M8, lambda b, x: b.all_reduce(x, ("d",), "Add", "s", "r"), xs, _hosts(2))
  for g in got:
    np.testing.assert_array_equal(g, total)
  assert len(report.collectives[0].ops) == 3
  got, _ = _run(M8, lambda b, x: b.all_reduce(x, ("d",), "Max", "s", "r"), xs, _hosts(4))
  for g in got:
    np.testing.assert_array_equal(g, np.max(np.stack(xs), axis=0))
  got, _ = _run(M8, lambda b, x: b.reduce_scatter(x, 0, ("d",), "Add", "s", "r"), xs, _hosts(2))
  for p, g in enumerate(got):
    np.testing.assert_array_equal(g, total[5 * p:5 * p + 5])
  got, _ = _run(M8, lambda b, x: b.all_gather(x, 0, ("d",), "s", "r"), xs, _hosts(4))
  for g in got:
    np.testing.assert_array_equal(g, np.concatenate(xs))


@pytest.mark.parametrize("processes", [None, _hosts(1), _hosts(8), (0, 0, 0, 1, 1, 1, 1, 1)],
                         ids=["unknown", "one", "one_device_each", "uneven"])
def test_collectives_stay_flat_without_several_members_in_every_process(processes):
  """In one process, with one member per process, or with processes holding different numbers of a group's
  members, each collective is one op, as before."""
  xs = [np.arange(15, dtype=np.float32).reshape(5, 3) + p for p in range(8)]
  got, report = _run(M8, lambda b, x: b.all_reduce(x, ("d",), "Add", "s", "r"), xs, processes)
  for g in got:
    np.testing.assert_array_equal(g, sum(xs))
  ((kind, level, crosses, group),) = _levels_of(report)
  assert (kind, level, group) == ("all-reduce", None, 8)
  assert crosses == (processes is not None and len(set(processes)) > 1)
  assert report.cross_process_bytes_per_device() == (60 if crosses else 0)
