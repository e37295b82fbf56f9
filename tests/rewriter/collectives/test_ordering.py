"""Every device launches its collectives in one order (rewriter/collectives/ordering.py): the program's edges force one
sequence of collectives in the graph and in every function body, each device's k-th collective is one its whole group
launches k-th, and a program of many independent collectives runs 200 times through TF's collectives without a
hang. Every partitioned result is compared with the unpartitioned program's."""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from conftest import check_partitioned
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.errors import PartitionError
from tf_gspmd.rewriter.collectives import groups as collectives, ordering, vocabulary

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

MESH = gs.Mesh((2, 4), ("data", "model"))
ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")


def _launched_by_every_device(low):
  """The instance keys in the order every device launches them (the program's edges force it; every device runs
  this one program), checking for each collective of the top-level graph that the group key each device computes
  from its partition id names a group holding that device, and that every member computes the same key: each
  member launches it at the same position of the sequence."""
  gd = low.graph_def
  keys = ordering.sequence(gd)
  program = low.program
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(gd, name="")
  top = [n for n in gd.node if n.op in vocabulary.TF_COLLECTIVE_OPS]
  group_inputs = {}
  for n in top:
    op = graph.get_operation_by_name(n.name)
    group_inputs[n.name] = op.inputs[[a.name for a in op.op_def.input_arg].index("group_key")]
    assert ordering.instance_key_of(gd, n) in keys
  per_device = []
  with tf.compat.v1.Session(graph=graph) as sess:
    for p in range(len(program.devices)):
      per_device.append(sess.run(group_inputs, feed_dict={f"{program.partition_id}:0": p}))
  for p, device in enumerate(program.devices):
    for name, key in per_device[p].items():
      members = collectives.group_members(int(key))
      assert device in members, (name, device, members)
      for q in members:
        assert per_device[program.devices.index(q)][name] == key, (name, device, q)
  return keys


def _lowered(fn, args, specs, out=None):
  f = gs.function(fn, mesh=MESH, in_shardings=tuple(specs), out_shardings=out, exchange="collectives")
  low = f.lower(*[tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in args])
  return f, low


def _loop(x, w, v):
  """Two independent all-reduces per iteration (over `model` and over `data`) inside a loop of 3 iterations."""
  y, s = x, tf.zeros([x.shape[1]])
  for _ in tf.range(3):   # both read the last iteration's y only
    r = gs.shard(tf.reduce_sum(v * y[0], axis=0), P())
    y = gs.shard(tf.tanh(y @ w) * 0.5, P())
    s = s + r
  return y, s


def test_mlp_train_step_launches_its_collectives_in_one_order(rng):
  args = [rng.standard_normal((64, 128)).astype(np.float32), rng.standard_normal((64, 128)).astype(np.float32),
          (rng.standard_normal((128, 256)) * 0.1).astype(np.float32),
          (rng.standard_normal((256, 128)) * 0.1).astype(np.float32)]
  specs = [P("data", None), P("data", None), P(None, "model"), P("model", None)]
  check_partitioned(tm.mlp_train_step, args, specs, MESH, tol=1e-4)
  _, low = _lowered(tm.mlp_train_step, args, specs)
  emitted = low.report.emitted_ops()
  assert len(emitted) >= 2
  keys = _launched_by_every_device(low)
  assert len(keys) == len({ordering.instance_key_of(low.graph_def, n) for n in low.graph_def.node
                           if n.op in vocabulary.TF_COLLECTIVE_OPS})


def test_transformer_train_step_launches_its_collectives_in_one_order():
  cfg = tm.Config(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=4)
  fn, args, specs = tm.megatron_train_args(cfg)
  f, low = _lowered(fn, args, specs)
  keys = _launched_by_every_device(low)
  assert len(keys) >= 8
  want = tf.nest.flatten(tf.function(fn)(*[tf.constant(a) for a in args]))
  for got, ref in zip(tf.nest.flatten(f(*args)), want):
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("processes", [2, 4])
def test_collectives_in_two_levels_across_processes_launch_in_one_order(processes):
  """Planned for several processes, the transformer step's collectives in two levels (within each process, across
  them) are chained in one sequence, and every member of each of their groups computes the same group key."""
  cfg = tm.Config(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=4)
  fn, args, specs = tm.megatron_train_args(cfg)
  f = gs.function(fn, mesh=MESH, in_shardings=tuple(specs), exchange="collectives")
  low = f.lower(*[tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in args], processes=processes)
  levels = {op.level for op in low.report.emitted_ops()}
  assert levels == ({None, "within", "across"} if processes == 4 else {None})   # model: 2 members in 2 processes
  keys = _launched_by_every_device(low)
  assert len(keys) == len(low.report.emitted_ops())


