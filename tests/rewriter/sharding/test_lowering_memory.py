"""Lowering from shapes only: no pass materialises a value of an argument's size, nor leaves one as a constant.

Grappler is shown no argument sizes and no constant it would compute at more than `grappler_view.LIMIT_BYTES`
(rewriter/graph/grappler_view.py): generators of argument-sized shapes (zeros_like, ones_like, fill, broadcast_to,
zeros, tile, stateless random) stay ops, in the global graph and in the per-device program, in the main graph
and in loop bodies. The 16 GiB case runs in a subprocess whose address space is capped below the argument's
size, so a pass that materialises it fails there, cleanly, instead of exhausting the machine.
"""

import json
import os
import resource
import subprocess
import sys
import textwrap

import numpy as np
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.rewriter.graph import grappler_view

MESH = gs.Mesh((2, 4), ("data", "model"))
PLAN_MESH = gs.Mesh((32, 64), ("data", "model"))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _generators(w):
  """Argument-sized values made from constants only, combined with each other and with the argument."""
  shape = tf.shape(w)
  made = (tf.zeros_like(w) + tf.ones_like(w) * tf.fill(shape, 3.0) * tf.broadcast_to(tf.constant(2.0), shape) +
          tf.zeros(w.shape) + tf.random.stateless_uniform(w.shape, seed=[1, 2]))
  tiled = tf.tile(tf.ones([1, w.shape[1]]), [w.shape[0], 1])

  def body(i, acc):
    return i + 1, acc + tf.zeros_like(acc) + tf.fill(tf.shape(acc), 0.5) * 2.0

  _, looped = tf.while_loop(lambda i, _: i < 2, body, (0, w))
  return w * 2.0 + made + tiled + looped


def _largest_constant(graph_def):
  """(bytes, name) of the largest Const of `graph_def`, its function bodies included, by its shape and dtype (a
  splat constant counts at the size it takes once materialised)."""
  nodes = list(graph_def.node) + [nd for f in graph_def.library.function for nd in f.node_def]
  best = (0, None)
  for nd in nodes:
    if nd.op == "Const":
      t = nd.attr["value"].tensor
      n = int(np.prod([d.size for d in t.tensor_shape.dim])) * tf.as_dtype(t.dtype).size
      best = max(best, (n, nd.name))
  return best


def test_generators_stay_ops_in_the_global_graph_and_the_device_program():
  w = tf.TensorSpec([1024, 2048])   # 8 MiB: above the limit, small enough to be safe if it were materialised
  for mesh in (MESH, PLAN_MESH):
    low = gs.function(_generators, mesh=mesh, in_shardings=P("data", "model")).lower(w)
    assert _largest_constant(low.global_graph_def)[0] <= grappler_view.LIMIT_BYTES
    assert _largest_constant(low.graph_def)[0] <= grappler_view.LIMIT_BYTES
    ops = {nd.op for nd in low.global_graph_def.node}
    assert {"Fill", "BroadcastTo", "Tile"} <= ops, ops
    assert "PlaceholderWithDefault" not in ops   # what Grappler was shown is undone on its result
    (placeholder,) = [nd for nd in low.global_graph_def.node if nd.op == "Placeholder" and nd.name == "w"]
    assert [d.size for d in placeholder.attr["shape"].shape.dim] == [1024, 2048]


def test_generators_give_the_same_values():
  fn = gs.function(_generators, mesh=MESH, in_shardings=P("data", "model"))
  w = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)   # 2 MiB: generators stay ops
  np.testing.assert_allclose(np.asarray(fn(tf.constant(w))), tf.function(_generators)(tf.constant(w)).numpy(),
                             rtol=1e-5, atol=1e-5)


def test_values_up_to_the_limit_still_fold():
  def f(w):
    return w + tf.zeros_like(w) * tf.ones_like(w) + tf.reshape(tf.fill([tf.shape(w)[0] * 2, 8], 1.0), w.shape)

  low = gs.function(f, mesh=MESH, in_shardings=P("data", None)).lower(tf.TensorSpec([64, 16]))
  assert not {"Fill", "ZerosLike", "OnesLike", "PlaceholderWithDefault"} & {nd.op for nd in low.global_graph_def.node}


CHILD = textwrap.dedent(r"""
    import json, resource, sys
    import numpy as np
    import tensorflow as tf
    import tf_gspmd as gs
    from tf_gspmd import P
    gs.split_cpu_devices(8)
    sys.path.insert(0, sys.argv[1])
    from test_lowering_memory import _generators, _largest_constant

    def adam(w, m, v):
      g = 2.0 * w
      m = 0.9 * m + 0.1 * g
      v = 0.999 * v + 0.001 * g * g
      return w - 1e-3 * m / (tf.sqrt(v) + 1e-8), m, v

    w = tf.TensorSpec([65536, 65536])   # 16 GiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    largest = 0
    for shape in ((2, 4), (32, 64)):
      mesh = gs.Mesh(shape, ("data", "model"))
      for fn, n in ((lambda w: w * 2.0, 1), (adam, 3), (_generators, 1)):
        low = gs.function(fn, mesh=mesh, in_shardings=(P("data", "model"),) * n).lower(*[w] * n)
        largest = max(largest, _largest_constant(low.global_graph_def)[0], _largest_constant(low.graph_def)[0])
        if low.program.in_process is not None:
          largest = max(largest, _largest_constant(low.program.in_process.graph_def)[0])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"largest": largest, "growth": peak - before}))
""")


def test_16_gib_arguments_lower_in_a_capped_address_space():
  cap = 10 << 30   # below the 16 GiB argument: materialising it (or a value of its size) fails in the child

  def limit():
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

  out = subprocess.run([sys.executable, "-c", CHILD, os.path.dirname(os.path.abspath(__file__))], cwd=ROOT,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True, text=True,
                       preexec_fn=limit, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["largest"] <= grappler_view.LIMIT_BYTES
  assert result["growth"] < 1 << 30, result
