"""Test session set-up: 8 logical CPU devices before TensorFlow initialises, and shared helpers."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import tf_gspmd as gs  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cluster_programs"))
import with_collectives  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

NUM_DEVICES = 8


gs.split_cpu_devices(NUM_DEVICES)


def pytest_addoption(parser):
  parser.addoption("--exchange", default="auto", choices=("auto", "collectives"),
                   help="collectives: every gs.function left at exchange='auto' (here and in the processes a test "
                        "launches) exchanges data through TF's collective ops on every device (the path GPUs take), "
                        "not one graph per process")


def pytest_configure(config):
  if config.getoption("--exchange") == "collectives":
    with_collectives.force_collectives(gs)


@pytest.fixture
def exchange(request):
  """The exchange the session runs gs.functions with ("auto" or "collectives", the --exchange option)."""
  return request.config.getoption("--exchange")


@pytest.fixture
def rng():
  return np.random.default_rng(0)


def assert_close(actual, expected, rtol=1e-5, atol=1e-5):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


def ir_of(fn, *shapes):
  """The IR graph of `fn` traced for float32 arguments of `shapes` (no partitioning, no devices)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_gspmd.rewriter.graph.graph_ir import Graph  # pylint: disable=g-import-not-at-top
  from tf_gspmd.rewriter.graph.graph_view import ref, split_ref  # pylint: disable=g-import-not-at-top
  cf = tf.function(fn).get_concrete_function(*[tf.TensorSpec(s) for s in shapes])
  return Graph(cf.graph.as_graph_def(), [t.op.name for t in cf.inputs],
               [ref(*split_ref(t.name)) for t in cf.outputs])


def first_node(ir, op_type):
  return next(n for n in ir.nodes if n.op == op_type)


