"""The estimated peak memory per device (the memory pass) and strict mode's refusal of involuntary gathers."""

import os
import sys

import pytest
import tensorflow as tf

import numpy as np

from conftest import loop_step, pipeline_step
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.sharding import device_memory, memory
from tf_gspmd.rewriter.sharding.auto import plan_memory

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

M1 = gs.Mesh((1,), ("d",))
M8 = gs.Mesh((8,), ("d",))
M24 = gs.Mesh((2, 4), ("data", "model"))


def test_matmul_chain_peaks_where_two_activations_meet():
  """x[64,128] @ w1[128,256] @ w2[256,512] @ w3[512,16] in float32 on one device. h1 (64 KiB) is still live when
  h2 (128 KiB) is written; h1 is freed after that, so y (4 KiB) meets h2 alone: the peak is at h2's MatMul,
  arguments (the partition id's 4 bytes included) plus h1 and h2."""
  f = gs.function(lambda x, w1, w2, w3: ((x @ w1) @ w2) @ w3, mesh=M1)
  low = f.lower(tf.TensorSpec([64, 128]), tf.TensorSpec([128, 256]), tf.TensorSpec([256, 512]),
                tf.TensorSpec([512, 16]))
  est = low.report.memory
  arguments = 4 * (64 * 128 + 128 * 256 + 256 * 512 + 512 * 16) + 4
  activations = 4 * (64 * 256 + 64 * 512)
  assert (est.argument_bytes, est.activation_bytes, est.state_bytes, est.constant_bytes) == (arguments, activations,
                                                                                             0, 0)
  assert low.report.peak_bytes_per_device == arguments + activations
  assert est.at == "matmul_1 (MatMul)"
  assert [(b.op, b.bytes) for b in est.largest] == [("matmul_1", 4 * 64 * 512), ("matmul", 4 * 64 * 256)]
  assert f"peak memory {arguments + activations:,} B per device" in str(low.report)


def test_estimate_of_a_graph_def_frees_after_the_last_reader_and_aliases_allocate_nothing():
  """a = x + 1 is read by b and (through a Reshape, which aliases it) by c; it dies after c, not after b."""
  def fn(x):
    a = x + 1.0
    b = a * 2.0
    c = tf.reshape(a, [16, 64]) * 3.0
    return tf.reduce_sum(b) + tf.reduce_sum(c)

  graph = tf.function(fn).get_concrete_function(tf.TensorSpec([32, 32])).graph
  gd = graph.as_graph_def()
  est = device_memory.estimate(gd, arguments=[graph.inputs[0].op.name])
  kib = 32 * 32 * 4
  assert est.argument_bytes == kib
  assert est.activation_bytes == 3 * kib   # a, b and c live at once (at c's Mul)
  assert {b.op_type for b in est.largest} == {"AddV2", "Mul"}


def test_megatron_training_step_needs_less_than_half_the_unpartitioned_peak():
  specs = (tf.TensorSpec([256, 1024]), tf.TensorSpec([256, 1024]), tf.TensorSpec([1024, 4096]),
           tf.TensorSpec([4096, 1024]))
  split = gs.function(tm.mlp_train_step, mesh=M24, in_shardings=(P("data", None), P("data", None),
                                                                  P(None, "model"), P("model", None))).lower(*specs)
  whole = gs.function(tm.mlp_train_step, mesh=M1).lower(*specs)
  assert 0 < split.report.peak_bytes_per_device <= 0.5 * whole.report.peak_bytes_per_device
  # The collective buffers count at what they carry (the combined all-reduce of the gradients is live at its peak).
  assert split.report.memory.collective_bytes > 0


def test_variables_count_their_shard_and_plan_mode_reports_a_peak():
  """Lowered for 64 devices without them: the estimate is there; a (replicated) variable counts whole, and what is
  computed from its reads has the shard's static shape (x's 16 rows times v's 1024 columns)."""
  mesh = gs.Mesh((8, 8), ("data", "model"))
  v = tf.Variable(tf.zeros([512, 1024]))
  f = gs.function(lambda x: tf.reduce_sum(x @ v), mesh=mesh, in_shardings=(P("data", None),))
  low = f.lower(tf.TensorSpec([128, 512]))
  est = low.report.memory
  assert low.program.devices is None
  assert est.state_bytes == low.report.state_bytes()[0] > 0
  assert low.report.peak_bytes_per_device >= est.argument_bytes + est.state_bytes + 16 * 128 * 4
  assert "peak memory" in str(low.report)


