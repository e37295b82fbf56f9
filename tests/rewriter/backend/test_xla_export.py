"""partitioner="xla": the completed program exported with every layout as XLA sharding, compiled by XLA.

The ten reference workloads are lowered with partitioner="xla"; the exported program's HLO (before any XLA pass)
carries, on the Sharding custom-call of every annotated tensor, exactly the layout completion gave that tensor.
"""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd._function import DEFAULT_PARTITIONER, default_partitioner
from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.errors import InputError
from tf_gspmd.rewriter.backend import xla_export
from tf_gspmd.rewriter.graph.graph_view import public_key

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench"))
import workloads  # noqa: E402  pylint: disable=g-import-not-at-top

CASES = list(workloads.workloads())


def _same(a, b, rank):
  """Whether shardings `a` and `b` lay out a tensor of rank `rank` alike (a replicated layout of any rank)."""
  if a.is_maximal or b.is_maximal:
    return a == b
  return a.tiled(rank) == b.tiled(rank)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_exported_hlo_carries_completions_layouts(case):
  name, fn, mesh, ins, outs, args, _ = case
  low = gs.function(fn, mesh=mesh, in_shardings=ins, out_shardings=outs, partitioner="xla").lower(
      *[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])
  exported, shardings, ir = low.exported, low.shardings, low.program.ir
  hlo = xla_export.hlo_annotations(low.xla_hlo())
  # every numeric tensor of the global graph is annotated, with its completed layout, in the graph ...
  expected = {r for r in ir.tensors() if ir.info(r).partitionable}
  assert {r for r, _ in exported.annotations.values()} == expected
  ops = {nd.name: nd for nd in exported.graph_def.node if nd.op == "XlaSharding"}
  for node, (r, s) in exported.annotations.items():
    assert ops[node].attr["sharding"].s == s.to_proto().SerializeToString() == ops[node].attr["_XlaSharding"].s
  # ... and in the HLO XLA reads, arguments at their entry and results at their exit among them
  by_ref = {r: node for node, (r, _) in exported.annotations.items()}
  must = [f"{n}:0" for n in low.program.input_names] + list(ir.outputs)
  assert all(by_ref[r] in hlo for r in must), name
  assert len(hlo) >= 0.9 * len(exported.annotations), name   # (TF drops only what no result needs)
  checked = 0
  for node, proto in hlo.items():
    if node not in exported.annotations:
      continue
    r, _ = exported.annotations[node]
    rank = len(ir.info(r).shape)
    assert _same(Sharding.from_proto(proto, mesh), shardings[public_key(r)], rank), (name, r)
    checked += 1
  assert checked == len([n for n in hlo if n in exported.annotations])
  assert "planned: XLA partitions this program" in str(low.report)


def test_call_runs_the_exported_program_unpartitioned(rng):
  mesh = gs.Mesh((2, 4), ("data", "model"))
  v = tf.Variable(rng.standard_normal((16, 8)).astype(np.float32))

  def step(x, w):
    y = tf.nn.relu(x @ w)
    v.assign_add(0.5 * v)
    return y, tf.reduce_sum(y) + tf.reduce_sum(v)

  x, w = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 32)).astype(np.float32)
  f = gs.function(step, mesh=mesh, in_shardings=(P("data", None), P(None, "model")), partitioner="xla")
  start = v.numpy()
  y, total = f(x, w)
  assert isinstance(y, tf.Tensor) and "CPU:0" in y.device
  assert_close(y.numpy(), np.maximum(x @ w, 0.0), rtol=1e-5, atol=1e-5)
  assert_close(v.numpy(), 1.5 * start)
  assert_close(total.numpy(), np.maximum(x @ w, 0.0).sum() + 1.5 * start.sum(), rtol=1e-4, atol=1e-3)
  low = f.lower(tf.TensorSpec(x.shape), tf.TensorSpec(w.shape))
  assert low.partitioner == "xla" and low.program.device_program is None
  assert "ENTRY" in low.xla_hlo() and low.xla_function.structured_input_signature


