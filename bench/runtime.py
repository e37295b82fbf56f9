"""Step time on 8 logical CPUs: unpartitioned vs. tf_gspmd vs. TF DTensor, same program, same layouts.

Two training steps: workload 2 of the reference set (mlp_train_step on mesh (2,4), Megatron MLP) and a 12-layer
decoder-only transformer with Adam (examples/transformer_model.py, Megatron layout on (2,4)). Each is run

  * unpartitioned: one tf.function on one device;
  * tf_gspmd: the partitioned program on the 8 devices (arguments already laid out, results kept sharded), the
    devices' programs run as one in-process graph (exchange="auto"; a further table compares TF's collectives);
  * DTensor: `tf.experimental.dtensor` with the same layouts on the same 8 devices;

with XLA off and on (tf_gspmd on CPU: XLA-compiled segments between collectives; DTensor: jit_compile=True where
it compiles). Times are medians of --steps calls after warm-up, all measured in one run, the configurations of a
program taking turns in rounds of a few calls each (so load on the machine falls on all alike); ratios are to the
unpartitioned program with the same XLA setting. Every partitioned result is checked against the unpartitioned one. A second
table counts the ops of the unpartitioned and the per-device program and the collectives of one step. With
--profile, a third splits the time the devices' ops ran (from the profiler trace) into collectives (in the
in-process graph: the ops that replace them), the copies that combined collectives make (concatenating and
splitting their members) and the rest (compute).

  python bench/runtime.py [--steps=10] [--layers=12] [--only=mlp_train_step] [--xla=off|on|both]
                          [--profile=/tmp/prof] [--collective_timeout=1800]
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from timing import interleaved  # noqa: E402  pylint: disable=g-import-not-at-top

flags.DEFINE_integer("steps", 10, "Timed calls per configuration (after two warm-up calls).")
flags.DEFINE_integer("layers", 12, "Transformer layers.")
flags.DEFINE_list("only", [], "Run only these programs (mlp_train_step, transformer_train_step).")
flags.DEFINE_enum("xla", "both", ["off", "on", "both"], "Which XLA settings to run (the XLA-on configurations "
                  "compile for minutes; TF's collectives run with XLA off).")
flags.DEFINE_float("collective_timeout", 1800.0, "gs.function's collective_timeout: the first XLA-on call compiles the "
                   "segments inside the call (the 12-layer transformer's took 398 s on 2 busy cores, past the 300 s "
                   "default).")
flags.DEFINE_string("profile", "", "Directory for TensorFlow profiler traces of 3 tf_gspmd steps per program and "
                    "XLA setting (<dir>/<program>_xla_<on|off>; TensorBoard's Profile tab); empty: none.")
FLAGS = flags.FLAGS


def programs():
  """(name, step fn, [numpy args], [P spec per arg])."""
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)

  def normal(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)

  yield ("mlp_train_step", tm.mlp_train_step,
         [normal(64, 1024), normal(64, 1024), normal(1024, 4096, scale=0.03), normal(4096, 1024, scale=0.03)],
         [P("data", None), P("data", None), P(None, "model"), P("model", None)])
  cfg = tm.Config(layers=FLAGS.layers)
  yield (f"transformer_train_step ({cfg.layers} layers, Adam)", *tm.megatron_train_args(cfg))


def _check(got, want, what):
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-4, err_msg=what)


def main(_):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  from tensorflow.experimental import dtensor  # pylint: disable=g-import-not-at-top
  gs.split_cpu_devices(8)
  mesh = gs.Mesh((2, 4), ("data", "model"))
  dmesh = dtensor.create_mesh([("data", 2), ("model", 4)], device_type="CPU")
  dtensor.copy_to_mesh(tf.zeros([]), dtensor.Layout.replicated(dmesh, rank=0))   # DTensor's device first
  rows = []
  for name, fn, args, specs in programs():
    if FLAGS.only and not any(name.startswith(o) for o in FLAGS.only):
      continue
    consts = [tf.constant(a) for a in args]
    want = [np.asarray(t) for t in tf.nest.flatten(tf.function(fn)(*consts))]
    times, calls = {}, {}   # calls: what is timed, round-robin once everything is built (see _interleaved)
    for jit in _jits():
      with tf.device("/device:CPU:0"):
        single = tf.function(fn, jit_compile=jit)

      def unpartitioned(single=single):
        with tf.device("/device:CPU:0"):
          tf.nest.flatten(single(*consts))[-1].numpy()

      calls[("unpartitioned", jit)] = unpartitioned
      f, placed, first = _first_call(tf, gs, fn, mesh, args, specs, jit, want, name)
      if jit:   # the same program on a one-device mesh: one segment, compiled once
        one = gs.Mesh((1,) * len(mesh.shape), mesh.axis_names)
        times["first call"] = (_first_call(tf, gs, fn, one, args, specs, jit, want, name)[2], first)
      calls[("tf_gspmd", jit)] = lambda f=f, placed=placed: tf.nest.flatten(f(*placed))[-1].numpy()
      if FLAGS.profile:
        trace = os.path.join(FLAGS.profile, f"{name}_xla_{'on' if jit else 'off'}")
        tf.profiler.experimental.start(trace)
        for _ in range(3):
          tf.nest.flatten(f(*placed))[-1].numpy()
        tf.profiler.experimental.stop()
        exchange = set(f.lower(*placed).program.report.emitted())
        times[("split", jit)] = _time_split(trace, 3, mesh.size, exchange)
      calls[("DTensor", jit)] = _dtensor_call(tf, dtensor, dmesh, fn, args, specs, jit, want, name)
      if not jit:   # the same program with TF's collective ops between the devices (exchange="collectives")
        fc, placed_c, _ = _first_call(tf, gs, fn, mesh, args, specs, jit, want, name, exchange="collectives")
        calls["collectives"] = lambda: tf.nest.flatten(fc(*placed_c))[-1].numpy()
        low = f.lower(*placed)   # the lowerings the calls run (cached)
        times["ops"] = (_op_count(single.get_concrete_function(*consts).graph.as_graph_def()),
                        _op_count(fc.lower(*placed_c).graph_def), low.report,
                        _op_count(low.program.in_process.graph_def) if low.program.in_process else None)
    times.update(interleaved(calls, FLAGS.steps))
    rows.append((name, times))
  base = f"unpartitioned, XLA {'on' if FLAGS.xla == 'on' else 'off'}"
  head = ("program", "XLA", "unpartitioned ms", "tf_gspmd ms", "DTensor ms", "tf_gspmd / unpart.", "DTensor / unpart.",
          "tf_gspmd / DTensor")
  table = []
  for name, times in rows:
    for jit in _jits():
      u, g, d = times[("unpartitioned", jit)], times[("tf_gspmd", jit)], times[("DTensor", jit)]
      table.append((name, "on" if jit else "off", f"{u * 1e3:.1f}", f"{g * 1e3:.1f}",
                    f"{d * 1e3:.1f}" if d else "fails", f"{g / u:.2f}", f"{d / u:.2f}" if d else "-",
                    f"{g / d:.2f}" if d else "-"))
  print(f"median step time over {FLAGS.steps} calls, 8 logical CPU devices on {os.cpu_count()} cores ({base} is "
        "the single-device reference)")
  _print_table(head, table)
  if False in _jits():
    print()
    print("ops (graph nodes, function bodies included) of the unpartitioned program, of the per-device program "
          "each device runs through TF's collectives (after the optimize and fuse passes) and of the in-process "
          "graph of all 8 devices (what they compute alike written once), and the collectives one step runs (XLA off)")
    head = ("program", "unpartitioned ops", "per-device ops", "in-process graph ops", "logical collectives",
            "collective ops emitted", "bytes sent / device")
    table = []
    for name, times in rows:
      whole, local, report, together = times["ops"]
      logical = ", ".join(f"{n} {k}" for k, n in sorted(report.counts().items()))
      table.append((name, str(whole), str(local), str(together or "-"), logical or "none",
                    str(len(report.emitted_ops())), f"{report.bytes_per_device():,}"))
    _print_table(head, table)
    print()
    print("XLA off: the devices' programs as one in-process graph (exchange=\"auto\", the rows above) vs each "
          "device's program on its own thread joined by TF's collective ops (exchange=\"collectives\"), and both "
          "against DTensor")
    head = ("program", "in-process ms", "TF collectives ms", "DTensor ms", "in-process / collectives",
            "in-process / DTensor", "TF collectives / DTensor")
    table = []
    for name, times in rows:
      g, c, d = times[("tf_gspmd", False)], times["collectives"], times[("DTensor", False)]
      table.append((name, f"{g * 1e3:.1f}", f"{c * 1e3:.1f}", f"{d * 1e3:.1f}" if d else "fails", f"{g / c:.2f}",
                    f"{g / d:.2f}" if d else "-", f"{c / d:.2f}" if d else "-"))
    _print_table(head, table)
  if True in _jits():
    print()
    print("first call with XLA on (after lowering): the program instantiated (in-process: one graph for all "
          "devices, each XLA segment compiled once, on the first device) plus one step; on a one-device mesh the "
          "program is one segment")
    head = ("program", "lowering 1 device s", "first call 1 device s", "lowering 8 devices s",
            "first call 8 devices s", "first call 8 / 1")
    table = []
    for name, times in rows:
      (l1, c1), (l8, c8) = times["first call"]
      table.append((name, f"{l1:.1f}", f"{c1:.1f}", f"{l8:.1f}", f"{c8:.1f}", f"{c8 / c1:.2f}"))
    _print_table(head, table)
  if FLAGS.profile:
    print()
    print("where a device's step time goes (profiler trace of 3 steps: ms per device per step the per-device "
          "program's ops ran; on 2 cores 8 devices share the CPU, so these add up to more than the wall time)")
    head = ("program", "XLA", "collectives ms", "combine copies ms", "compute ms", "collectives share")
    table = []
    for name, times in rows:
      for jit in _jits():
        t = times[("split", jit)]
        total = sum(t.values()) or 1.0
        table.append((name, "on" if jit else "off", f"{t['collectives']:.1f}", f"{t['combine copies']:.1f}",
                      f"{t['compute']:.1f}", f"{t['collectives'] / total:.0%}"))
    _print_table(head, table)


def _jits():
  """The XLA settings to run (--xla): False for off, True for on."""
  return {"off": (False,), "on": (True,), "both": (False, True)}[FLAGS.xla]


def _print_table(head, table):
  widths = [max(len(x) for x in col) for col in zip(head, *table)]
  for row in [head] + table:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def _first_call(tf, gs, fn, mesh, args, specs, jit, want, name, exchange="auto"):
  """(gs.function of `fn` on `mesh`, its placed arguments, (seconds to lower it, seconds of its first call:
  instantiating the per-device program on every device, XLA compiling its segments, one step)); the result is
  checked against the unpartitioned one."""
  f = gs.function(fn, mesh=mesh, in_shardings=tuple(specs), jit_compile=jit, collective_timeout=FLAGS.collective_timeout,
                  exchange=exchange)
  placed = [gs.function(lambda a: a, mesh=mesh, in_shardings=s, out_shardings=s)(a) for a, s in zip(args, specs)]
  start = time.perf_counter()
  f.lower(*placed)   # the lowering the call below runs (the arguments arrive in their layouts)
  lowered = time.perf_counter() - start
  start = time.perf_counter()
  _check([t.numpy() for t in tf.nest.flatten(f(*placed))], want, f"tf_gspmd {name} jit={jit} on {mesh}")
  return f, placed, (lowered, time.perf_counter() - start)


def _time_split(directory, calls, devices, exchange):
  """{"collectives", "combine copies", "compute"}: ms per device per step the ops of the traces under `directory`
  ran (the per-device program's ops are traced as "<name>:<op type>", XLA-compiled segments as their executable's
  run, counted as compute). `exchange`: the per-device program's collective op names; in the in-process graph
  (nodes "d<p>/<name>") the ops that replace them (a sum, a concat, a split; named after the collective) count as
  collectives."""
  import glob  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top
  from tf_gspmd.rewriter.collectives.vocabulary import TF_COLLECTIVE_OPS  # pylint: disable=g-import-not-at-top
  split = {"collectives": 0.0, "combine copies": 0.0, "compute": 0.0}
  for path in glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True):
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
      space.ParseFromString(f.read())
    for plane in space.planes:
      names = {k: m.name for k, m in plane.event_metadata.items()}
      for line in plane.lines:
        for e in line.events:
          name = names.get(e.metadata_id, "")
          if name.endswith("Executable::ExecuteAsyncOnStream"):   # an XLA-compiled segment runs
            split["compute"] += e.duration_ps / 1e9
            continue
          if not name.startswith("program/") or ":" not in name:
            continue
          node, op = name.rsplit(":", 1)
          base = re.sub(r"^program/(d\d+/)?", "", node)   # (ops a collective became are it or named under it)
          exchanged = base in exchange or base.rsplit("/", 1)[0] in exchange
          kind = ("collectives" if op in TF_COLLECTIVE_OPS or exchanged else
                  "combine copies" if "combined_" in node and op in ("ConcatV2", "SplitV", "Split") else "compute")
          split[kind] += e.duration_ps / 1e9
  return {k: v / (calls * devices) for k, v in split.items()}


def _op_count(graph_def):
  return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def _dtensor_call(tf, dtensor, dmesh, fn, args, specs, jit, want, name):
  """One DTensor step with the same layouts (its result checked), as a call to time; None when DTensor cannot run
  the program."""
  def layout(spec, rank):
    dims = list(spec) + [None] * (rank - len(spec))
    return dtensor.Layout([d if d else dtensor.UNSHARDED for d in dims], dmesh)

  placed = []
  for a, s in zip(args, specs):
    t = tf.constant(a)
    placed.append(dtensor.relayout(dtensor.copy_to_mesh(t, layout((), t.shape.rank)), layout(tuple(s), t.shape.rank)))
  f = tf.function(fn, jit_compile=jit)
  try:
    out = tf.nest.flatten(f(*placed))
    got = [_dtensor_global(tf, dtensor, t) for t in out]
  except (tf.errors.OpError, ValueError, TypeError) as e:
    print(f"DTensor cannot run {name} with jit_compile={jit}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return None
  _check(got, want, f"DTensor {name} jit={jit}")
  return lambda: tf.nest.flatten(f(*placed))[-1].numpy()


def _dtensor_global(tf, dtensor, t):
  layout = dtensor.fetch_layout(t)
  replicated = dtensor.Layout.replicated(layout.mesh, rank=t.shape.rank)
  return dtensor.unpack(dtensor.relayout(t, replicated))[0].numpy()


if __name__ == "__main__":
  app.run(main)