def test_a_loop_body_counts_on_top_of_its_carried_values():
  """The body's temporaries (a [256,256] product each iteration) count at the While, above its carried inputs."""
  def fn(x, w):
    return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, tf.tanh(y @ w) + 1.0), (0, x))[1]

  low = gs.function(fn, mesh=M1).lower(tf.TensorSpec([256, 256]), tf.TensorSpec([256, 256]))
  est = low.report.memory
  if not any(n.op in memory.CALL_OPS for n in low.graph_def.node):
    pytest.skip("the loop was unrolled or folded")
  kib = 256 * 256 * 4
  assert est.peak_bytes >= est.argument_bytes + 2 * kib + kib   # carried in, carried out, at least one temporary
  assert any("body" in b.op_type for b in est.largest)


def test_strict_refuses_an_involuntary_full_gather():
  """Cumsum along a split dimension gathers its 4 MiB operand: a warning, with strict=True a PartitionError that
  names the tensor, its layout and the fix."""
  args = dict(mesh=M8, in_shardings=(P("d", None),), out_shardings=P("d", None))
  spec = tf.TensorSpec([1024, 1024])
  low = gs.function(lambda x: tf.math.cumsum(x, axis=0), **args).lower(spec)
  assert any(w.startswith("involuntary full rematerialization") for w in low.report.warnings)
  with pytest.raises(gs.PartitionError, match=r"strict=True forbids an involuntary full rematerialization: x "
                                              r"\(float32\[1024,1024\]\), laid out as P\('d', None\).*Fix:") as e:
    gs.function(lambda x: tf.math.cumsum(x, axis=0), strict=True, **args).lower(spec)
  assert e.value.node == "Cumsum"


@pytest.mark.parametrize("strict", [False, True])
def test_a_gather_the_user_asked_for_is_not_involuntary(strict):
  """A 2 MiB split value returned replicated (out_shardings=P(), or gs.shard(..., P())): a gather, asked for."""
  spec = tf.TensorSpec([1024, 512])
  for f in (gs.function(lambda x: x * 2.0, mesh=M8, in_shardings=(P("d", None),), out_shardings=P(), strict=strict),
            gs.function(lambda x: gs.shard(x * 2.0, P()), mesh=M8, in_shardings=(P("d", None),), strict=strict)):
    low = f.lower(spec)
    assert low.report.counts() == {"all-gather": 1} and not low.report.warnings
    # The gathered value is live at the peak, sized from what the gather carries.
    assert any(b.op_type == "CollectiveGatherV2" and b.bytes == 1024 * 512 * 4 for b in low.report.memory.largest)


def test_a_small_weight_gathered_whole_is_involuntary():
  """Under 1 MiB, an all-gather is still flagged when it rebuilds the full shape of a split variable (a weight or
  its gradient on every device): cumsum along the weight's split dim. The same shape as an argument is not."""
  w = gs.variable(gs.initializers.Normal(seed=1), [64, 24], mesh=M8, spec=P("d", None), name="w")

  def step():
    return tf.reduce_sum(tf.math.cumsum(w, axis=0) * 2.0)

  low = gs.function(step, mesh=M8).lower()
  assert [x for x in low.report.warnings if "weight-sized tensor (the shape of split variable w" in x], low.report
  assert [c.shape for c in low.report.rematerializations] == [(64, 24)]
  with pytest.raises(gs.PartitionError, match=r"full rematerialization.*weight-sized \(the shape of split variable w"):
    gs.function(step, mesh=M8, strict=True).lower()
  x = tf.TensorSpec([64, 24])
  low = gs.function(lambda a: tf.math.cumsum(a, axis=0), mesh=M8, in_shardings=(P("d", None),),
                    out_shardings=P("d", None)).lower(x)
  assert low.report.counts().get("all-gather") and not low.report.warnings and not low.report.rematerializations


def test_a_live_buffer_of_unknown_rank_is_listed_without_a_shape():
  """A tensor of unknown rank (a loop body's TensorList read in a gradient) can be live at the peak: it is listed
  with shape "?" instead of failing the estimate."""
  with tf.Graph().as_default():
    unknown = tf.compat.v1.placeholder(tf.float32, None)
    partial = tf.compat.v1.placeholder(tf.float32, [None, 4])
  assert device_memory._static_shape(unknown) is None and device_memory._static_shape(partial) == (None, 4)  # pylint: disable=protected-access
  assert str(memory.LiveBuffer("x", "TensorListGetItem", "float32", None, 0)) == "x (TensorListGetItem) float32[?] 0 B"


# ----------------------------------------------------------------------------------------------------------
# One accounting: the plan's count (what memory_budget bounds) and the per-device program's estimate


