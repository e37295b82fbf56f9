"""The report counts what the per-device program sends: its emitted ops are the program's collective nodes."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_report_counts_program, check_partitioned
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.report import CollectiveRecord, Emitted, Report, ReportBuilder

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

M24 = gs.Mesh((2, 4), ("data", "model"))
M8 = gs.Mesh((8,), ("d",))


def test_megatron_mlp(rng):
  f = gs.function(lambda x, w1, w2: tf.nn.gelu(x @ w1) @ w2, mesh=M24,
                  in_shardings=(P("data", None), P(None, "model"), P("model", None)), out_shardings=P("data", None))
  low = f.lower(tf.TensorSpec([64, 1024]), tf.TensorSpec([1024, 4096]), tf.TensorSpec([4096, 1024]))
  assert_report_counts_program(low)
  assert low.report.bytes_per_device() == low.report.logical_bytes_per_device() == 131072
  assert "emitted:" not in str(low.report)   # the op sends what the logical all-reduce says


def test_spatially_split_conv_sends_its_halos_only(rng):
  x = rng.standard_normal((2, 32, 16, 4)).astype(np.float32)
  k = rng.standard_normal((3, 3, 4, 8)).astype(np.float32)
  spec = P(None, "d", None, None)
  low = check_partitioned(lambda x, k: tf.nn.conv2d(x, k, 1, "SAME"), [x, k], (spec, P()), M8, out=spec, tol=1e-4)
  assert_report_counts_program(low)
  halo = 2 * 1 * 16 * 4 * 4   # one row of [2, ., 16, 4] float32 from each neighbour
  assert low.report.counts() == {"collective-permute": 2}
  assert low.report.bytes_per_device() == low.report.logical_bytes_per_device() == 2 * halo


def test_pad_by_seven_sends_its_halos_only(rng):
  """x[64,1024] over 8 (8 rows a device), padded by 7 rows in front: 71 rows re-split 9 a device, so device t
  takes 7 - t rows from the previous one (device 1 the most, 6 rows of 4 KiB) and nothing from the next (the
  last device's window ends in rows past the input, padding that nobody sends): a halo, not a gather."""
  x = rng.standard_normal((64, 1024)).astype(np.float32)
  low = check_partitioned(lambda x: tf.pad(x, [[7, 0], [0, 0]]), [x], (P("d", None),), M8, out=P("d", None))
  assert_report_counts_program(low)
  assert low.report.counts() == {"collective-permute": 1}
  assert low.report.bytes_per_device() == 6 * 1024 * 4
  assert {op.op for op in low.report.emitted_ops()} == {"CollectiveBcastSendV2", "CollectiveBcastRecvV2"}


def test_bool_all_gather_travels_at_one_byte_an_element(rng):
  x = rng.standard_normal((64, 16)) > 0
  low = check_partitioned(lambda x: tf.logical_not(x), [x], (P("d", None),), M8, out=P())
  assert_report_counts_program(low)
  (c,) = low.report.collectives
  (op,) = c.ops
  assert (c.kind, c.dtype, c.bytes) == ("all-gather", "bool", 64 * 16)
  assert (op.op, op.dtype, op.bytes) == ("CollectiveGatherV2", "int32", 64 * 16)   # 4 bools to an int32
  assert "bool packed 4 to an int32" in str(low.report)


def test_combined_all_reduces_count_once(rng):
  def f(x, w1, w2, w3):
    return x @ w1, x @ w2, tf.reduce_sum(x @ w3, axis=1)

  low = gs.function(f, mesh=M24, in_shardings=(P(None, "model"), P("model", None), P("model", None),
                                               P("model", None)), out_shardings=P()).lower(
      tf.TensorSpec([8, 16]), tf.TensorSpec([16, 4]), tf.TensorSpec([16, 6]), tf.TensorSpec([16, 5]))
  assert_report_counts_program(low)
  (op,) = low.report.emitted_ops()
  assert all(c.ops == (op,) for c in low.report.collectives) and len(low.report.collectives) == 3
  assert low.report.bytes_per_device() == low.report.logical_bytes_per_device() == 4 * 8 * (4 + 6 + 5)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_megatron_training_step(jit_compile):
  low = gs.function(tm.mlp_train_step, mesh=M24, in_shardings=(P("data", None), P("data", None), P(None, "model"),
                                                  P("model", None)), jit_compile=jit_compile).lower(
      tf.TensorSpec([16, 64]), tf.TensorSpec([16, 64]), tf.TensorSpec([64, 128]), tf.TensorSpec([128, 64]))
  assert_report_counts_program(low)


def test_bytes_count_the_device_that_sends_the_most():
  """Ops through which devices send different amounts (a permute's data, its tokens) add up per device; ops
  that cleanup removed count nothing, and the report says their collective's result was unused."""
  reduce = Emitted("all-reduce", ("m",), "Add", "ar", "CollectiveReduceV2", "float32", (8,), 4, 32)
  send = Emitted("collective-permute", ("d",), None, "s", "CollectiveBcastSendV2", "float32", (2,), 2, 8,
                 (8, 8, 8, 4))
  recv = Emitted("collective-permute", ("d",), None, "r", "CollectiveBcastRecvV2", "float32", (2,), 2, 0)
  builder = ReportBuilder()
  builder.add(CollectiveRecord("all-reduce", "float32", (8,), 32, 4, ("m",), "a", "why", (reduce,)))
  builder.add(CollectiveRecord("collective-permute", "float32", (2,), 8, 4, ("d",), "b", "why", (send, recv)))
  report = builder.build()
  assert report.bytes_per_device() == 32 + 8 and report.logical_bytes_per_device() == 40
  assert report.wire_bytes_per_device() == 2 * 32 * 3 // 4 + 8
  assert str(send) == "CollectiveBcastSendV2 float32[2] (group 2), 8 B from 3 device(s), 4 B from 1 device(s)"
  pruned = report.with_ops_replaced({"s": None, "r": None})
  assert pruned.bytes_per_device() == 32 and pruned.collectives[1].ops == ()
  assert "emitted: nothing (the program does not use its result)" in str(pruned)
  assert report.bytes_per_device() == 32 + 8   # the report it came from is unchanged


def test_no_pass_changes_a_report_once_made(monkeypatch):
  """The partition pass makes the report; every later pass (combine, cleanup, memory, schedules, the pass manager)
  returns a new one: a report's fields cannot be assigned and its collections are tuples, so no pass can change a
  report another pass or the caller holds."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from tf_gspmd.rewriter import pipeline  # pylint: disable=g-import-not-at-top

  def contents(report):
    return tuple((f.name, getattr(report, f.name)) for f in dataclasses.fields(report) if f.name != "_memory")

  changed = []

  def watched(name, fn):
    def run(program):
      before = program.report
      seen = None if before is None else contents(before)
      out = fn(program)
      if before is not None and contents(before) != seen:
        changed.append(name)
      return out
    return name, run

  monkeypatch.setattr(pipeline, "PASSES", tuple(watched(n, fn) for n, fn in pipeline.PASSES))
  f = gs.function(lambda x, w: tf.reduce_sum(x @ w, axis=1) + tf.reduce_max(x @ w, axis=1), mesh=M24,
                  in_shardings=(P(None, "model"), P("model", None)))
  low = f.lower(tf.TensorSpec([8, 16]), tf.TensorSpec([16, 4]))
  assert not changed, f"passes changed a report they were given: {changed}"
  report = low.report
  assert report.combined and report.memory is not None   # the passes after partition did add to it
  with pytest.raises(dataclasses.FrozenInstanceError):
    report.warnings = ()
  for name, value in contents(report):
    assert not isinstance(value, (list, dict, set)), f"Report.{name} is a mutable {type(value).__name__}"
  with pytest.raises(TypeError):
    report.pass_times["complete"] = 0.0
  assert set(report.pass_times) == set(pipeline.PATHS[pipeline.path_of(low.program)])


def test_a_group_over_two_axes_prints_both_names_apart(rng):
  """Axes x and y print as "x,y" (no axis name contains the separator), not run together."""
  mesh = gs.Mesh((2, 4), ("x", "y"))
  f = gs.function(lambda a, b: a @ b, mesh=mesh, in_shardings=(P(None, ("x", "y")), P(("x", "y"), None)))
  low = f.lower(tf.TensorSpec([8, 16]), tf.TensorSpec([16, 8]))
  (record,) = low.report.collectives
  assert record.axes == ("x", "y") and " over x,y " in str(record)


def test_plan_for_several_processes_counts_the_bytes_that_cross_them():
  """Megatron on (2, 4) over 2 processes of 4 devices: the model axis stays inside a process, the data axis
  crosses. Over 8 processes every collective crosses."""
  def step(x, w1, w2):
    with tf.GradientTape() as tape:
      tape.watch([w1, w2])
      y = tf.nn.relu(x @ w1) @ w2
      loss = tf.reduce_sum(y)
    return [y] + tape.gradient(loss, [w1, w2])

  f = gs.function(step, mesh=M24, in_shardings=(P("data", None), P(None, "model"), P("model", None)),
                  out_shardings=(P("data", None), None, None))
  specs = (tf.TensorSpec([16, 32]), tf.TensorSpec([32, 64]), tf.TensorSpec([64, 32]))
  one = f.lower(*specs)
  two = f.lower(*specs, processes=2)
  eight = f.lower(*specs, processes=8)
  assert one.report.cross_process_bytes_per_device() == 0 and "across processes" not in str(one.report)
  crossing = [c for c in two.report.collectives if c.cross_process]
  assert crossing and all("data" in c.axes for c in crossing)
  assert all(c.axes == ("model",) for c in two.report.collectives if not c.cross_process)
  assert 0 < two.report.cross_process_bytes_per_device() < two.report.bytes_per_device()
  assert eight.report.cross_process_bytes_per_device() == eight.report.bytes_per_device()
  assert "across processes" in str(two.report)
  with pytest.raises(gs.MeshError, match="processes=3 must divide"):
    f.lower(*specs, processes=3)


def _gradient_step(x, w):
  with tf.GradientTape() as tape:
    tape.watch(w)
    loss = tf.reduce_sum(tf.nn.relu(x @ w))
  return tape.gradient(loss, w)


def test_plans_over_processes_send_one_slice_per_local_member_across_them():
  """Data parallel on 8 devices: the gradient's all-reduce spans every process. With L of its members in each
  process, what crosses processes per device falls by L (2 processes: 4, 4 processes: 2); with one device per
  process it is the flat all-reduce's. The logical collectives are the same in every plan."""
  f = gs.function(_gradient_step, mesh=M8, in_shardings=(P("d", None), P()), out_shardings=P())
  specs = (tf.TensorSpec([64, 32]), tf.TensorSpec([32, 48]))
  flat = f.lower(*specs, processes=8).report
  assert flat.cross_process_bytes_per_device() == 32 * 48 * 4
  for n, local in ((2, 4), (4, 2)):
    report = f.lower(*specs, processes=n).report
    assert report.cross_process_bytes_per_device() * local == flat.cross_process_bytes_per_device()
    assert report.counts() == flat.counts() and report.logical_bytes_per_device() == flat.logical_bytes_per_device()
    (record,) = report.collectives
    assert [(op.level, op.cross_process) for op in record.ops] == [("within", False), ("across", True),
                                                                    ("within", False)]
    assert "across processes" in str(report) and "within each process" in str(report)


def test_a_plan_without_processes_emits_each_collective_flat():
  """In one process every collective is one op over its whole group, whatever the mesh."""
  f = gs.function(_gradient_step, mesh=M8, in_shardings=(P("d", None), P()), out_shardings=P())
  report = f.lower(tf.TensorSpec([64, 32]), tf.TensorSpec([32, 48])).report
  ((op,),) = [c.ops for c in report.collectives]
  assert (op.kind, op.level, op.group_size, op.bytes, op.cross_process) == ("all-reduce", None, 8, 6144, False)
  assert "within each process" not in str(report)


def test_a_plan_for_2048_devices_on_256_hosts_crosses_hosts_with_an_eighth():
  """Mesh (32, 64) over 256 hosts of 8 devices: a group of the model axis has 8 members in each of 8 hosts, so its
  all-reduce sends 1/8 across hosts; the data axis has one member per host and stays flat."""
  mesh = gs.Mesh((32, 64), ("data", "model"))
  f = gs.function(lambda x, w: x @ w, mesh=mesh, in_shardings=(P("data", "model"), P("model", None)),
                  out_shardings=P("data", None))
  specs = (tf.TensorSpec([256, 4096]), tf.TensorSpec([4096, 512]))
  hosts = f.lower(*specs, processes=256).report
  alone = f.lower(*specs, processes=2048).report
  assert alone.cross_process_bytes_per_device() == 8 * 512 * 4
  assert hosts.cross_process_bytes_per_device() * 8 == alone.cross_process_bytes_per_device()
  (record,) = hosts.collectives
  assert record.axes == ("model",) and [op.group_size for op in record.ops] == [8, 8, 8]


def test_the_report_states_the_constants_each_device_holds(rng):
  table = rng.standard_normal((256, 512)).astype(np.float32)   # 512 KiB of literal values, held by every device
  low = check_partitioned(lambda x: x + tf.constant(table, name="table"), [table], (P("d", None),), M8,
                          out=P("d", None))
  (line,) = [line for line in str(low.report).splitlines() if line.startswith("constants: ")]
  assert f"{low.report.constants.bytes:,} B per device" in line
  assert "largest: table float32[256,512] 524,288 B" in line