def check_partitioned(fn, args, specs, mesh, out=None, tol=1e-5):
  """`fn` run partitioned on `mesh` (numpy `args` laid out as `specs`) agrees with `fn` unpartitioned.

  Returns the partitioned function's lowering for the same argument shapes (to inspect its report).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  f = gs.function(fn, mesh=mesh, in_shardings=specs, out_shardings=out)
  got = f(*args)
  want = fn(*[tf.constant(a) for a in args])
  for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
    assert_close(g.numpy(), w.numpy(), rtol=tol, atol=tol)
  return f.lower(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])


COLLECTIVE_GROUP_SIZE_INPUT = {"CollectiveBcastRecvV2": 0}   # others take (input, group_size, ...)


def _program_graphs(low):
  """(tf.Graph, its partition-id tensor) of the per-device program's graph, then of each function of its library
  that holds a collective (a loop's body or condition, a branch): parameters shaped as the While that runs it
  says, the partition id its last parameter."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_gspmd._platform import compat as _compat  # pylint: disable=g-import-not-at-top
  from tf_gspmd.rewriter.collectives.vocabulary import TF_COLLECTIVE_OPS  # pylint: disable=g-import-not-at-top
  gd = low.graph_def
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(gd, name="")
  yield graph, graph.get_tensor_by_name(low.program.partition_id + ":0")
  shapes = {}
  for nd in list(gd.node) + [nd for f in gd.library.function for nd in f.node_def]:
    if nd.op in ("While", "StatelessWhile"):
      for part in ("body", "cond"):
        shapes[nd.attr[part].func.name] = [tf.TensorShape(s) for s in nd.attr["output_shapes"].list.shape]
  for fdef in gd.library.function:
    if not any(nd.op in TF_COLLECTIVE_OPS for nd in fdef.node_def):
      continue
    graph = tf.Graph()
    with graph.as_default():
      tf.graph_util.import_graph_def(tf.compat.v1.GraphDef(library=gd.library), name="")
      body, _ = _compat.function_def_to_graph_def(fdef, shapes.get(fdef.signature.name))
      body.ClearField("library")
      tf.graph_util.import_graph_def(body, name="")
    yield graph, graph.get_tensor_by_name(fdef.signature.input_arg[-1].name + ":0")


def random_ops_made_whole(low):
  """(the element counts of the random values the plan of `low` splits, those of them some per-device random
  kernel generates whole): a random value drawn at its global size on every device and then sliced.

  The per-device kernels are those of the program's graph and of its functions; a kernel inside a loop body reads
  its shape from the loop, so the shape constants the program passes its loops count for those."""
  import math  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_gspmd.ops import registry  # pylint: disable=g-import-not-at-top
  from tf_gspmd.ops.random import StatelessRandom  # pylint: disable=g-import-not-at-top
  kinds = {t for t in registry.registered_ops() if isinstance(registry.lookup(t), StatelessRandom)}
  program = low.program
  split = [math.prod(n.outputs[0].shape) for n in program.ir.nodes
           if n.op in kinds and not program.shardings[n.ref(0)].is_replicated]
  gd = low.graph_def
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(gd, name="")
  local = [op.outputs[0].shape.num_elements() for op in graph.get_operations() if op.type in kinds]
  if any(n.op in kinds for f in gd.library.function for n in f.node_def):
    local += loop_sizes(gd)
  return split, sorted(set(split) & {c for c in local if c is not None})


def loop_sizes(graph_def):
  """The one-element int shape constants a per-device program passes its loops (what a random kernel inside a
  loop body is asked for: it reads its shape from the loop's inputs)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  nodes = {n.name: n for n in graph_def.node}
  sizes = []
  for loop in (n for n in graph_def.node if n.op in ("While", "StatelessWhile")):
    for x in loop.input:
      src = nodes.get(x.split(":")[0].lstrip("^"))
      if src is not None and src.op == "Const" and src.attr["dtype"].type in (tf.int32.as_datatype_enum,
                                                                             tf.int64.as_datatype_enum):
        value = tf.make_ndarray(src.attr["value"].tensor)
        if value.ndim == 1 and value.size == 1:
          sizes.append(int(value[0]))
  return sizes


def sent_by_program(low):
  """What the per-device program `low.graph_def` sends, read from its collective nodes alone (those of its graph
  and of its functions, each once: one iteration of every loop).

  Returns [(node, (op type, dtype, per-device shape it carries, bytes each device sends through it))]. A node's
  bytes come from its input's shape and dtype (an all-gather: times its group size, the report's convention); a
  receive sends nothing. Values the program computes from the partition id (group sizes; the size of a send
  whose shape differs by device, which is a Slice of its data) are evaluated for every partition id. Inside a
  function, where a tensor's shape is not static (one read from a TensorList, whose element shape the
  function's graph does not carry), shape and bytes are None.
  """
  n = low.program.mesh.size
  nodes = []
  for k, (graph, pid) in enumerate(_program_graphs(low)):
    _sent_by_graph(graph, pid, n, nodes, main=k == 0)
  return nodes


def _sent_by_graph(graph, pid, n, nodes, main):
  """Appends to `nodes` the collective nodes of `graph` (see sent_by_program; `main`: the program's graph)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_gspmd.rewriter.collectives.vocabulary import TF_COLLECTIVE_OPS  # pylint: disable=g-import-not-at-top
  with tf.compat.v1.Session(graph=graph) as sess:
    per_device = lambda t: [sess.run(t, {pid: p}) for p in range(n)]  # noqa: E731
    for op in graph.get_operations():
      if op.type not in TF_COLLECTIVE_OPS:
        continue
      if op.type == "CollectiveBcastRecvV2":
        nodes.append((op.name, (op.type, op.get_attr("T").name, None, (0,) * n)))
        continue
      sizes = per_device(op.inputs[COLLECTIVE_GROUP_SIZE_INPUT.get(op.type, 1)])
      x = op.inputs[0]
      if x.shape.is_fully_defined():
        shapes = [x.shape.as_list()] * n
      elif not main and x.op.type != "Slice":
        nodes.append((op.name, (op.type, x.dtype.name, None, None)))
        continue
      else:
        assert x.op.type == "Slice", f"{op.name} sends a tensor of per-device shape that is not a Slice"
        shapes = [list(s) for s in per_device(x.op.inputs[2])]
      if op.type == "CollectiveGatherV2":
        shapes = [[s[0] * int(g)] + s[1:] for s, g in zip(shapes, sizes)]
      sent = tuple(int(np.prod(s)) * x.dtype.size if g > 1 else 0 for s, g in zip(shapes, sizes))
      nodes.append((op.name, (op.type, x.dtype.name, tuple(max(shapes, key=np.prod)), sent)))


def assert_report_counts_program(low):
  """The report's emitted ops are the program's collective nodes (its graph's and its functions'), with their
  dtypes, shapes and bytes; its bytes with every loop once are what those nodes send, and without loops its
  bytes per step too."""
  nodes = sent_by_program(low)
  emitted = low.report.emitted_ops()
  assert sorted(op.name for op in emitted) == sorted(name for name, _ in nodes), (
      f"report: {sorted(op.name for op in emitted)}; program: {sorted(name for name, _ in nodes)}")
  ops = {op.name: op for op in emitted}
  totals = np.zeros(low.program.mesh.size, np.int64)
  for name, (op_type, dtype, shape, sent) in nodes:
    e = ops[name]
    assert (e.op, e.dtype) == (op_type, dtype), (name, e)
    reported = e.device_bytes or (e.bytes,) * len(totals)
    assert sent is None or tuple(reported) == sent, (name, e, sent)
    assert shape is None or e.shape == shape, (name, e, shape)
    totals += sent if sent is not None else reported
  most = int(totals.max())
  assert low.report.bytes_per_device(per_iteration=True) == most, str(low.report)
  if not any(c.loops for c in low.report.collectives):
    assert low.report.bytes_per_device() == most, str(low.report)


def keras_adam_step(keras, layers):
  """(an Adam step of a Keras MLP of `layers` tanh Dense layers of width 16, the model, the optimizer): the
  optimizer updates captured variables, as `fit` does. Built from seed 0: two calls give equal models."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((16,))] + [keras.layers.Dense(16, activation="tanh") for _ in range(layers)])
  opt = keras.optimizers.Adam(1e-2)
  opt.build(model.trainable_variables)

  def step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x) - y))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss
  return step, model, opt


def sigkill_when(procs, victim, ready, timeout, explain, settle=0.0):
  """Waits until `ready()` while every process of `procs` runs (failing with `explain()` if one exits first or
  `timeout` seconds pass), sleeps `settle` seconds and SIGKILLs `procs[victim]`; returns when it was killed."""
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  deadline = time.time() + timeout
  while not ready():
    assert all(p.poll() is None for p in procs) and time.time() < deadline, explain()
    time.sleep(0.05)
  time.sleep(settle)
  procs[victim].send_signal(signal.SIGKILL)
  return time.time()


def loop_step(x, w):
  """Three iterations of tanh(y @ w) + 1 and their gradient: the forward loop keeps its intermediates in lists."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.GradientTape() as tape:
    tape.watch(w)
    y = tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, tf.tanh(y @ w) + 1.0), (0, x))[1]
    loss = tf.reduce_sum(y)
  return loss, tape.gradient(loss, w)