def _program(name, devices):
  """(step, specs, in_shardings, mesh) of one of the programs the accounting is checked on."""
  two = (1, 1) if devices == 1 else (2, 4)
  if name == "mlp":
    return (tm.mlp_train_step, [tf.TensorSpec([64, 256]), tf.TensorSpec([64, 256]), tf.TensorSpec([256, 1024]),
                                tf.TensorSpec([1024, 256])],
            (P("data", None), P("data", None), P(None, "model"), P("model", None)), gs.Mesh(two, ("data", "model")))
  if name == "transformer":
    step, args, specs = tm.megatron_train_args(tm.Config(layers=2))
    return (step, [tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in args], specs,
            gs.Mesh(two, ("data", "model")))
  if name == "pipeline":
    return (pipeline_step, [tf.TensorSpec([16, 8]), tf.TensorSpec([4, 2, 8, 8])], (P("data", None), P("stage")),
            gs.Mesh((1, 1) if devices == 1 else (4, 2), ("stage", "data")))
  return (loop_step, [tf.TensorSpec([256, 256]), tf.TensorSpec([256, 256])], (P("data", None), P(None, "model")),
          gs.Mesh(two, ("data", "model")))


@pytest.mark.parametrize("name", ["mlp", "transformer", "pipeline", "while_loop"])
@pytest.mark.parametrize("devices", [1, 8])
def test_the_estimate_is_the_plans_count_plus_what_partitioning_adds(name, devices):
  """The memory pass's Account holds the plan's count -- plan_memory's, what memory_budget bounds: the same rules
  on the global program with every tensor at its layout -- and the per-device program's estimate, which exceeds
  it by at most the bytes partitioning added at its peak (collective buffers, per-device tables and partition
  id, reshard temporaries), each stated in the report. Where partitioning frees a tensor of the plan earlier and
  the per-device program holds less than the count, the report says so."""
  step, specs, in_shardings, mesh = _program(name, devices)
  low = gs.function(step, mesh=mesh, in_shardings=in_shardings).lower(*specs)
  account, count = low.report.memory, memory.plan_estimate(low.program)
  assert account.plan == count and sum(plan_memory(low.program)) == count.peak_bytes
  assert account.peak_bytes <= count.peak_bytes + account.added_bytes
  text = str(low.report)
  assert f"the plan at its layouts (what memory_budget bounds): {count.peak_bytes:,} = " in text
  assert f"partitioning adds: {account.peak_bytes - count.peak_bytes:+,} = collective buffers " in text
  assert account.peak_bytes >= count.peak_bytes or "the per-device program holds less than the plan's count" in text
  if devices == 1:   # nothing is split: the per-device program is the plan, plus the partition id and tables
    assert account.added_collective_bytes == 0 and 0 <= account.peak_bytes - count.peak_bytes <= account.added_bytes
    if name in ("mlp", "transformer"):
      assert account.at == count.at or account.activation_bytes == count.activation_bytes


def test_a_loop_keeps_trips_times_its_intermediates_for_the_gradient():
  """The forward While returns TensorLists of its three iterations' intermediates for its gradient loop: each
  counts 3 elements at the element's layout in the plan's count and in the per-device estimate alike, and they
  are live where the gradient loop runs (the peak)."""
  step, specs, in_shardings, mesh = _program("while_loop", 8)
  low = gs.function(step, mesh=mesh, in_shardings=in_shardings).lower(*specs)
  layouts = memory.Layouts(low.program)
  assert layouts.lists
  for r, nbytes in layouts.lists.items():
    info = low.program.ir.info(r)
    assert nbytes == 3 * memory.shard_bytes(info.value_shape, info.value_dtype, low.program.shardings[r]) > 0
  biggest = max(layouts.lists.values())
  for est in (low.report.memory, layouts.count()):
    assert "while_grad" in est.at
    assert any(b.op == "while" and b.op_type == "StatelessWhile" and b.bytes == biggest for b in est.largest)


@pytest.mark.parametrize("peak,added,phrase", [
    (1_000, 300, "less 100 of the plan's bytes not live there"),
    (1_000, 0, "plus 200 of the plan's own tensors above the plan's peak"),
])
def test_the_accounts_last_term_is_never_less_a_negative_number(peak, added, phrase):
  """"partitioning adds" ends with the plan's bytes not live at the per-device peak; where more of the plan's
  own tensors are live there than at the plan's peak (a negative count), it says so as a sum, in the report and
  in the binaries' plan printout alike."""
  plan = memory.MemoryEstimate(800, 0, 0, 0, 800, 0, "plan_peak")
  account = device_memory.Account(peak, 0, 0, 0, peak, 0, "device_peak", plan=plan, added_other_bytes=added)
  assert account.plan_bytes_elsewhere().startswith(phrase)
  assert phrase in str(account) and "less -" not in str(account)