def test_default_partitioner_and_bad_values():
  assert default_partitioner(None) == DEFAULT_PARTITIONER[None] == "tf_gspmd"
  assert default_partitioner(("/job:localhost/replica:0/task:0/device:CPU:0",)) == DEFAULT_PARTITIONER["CPU"]
  assert default_partitioner(("/job:worker/replica:0/task:0/device:TPU:0",)) == "xla"   # TPUs: XLA partitions
  mesh = gs.Mesh((8,), ("data",))
  f = gs.function(lambda x: x * 2.0, mesh=mesh, in_shardings=P("data"))
  low = f.lower(tf.TensorSpec([16]))
  assert low.partitioner == "tf_gspmd" and low.report.planned is None
  with pytest.raises(InputError, match="partitioner=\"xla\""):
    low.exported  # pylint: disable=pointless-statement
  with pytest.raises(InputError, match="partitioner must be"):
    gs.function(lambda x: x, mesh=mesh, partitioner="gspmd")


def test_a_variable_stored_sharded_stays_current():
  """A variable tf_gspmd stores sharded (from an earlier gs.function) is read and written by the exported program
  with its current value, and the next tf_gspmd step sees what the exported program wrote."""
  mesh = gs.Mesh((2, 4), ("data", "model"))
  v = tf.Variable(np.arange(32, dtype=np.float32).reshape(4, 8))

  def step(x):
    v.assign(gs.shard(v * x, P(None, "model")))
    return tf.reduce_sum(v)

  ours, xla = gs.function(step, mesh=mesh), gs.function(step, mesh=mesh, partitioner="xla")
  assert ours(2.0).numpy() == 992.0 and gs.sharding_of(v) == Sharding.from_spec(mesh, P(None, "model"))
  assert xla(3.0).numpy() == 2976.0
  assert ours(1.0).numpy() == 2976.0


@pytest.mark.parametrize("spec", [P(), P("data", None), P(None, "model"), P(("model", "data")), P("model", "data")],
                         ids=str)
def test_hlo_sharding_text_round_trip(spec):
  mesh = gs.Mesh((2, 4), ("data", "model"))
  s = Sharding.from_spec(mesh, spec, rank=2)
  text = xla_export.hlo_sharding_text(s)
  assert _same(Sharding.from_proto(xla_export.parse_hlo_sharding(text), mesh), s, 2), text


def test_parse_hlo_sharding_spellings():
  mesh = gs.Mesh((2, 4), ("data", "model"))
  iota = xla_export.parse_hlo_sharding("{devices=[4,2]<=[2,4]T(1,0)}")
  assert list(iota.tile_assignment_devices) == [0, 4, 1, 5, 2, 6, 3, 7]
  assert Sharding.from_proto(iota, mesh) == Sharding.from_spec(mesh, P("model", "data"))
  assert Sharding.from_proto(xla_export.parse_hlo_sharding("{maximal device=3}"), mesh).maximal == 3
  with pytest.raises(ValueError, match="cannot read"):
    xla_export.parse_hlo_sharding("{devices=[2,4]0,1,2,3,4,5,6,7 last_tile_dims={manual}}")


def test_strings_are_a_typed_error_before_xla_compiles():
  """XLA has no string type: a string argument or a string op is refused when lowered, naming it and the way out
  (tf2xla would refuse the compiled function at its first call, naming an internal `_Arg`); the default
  partitioner runs the same function."""
  mesh = gs.Mesh((2, 4), ("data", "model"))
  x, s = np.ones((8, 4), np.float32), np.array(["ab", "c"])

  def fn(x, s):
    return tf.strings.length(s) + tf.cast(tf.reduce_sum(x), tf.int32)

  with pytest.raises(gs.InputError, match=r"argument 1 \(s\) is a tf.string"):
    gs.function(fn, mesh=mesh, partitioner="xla")(x, s)
  with pytest.raises(gs.UnsupportedOpError, match="AsString.*makes a string"):
    gs.function(lambda x: tf.strings.length(tf.strings.as_string(x)), mesh=mesh, partitioner="xla")(x)
  assert_close(gs.function(fn, mesh=mesh)(x, s).numpy(), fn(x, s).numpy())