def test_collectives_inside_a_loop_are_ordered_within_and_across_iterations(rng):
  args = [rng.standard_normal((8, 16)).astype(np.float32), (rng.standard_normal((16, 16)) * 0.3).astype(np.float32),
          rng.standard_normal((8, 16)).astype(np.float32)]
  specs = [P(), P("model", None), P("data", None)]
  _, low = _lowered(_loop, args, specs, out=(P(), P()))
  keys = _launched_by_every_device(low)
  bodies = [f for f in low.graph_def.library.function
            if any(n.op in vocabulary.TF_COLLECTIVE_OPS for n in f.node_def)]
  assert bodies, "the loop's all-reduces are in its body"
  for body in bodies:   # the body's results wait for its last collective: the next iteration starts after it
    ret_nodes = {r.split(":")[0] for r in body.ret.values()}
    assert all(n.op == "Identity" and any(i.startswith("^") for i in n.input)
               for n in body.node_def if n.name in ret_nodes), body.signature.name
  assert len(keys) >= 2
  check_partitioned(_loop, args, specs, MESH, out=(P(), P()), tol=1e-5)
  f, _ = _lowered(_loop, args, specs, out=(P(), P()))
  want = tf.function(_loop)(*[tf.constant(a) for a in args])
  for got, ref in zip(f(*args), want):
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5)


def _many(*xs):
  """Per argument, sums over `data`, over `model` and over both: three all-reduces each, independent of each other."""
  out = []
  for x in xs:
    out += [gs.shard(tf.reduce_sum(x, 0), P()), gs.shard(tf.reduce_sum(x, 1), P()), gs.shard(tf.reduce_sum(x), P())]
  return out


def test_independent_collectives_are_chained_in_the_order_they_were_emitted(rng):
  xs = [(rng.standard_normal((4, 8)) * 10).astype(d) for d in (np.float32, np.int32)]
  specs = [P("data", "model")] * 2
  _, low = _lowered(_many, xs, specs)
  emitted = low.report.emitted_ops()
  keys = _launched_by_every_device(low)
  assert len(keys) == len(emitted) >= 6 and keys == sorted(keys), (keys, emitted)
  # unchained (the in-process graph's per-device program; the pass leaves it alone): nothing orders them
  auto = gs.function(_many, mesh=MESH, in_shardings=tuple(specs), exchange="auto").lower(
      *[tf.TensorSpec(x.shape, x.dtype) for x in xs])
  if auto.program.in_process is not None:
    with pytest.raises(PartitionError, match="not ordered"):
      ordering.sequence(auto.graph_def)
  check_partitioned(_many, xs, specs, MESH)


STRESS = textwrap.dedent("""
    import sys, time
    import numpy as np
    import tensorflow as tf
    import tf_gspmd as gs
    from tf_gspmd import P
    from tf_gspmd.rewriter.collectives import ordering
    gs.split_cpu_devices(8)
    mesh = gs.Mesh((2, 4), ("data", "model"))
    DTYPES = (np.float32, np.float64, np.int32, np.int64)

    def many(*xs):   # per dtype: sums over data, over model and over both: independent all-reduces
      out = []
      for x in xs:
        out += [gs.shard(tf.reduce_sum(x, 0), P()), gs.shard(tf.reduce_sum(x, 1), P()),
                gs.shard(tf.reduce_sum(x), P())]
      return out

    rng = np.random.default_rng(0)
    xs = [(rng.standard_normal((4, 8)) * 10).astype(d) for d in DTYPES]
    f = gs.function(many, mesh=mesh, in_shardings=P("data", "model"), exchange="collectives", collective_timeout=60.0)
    low = f.lower(*[tf.TensorSpec(x.shape, x.dtype) for x in xs])
    ops = len(low.report.emitted_ops())
    assert ops >= 8, low.report
    assert len(ordering.sequence(low.graph_def)) == ops
    want = [r.numpy() for r in tf.function(many)(*[tf.constant(x) for x in xs])]
    placed = [gs.function(lambda x: x, mesh=mesh, in_shardings=P("data", "model"), out_shardings=P("data", "model"),
                          exchange="collectives")(x) for x in xs]
    start = time.perf_counter()
    for k in range(200):
      got = f(*placed)
      if k % 50 == 0 or k == 199:
        for g, w in zip(got, want):
          np.testing.assert_allclose(g.numpy(), w, rtol=1e-6)
      else:
        got[-1].numpy()
    print(f"OK {ops} collectives, 200 runs in {time.perf_counter() - start:.1f} s")
""")


def test_two_hundred_runs_of_many_independent_collectives_do_not_hang():
  env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  done = subprocess.run([sys.executable, "-c", STRESS], capture_output=True, text=True, timeout=600, env=env,
                        check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert re.search(r"OK (\d+) collectives, 200 runs", done.stdout), done.stdout
  assert int(re.search(r"OK (\d+) collectives", done.stdout).group(1)) >= 8
