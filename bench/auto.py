"""Automatic sharding against the hand plans: bytes per device, memory per device and solve time.

Six programs, each lowered in plan mode (no devices; any mesh size) on meshes (8,), (2,4) and (32,64), once
with its hand plan and once with `in_shardings="auto"` (every argument, data batches included, and every
captured variable chosen by the integer program of rewriter/auto/) under a memory budget equal to the hand
plan's memory per device: its arguments + captured variables (padding included) + the rest of what the plan's
program holds at its peak at its layouts (`rewriter.sharding.auto.plan_memory`, the count the budget constrains);
`--budget=state` gives the arguments + variables only.

  mlp             reference workload 1: gelu(x @ w1) @ w2, x[64,1024], w1[1024,4096], w2[4096,1024]; Megatron
  mlp_train_step  reference workload 2: one SGD step of that MLP (examples/transformer_model.py); Megatron
  attention       reference workload 3: 8-head self-attention, x[8,128,512], four [512,512] weights; Megatron
  transformer     the 12-layer decoder-only transformer + Adam step (examples/transformer_model.py, default
                  Config), parameters and Adam slots as arguments; Megatron (`megatron_train_args`)
  moe             reference workload 4: GShard MoE, 8 groups x 256 tokens, 8 experts [512->1024->512], fixed
                  top-1 dispatch mask; hand plan: experts and groups over the last mesh axis, the two
                  gs.shard annotations of the dispatched and combined tensors (absent for auto)
  unet            the Keras U-Net training step of examples/train_convnet.py (Adam; weights and slots are
                  captured variables, left replicated by the hand plan); hand plan: batch over "data", image
                  rows over "spatial" (its `in_specs`)

Mesh axes: two-axis meshes are ("data", "model") / ("data", "expert") / ("data", "spatial"); on a one-axis
mesh the hand plan uses its model axis only: Megatron over "model", GShard over "expert", rows over
"spatial". Sizes that do not divide a mesh axis are padded (uneven shards) by the hand plan; the auto plan
only considers layouts that divide evenly. Both plans leave the result layouts free (out_shardings=None).

Columns: bytes per device the per-device program's collectives send (low.report.bytes_per_device()), state
(arguments + variables) and live activations per device, the auto plan's predicted bytes, the auto pass's
seconds (the whole auto_shard pass; in brackets building and solving the program) and the program size
(columns x rows). Notes after the table: every row where auto sends more than the hand plan, or where the
measured bytes or state differ from the plan's prediction.

  .venv/bin/python bench/auto.py [--only=mlp,transformer] [--meshes=8,2x4,32x64] [--budget=state] [--verbose]
"""

import math
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402

from programs import attention  # noqa: E402
import train_convnet  # noqa: E402  (defines --image_size, --width, --batch, --seed, --lr of the U-Net)

WORKLOADS = ("mlp", "mlp_train_step", "attention", "transformer", "moe", "unet")
flags.DEFINE_list("only", [], f"Run only these workloads ({', '.join(WORKLOADS)}).")
flags.DEFINE_list("meshes", ["8", "2x4", "32x64"], "Mesh shapes, axis sizes joined by x (one or two axes).")
flags.DEFINE_enum("budget", "memory", ["memory", "state"],
                  "The auto plan's memory_budget: the hand plan's arguments + variables + activations live at the "
                  "peak per device (memory; where the library prices activations, "
                  "rewriter.sharding.auto.plan_memory), or its arguments + variables only (state).")
flags.DEFINE_bool("verbose", False, "Print each auto plan's choices (str(low.auto_plan)).")
FLAGS = flags.FLAGS


def _spec(shape, dtype="float32"):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.TensorSpec(shape, tf.as_dtype(dtype))