def pipeline_step(x, w):
  """A gs.pipeline of residual tanh layers (w [stages, layers per stage, d, d]) over 8 microbatches, and the
  gradient of its mean square."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def stage(w, h):   # one stage slot: its residual tanh layers
    for k in range(w.shape[0]):
      h = h + tf.tanh(h @ w[k])
    return h

  with tf.GradientTape() as tape:
    tape.watch(w)
    loss = tf.reduce_mean(gs.pipeline(stage, w, x, microbatches=8) ** 2)
  return loss, tape.gradient(loss, w)


class HostReads:
  """Counts every value tf_gspmd brings from the devices to the host while active: ShardedTensor.numpy (which
  `np.asarray` and `float` go through) and the all-gather to the host, each with the shape it brought."""

  def __init__(self, monkeypatch):
    from tf_gspmd.runtime import parallel, sharded_tensor  # pylint: disable=g-import-not-at-top
    self.shapes = []
    numpy, gather = sharded_tensor.ShardedTensor.numpy, parallel.gather_to_host

    def counted_numpy(x):
      self.shapes.append(tuple(x.shape.as_list()))
      return numpy(x)

    def counted_gather(devices, components):
      self.shapes.append(("gather", len(components)))
      return gather(devices, components)

    monkeypatch.setattr(sharded_tensor.ShardedTensor, "numpy", counted_numpy)
    monkeypatch.setattr(parallel, "gather_to_host", counted_gather)