def workloads():
  """name -> (model-axis name, build(mesh, hand) -> (fn, [TensorSpec], in_shardings))."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top

  def data(mesh):
    return "data" if "data" in mesh.axis_names else None

  def respec(spec, mesh):   # the hand spec with the axes this mesh lacks dropped
    def keep(d):
      return d if d is None or all(a in mesh.axis_names for a in ((d,) if isinstance(d, str) else d)) else None
    return P(*[keep(d) for d in spec])

  def mlp(x, w1, w2):
    return tf.nn.gelu(x @ w1) @ w2

  def build_mlp(mesh, hand):
    specs = [_spec((64, 1024)), _spec((1024, 4096)), _spec((4096, 1024))]
    return mlp, specs, (P(data(mesh), None), P(None, "model"), P("model", None)) if hand else "auto"

  def build_mlp_train(mesh, hand):
    specs = [_spec((64, 1024)), _spec((64, 1024)), _spec((1024, 4096)), _spec((4096, 1024))]
    ins = (P(data(mesh), None), P(data(mesh), None), P(None, "model"), P("model", None))
    return tm.mlp_train_step, specs, ins if hand else "auto"

  def build_attention(mesh, hand):
    specs = [_spec((8, 128, 512))] + [_spec((512, 512)) for _ in range(4)]
    ins = (P(data(mesh), None, None), P(None, "model"), P(None, "model"), P(None, "model"), P("model", None))
    return attention, specs, ins if hand else "auto"

  transformer = {}

  def build_transformer(mesh, hand):
    if not transformer:
      transformer["args"] = tm.megatron_train_args(tm.Config())
    fn, args, megatron = transformer["args"]
    specs = [_spec(np.shape(a), np.asarray(a).dtype) for a in args]
    return fn, specs, tuple(respec(s, mesh) for s in megatron) if hand else "auto"

  def build_moe(mesh, hand):
    ax = mesh.axis_names[-1]

    def annotate(t, spec):
      return gs.shard(t, spec) if hand else t

    def moe(x, mask, w1, w2):
      xg = tf.reshape(x, [8, 256, 512])
      disp = annotate(tf.einsum("gsm,gsec->egcm", xg, mask), P(ax, None, None, None))
      h = tf.nn.relu(tf.einsum("egcm,emh->egch", disp, w1))
      y = annotate(tf.einsum("egch,ehm->egcm", h, w2), P(None, ax, None, None))
      return tf.reshape(tf.einsum("egcm,gsec->gsm", y, mask), [2048, 512])

    specs = [_spec((2048, 512)), _spec((8, 256, 8, 256)), _spec((8, 512, 1024)), _spec((8, 1024, 512))]
    ins = (P(ax, None), P(ax, None, None, None), P(ax, None, None), P(ax, None, None))
    return moe, specs, ins if hand else "auto"

  def build_unet(mesh, hand):
    task = train_convnet.task()
    model = task.build(mesh, plan_only=True)   # a fresh Keras model and Adam: captured tf.Variables
    size, batch = FLAGS.image_size, FLAGS.batch
    specs = [_spec((batch, size, size, 3)), _spec((batch, size, size), "int32")]
    return model.step, specs, task.in_specs(mesh) if hand else "auto"

  return {"mlp": ("model", build_mlp), "mlp_train_step": ("model", build_mlp_train),
          "attention": ("model", build_attention), "transformer": ("model", build_transformer),
          "moe": ("expert", build_moe), "unet": ("spatial", build_unet)}


def state_bytes(low, specs):
  """Arguments + captured variables per device (shards padded) of a lowered program."""
  args = sum(math.prod(s.shard_shape(tuple(t.shape))) * t.dtype.size for s, t in zip(low.in_shardings, specs))
  return args + sum(r.bytes_per_device for r in low.report.state)


def activation_bytes(low):
  """What the plan's program holds at its peak besides arguments and variables (constants, live activations), per
  device at the plan's layouts, as the budget counts it (rewriter.sharding.auto.plan_memory); None when the library has
  no such count."""
  from tf_gspmd.rewriter.sharding import auto as auto_pass  # pylint: disable=g-import-not-at-top
  plan_memory = getattr(auto_pass, "plan_memory", None)
  return None if plan_memory is None else plan_memory(low.program)[1]


def lower(build, mesh, hand, budget=None):
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  fn, specs, ins = build(mesh, hand)
  kwargs = {} if hand else {"memory_budget": budget}
  start = time.perf_counter()
  low = gs.function(fn, mesh=mesh, in_shardings=ins, **kwargs).lower(*specs)
  return low, state_bytes(low, specs), time.perf_counter() - start


def _short(e):
  return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}" if str(e) else type(e).__name__


def main(_):
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  unknown = [w for w in FLAGS.only if w not in WORKLOADS]
  if unknown:
    raise SystemExit(f"--only: unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
  shapes = [tuple(int(s) for s in m.split("x")) for m in FLAGS.meshes]
  if any(len(s) not in (1, 2) for s in shapes):
    raise SystemExit(f"--meshes: one or two axes per mesh, got {FLAGS.meshes}")
  begin = time.perf_counter()
  rows, notes = [], []
  with_activations = None
  for name, (model_axis, build) in workloads().items():
    if FLAGS.only and name not in FLAGS.only:
      continue
    for shape in shapes:
      mesh = gs.Mesh(shape, (model_axis,) if len(shape) == 1 else ("data", model_axis))
      where = f"{name} {shape}"
      hand_bytes = hand_state = hand_act = budget = None
      try:
        hand, hand_state, hand_s = lower(build, mesh, hand=True)
        hand_bytes, hand_act = hand.report.bytes_per_device(), activation_bytes(hand)
        with_activations = hand_act is not None and FLAGS.budget == "memory"
        budget = hand_state + (hand_act if with_activations else 0)
        hand_cells = [f"{hand_bytes:,}", f"{hand_state:,}", "-" if hand_act is None else f"{hand_act:,}"]
      except Exception as e:  # pylint: disable=broad-except
        hand_s = math.nan
        hand_cells = [f"hand plan fails ({type(e).__name__})", "-", "-"]
        notes.append(f"{where}: the hand plan does not lower:\n{traceback.format_exc()}")
      label = str(shape)
      try:
        auto, auto_state, auto_s = lower(build, mesh, hand=False, budget=budget)
      except Exception as e:  # pylint: disable=broad-except
        print(f"{where}: auto FAILS: {_short(e)}", flush=True)
        budget_text = "no budget" if budget is None else f"the budget {budget:,}"
        if budget is None or type(e).__name__ != "AutoShardingError":
          notes.append(f"{where}: the auto pass fails under {budget_text}:\n{traceback.format_exc()}")
          rows.append((name, label, *hand_cells, f"auto fails ({type(e).__name__})", *["-"] * 6))
          continue
        notes.append(f"{where}: AutoShardingError under {budget_text} (the row: auto without a budget): {e}")
        try:   # the hand plan's memory is out of the auto plan's reach: the row without a budget
          auto, auto_state, auto_s = lower(build, mesh, hand=False)
          label, budget = f"{shape} no budget", None
        except Exception:  # pylint: disable=broad-except
          rows.append((name, label, *hand_cells, f"auto fails ({type(e).__name__})", *["-"] * 6))
          notes.append(f"{where}: the auto pass fails without a budget too:\n{traceback.format_exc()}")
          continue
      plan, r = auto.auto_plan, auto.report
      auto_bytes, auto_act = r.bytes_per_device(), activation_bytes(auto)
      if hand_bytes:
        ratio = f"{auto_bytes / hand_bytes:.2f}"
      else:
        ratio = "1.00" if hand_bytes == 0 and auto_bytes == 0 else "-"
      rows.append((name, label, *hand_cells, f"{auto_bytes:,}", f"{plan.predicted_bytes:,}", f"{auto_state:,}",
                   "-" if auto_act is None else f"{auto_act:,}", ratio,
                   f"{r.pass_times.get('auto_shard', math.nan):.2f} ({plan.build_seconds:.2f}+"
                   f"{plan.solve_seconds:.2f})", f"{plan.variables:,} x {plan.constraints:,}"))
      print(f"{where}: lowered in {hand_s:.1f} s (hand), {auto_s:.1f} s (auto, {plan.status}), "
            f"{'no budget' if budget is None else f'budget {budget:,} B'}", flush=True)
      if FLAGS.verbose:
        print(plan)
      if hand_bytes is not None and auto_bytes > hand_bytes:
        notes.append(f"{where}: auto sends more than the hand plan: {auto_bytes:,} vs {hand_bytes:,} B/device "
                     f"(state {auto_state:,} vs {hand_state:,} B/device, activations {auto_act} vs {hand_act}; "
                     f"budget {budget if budget is None else format(budget, ',')})")
      if auto_state != plan.state_bytes_per_device:
        notes.append(f"{where}: auto state measured {auto_state:,} B/device, the plan says "
                     f"{plan.state_bytes_per_device:,}")
      used = auto_state + (auto_act if with_activations else 0)
      if budget is not None and used > budget:
        notes.append(f"{where}: auto memory {used:,} B/device is over the budget {budget:,}")
      if auto_bytes != plan.predicted_bytes:
        notes.append(f"{where}: auto measured {auto_bytes:,} B/device, predicted {plan.predicted_bytes:,}")
  print()
  head = ("workload", "mesh", "hand B/dev", "hand state B/dev", "hand act. B/dev", "auto B/dev", "auto predicted",
          "auto state B/dev", "auto act. B/dev", "auto/hand", "auto pass s (build+solve)", "program (cols x rows)")
  widths = [max(len(x) for x in col) for col in zip(head, *rows)]
  for row in [head] + rows:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
  what = ("arguments + variables + activations live at the peak" if with_activations else
          "arguments + variables")
  print(f"\n{len(rows)} rows in {time.perf_counter() - begin:.0f} s (plan mode, no devices); memory_budget of the "
        f"auto plan: the hand plan's {what} per device")
  for n in notes:
    print(f"- {n}")


if __name__ == "__main__":
  app.run(main)
