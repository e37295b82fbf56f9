"""The automatic two-level plan (gs.auto_parallel) against hand plans: measured on 8 logical CPUs, planned for 256.

  python bench/alpa.py                       # transformer, MoE and U-Net on mesh (2, 4), measured
  python bench/alpa.py --model moe           # one of them
  python bench/alpa.py --plan_devices 256    # the same plans for a (32, 8) mesh, planned without its devices

Models (each a functional `loss_fn(params, *batch)`, the loss a mean over the batch rows):
  transformer  a decoder with a large vocabulary head (examples/transformer_model.py)
  moe          the GShard mixture-of-experts decoder of examples/train_moe.py (top-2 gating, expert capacity)
  unet         a small conv U-Net: 2 down blocks, a bottleneck, 2 up blocks with skip concatenations, a 1x1
               classifier per pixel (the Keras model of examples/train_convnet.py in functional form)

One training step per plan: loss and gradients of every parameter and Keras's Adam update (--optimizer adam, the
default; --optimizer none: loss and gradients only), the parameters and both moments kept on the devices from step
to step in each plan's layouts (the two-level rows: on their home stages' submeshes, `step.adam`):
  data parallel     gs.function, batch split over all devices, weights replicated
  hand layout       gs.function with the model's own layout: transformer Megatron on (data, model) (heads and MLP
                    hidden over model); MoE expert parallel as train_moe.py (one `expert` axis: groups outside the
                    experts, experts inside, all-to-alls between); U-Net spatial (batch over data, image rows over
                    spatial, halo exchanges) as train_convnet.py
  intra-op auto     gs.function with in_shardings="auto" (the integer program over the whole step)
  GSPMD pipeline    gs.pipeline over (stage, data) = (4, devices / 4): the transformer's decoder blocks as stages
                    (identical stages only: a '-' row for the others)
  auto two-level    gs.auto_parallel (profiling on): stages, submeshes and their intra-operator plans (an MPMD
                    pipeline), or the step without a pipeline (one gs.function in the fastest of the planned,
                    whole-step automatic and data-parallel layouts), whichever its profiled prices rank first;
                    the plan it turned down is run too (`step.select`), for its measured and predicted step
Measured (8 devices): the step's median of --repeats (the rows taking turns, so load falls on all alike), every
loss checked against the unpartitioned step's. Predicted: the planner's T* (for intra-op auto, its model's price of the whole step as one stage on the
whole mesh; for the two-level rows, T* from the profiled stage latencies).
Memory per device: gs.function, the per-device program's estimated peak; two-level, the planner's count of its
largest stage (weights, gradients, 2 optimizer slots, the activations in flight).
With --plan_devices N (N = 8 x rows): every gs.function row lowered for (N / 8, 8) from TensorSpecs (plan mode,
no devices, nothing of the model's size allocated) and the two-level plan from gs.plan_stages; a larger config.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top
import tensorflow as tf  # noqa: E402  pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_moe as moe  # noqa: E402  pylint: disable=g-import-not-at-top
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top
import unet_model  # noqa: E402  pylint: disable=g-import-not-at-top

import tf_gspmd as gs  # noqa: E402  pylint: disable=g-import-not-at-top
from tf_gspmd import P  # noqa: E402  pylint: disable=g-import-not-at-top
from timing import interleaved  # noqa: E402  pylint: disable=g-import-not-at-top

MODELS = ("transformer", "moe", "unet")
LR = 1e-3   # Adam's learning rate (--optimizer adam)


class Model:
  """A model for the bench: its loss, parameter shapes, batch, hand layout and (optional) GSPMD pipeline."""

  def __init__(self, name, loss, shapes, batch, init, hand, pipeline, layers):
    self.name, self.loss, self.shapes, self.batch, self.init = name, loss, shapes, batch, init
    self.hand = hand          # (row label, mesh, batch specs, {param: spec}, loss to run)
    self.pipeline = pipeline  # (row label, mesh, loss, {param: shape}, init, batch specs, {param: spec}) or reason
    self.layers = layers      # the planner's layers


def _grid(devices, axes):
  """(devices / 8, 8) for 2-D axes (8 devices: (2, 4))."""
  shape = (2, 4) if devices == 8 else (devices // 8, 8)
  return gs.Mesh(shape, axes)


# ---- the three models ------------------------------------------------------------------------------------------
def transformer(a, devices, microbatches):
  cfg = tm.Config(layers=a.layers, d_model=a.d_model, heads=a.heads, d_ff=a.d_ff, vocab=a.vocab, seq=a.seq,
                  batch=a.batch)

  def loss(prm, tok, tgt):
    return tm.loss_fn(prm, tok, tgt, cfg)

  meg = tm.megatron_specs(cfg)
  hand = ("Megatron (data x model)", _grid(devices, ("data", "model")), (P("data", None),) * 2, meg, loss)
  if cfg.layers % 4:
    pipe = "the decoder blocks do not divide into 4 stages"
  else:
    pshapes = {k: ((4, cfg.layers // 4) + s if k.startswith("layers/") else s)
               for k, s in tm.pipelined_shapes(cfg).items()}

    def ploss(prm, tok, tgt):
      return tm.pipelined_loss(prm, tok, tgt, cfg, microbatches)

    pipe = (f"GSPMD pipeline (4 stages x {devices // 4} data, {microbatches} microbatches)",
            gs.Mesh((4, devices // 4), ("stage", "data")), ploss, pshapes,
            lambda: tm.init_pipelined_params(cfg, 4), (P("data", None),) * 2, tm.pipelined_specs(cfg))
  return Model("transformer", loss, tm.param_shapes(cfg), tm.synthetic_batch(cfg, seed=1),
               lambda: tm.init_params(cfg, seed=0), hand, pipe, cfg.layers + 2)


def mixture_of_experts(a, devices, microbatches):  # pylint: disable=unused-argument
  f = moe.FLAGS
  if not f.is_parsed():
    f(["alpa"])
  experts = max(a.experts, devices) if devices > 8 else a.experts   # one expert (at least) per device
  for k, v in dict(layers=a.moe_layers, d_model=a.d_model, heads=a.heads, d_ff=a.moe_d_ff, experts=experts,
                   vocab=a.moe_vocab, seq_len=a.seq, batch=a.moe_batch, auto=False).items():
    setattr(f, k, v)
  specs = moe.param_specs(P)
  cfg = tm.Config(vocab=a.moe_vocab, seq=a.seq, batch=a.moe_batch)

  def make(annotated):
    def loss(prm, tok, tgt):
      keep = f.auto_parallel
      f.auto_parallel = not annotated   # train_moe's annotations (gs.shard over `expert`) only when annotated
      try:
        logits, aux = moe.forward(prm, tok, gs if annotated else None, P)
      finally:
        f.auto_parallel = keep
      lm = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tgt, logits=logits))
      return lm + f.aux_weight * aux
    return loss

  def init():
    return {name: np.asarray(moe._initializer(kind, 1000 + k)(shape), np.float32)  # pylint: disable=protected-access
            for k, (name, (shape, _, kind)) in enumerate(sorted(specs.items()))}

  hand = (f"expert parallel (`expert` axis of {devices}, as train_moe)", gs.Mesh((devices,), ("expert",)),
          (P("expert", None),) * 2, {n: s for n, (_, s, _) in specs.items()}, make(True))
  return Model("moe", make(False), {n: shape for n, (shape, _, _) in specs.items()},
               tm.synthetic_batch(cfg, seed=1), init, hand, "the MoE blocks are not written as stacked stages",
               f.layers + 2)


def unet(a, devices, microbatches):  # pylint: disable=unused-argument
  size, batch = (a.image, a.image_batch) if devices == 8 else (2 * a.image, 2 * devices)
  shapes = unet_model.param_shapes(a.width)
  hand = ("spatial (batch over data, rows over spatial)", _grid(devices, ("data", "spatial")),
          (P("data", "spatial", None, None), P("data", "spatial", None)), {k: P() for k in shapes},
          unet_model.loss_fn)
  return Model("unet", unet_model.loss_fn, shapes, unet_model.synthetic_batch(batch, size),
               lambda: unet_model.init_params(shapes), hand, "the U-Net's levels differ (no identical stages)", 6)


BUILD = {"transformer": transformer, "moe": mixture_of_experts, "unet": unet}


# ---- rows --------------------------------------------------------------------------------------------------------
def _time_rows(rows, repeats):
  """The rows with each call in the measured slot replaced by its median seconds over `repeats` calls, the rows
  taking turns (`timing.interleaved`: load on the shared machine falls on all of them alike)."""
  got = interleaved({k: r[1] for k, r in enumerate(rows) if callable(r[1])}, repeats, block=2)
  return [(r[0], got[k]) + tuple(r[2:]) if k in got else r for k, r in enumerate(rows)]


def _grad_step(loss, names, n_batch):
  def step(*args):
    params = dict(zip(names, args[n_batch:]))
    with tf.GradientTape() as tape:
      tape.watch(list(params.values()))
      value = loss(params, *args[:n_batch])
    return (value,) + tuple(tape.gradient(value, [params[k] for k in names]))
  return step


def _adam_step(loss, names, n_batch, lr=LR, b1=0.9, b2=0.999, eps=1e-7):
  """step(*batch, *params, *m, *v, t) -> (loss, params, m, v, t + 1): the gradient step and Keras's Adam update
  in one program (the state returned in the layouts it came in, fed to the next call)."""
  grad_step, n = _grad_step(loss, names, n_batch), len(names)

  def step(*args):
    batch, ps, ms, vs, t = (args[:n_batch], args[n_batch:n_batch + n], args[n_batch + n:n_batch + 2 * n],
                            args[n_batch + 2 * n:n_batch + 3 * n], args[-1])
    out = grad_step(*batch, *ps)
    t1 = t + 1.0
    alpha = lr * tf.sqrt(1.0 - b2 ** t1) / (1.0 - b1 ** t1)
    ms = [m + (g - m) * (1.0 - b1) for m, g in zip(ms, out[1:])]
    vs = [v + (tf.square(g) - v) * (1.0 - b2) for v, g in zip(vs, out[1:])]
    ps = [p - alpha * m / (tf.sqrt(v) + eps) for p, m, v in zip(ps, ms, vs)]
    return (out[0],) + tuple(ps) + tuple(ms) + tuple(vs) + (t1,)
  return step


def _spec(x):
  return tf.TensorSpec(x.shape, tf.as_dtype(x.dtype))


def _spmd_row(name, loss, mesh, batch_specs, param_specs, shapes, batch, init, measure, adam):
  """(name, a call to time or None, predicted s or None, memory bytes per device, loss or None) of a gs.function
  row. The call returns the loss; without `adam` the gradients stay on the devices, as the two-level step's do;
  with it the step also applies Adam, and parameters and moments stay on the devices from call to call."""
  names = sorted(shapes)
  specs = [_spec(b) for b in batch] + [tf.TensorSpec(shapes[k], tf.float32) for k in names]
  if not adam:
    shardings = "auto" if param_specs == "auto" else tuple(batch_specs) + tuple(param_specs[k] for k in names)
    f = gs.function(_grad_step(loss, names, len(batch)), mesh=mesh, in_shardings=shardings)
  else:
    step = _adam_step(loss, names, len(batch))
    specs += specs[len(batch):] * 2 + [tf.TensorSpec([], tf.float32)]
    if param_specs == "auto":   # the layouts the integer program chose, kept by the results that come back
      shardings = tuple(gs.function(step, mesh=mesh, in_shardings="auto").lower(*specs).in_shardings)
    else:
      shardings = tuple(batch_specs) + tuple(param_specs[k] for k in names) * 3 + (P(),)
    f = gs.function(step, mesh=mesh, in_shardings=shardings, out_shardings=(P(),) + shardings[len(batch):])
  peak = f.lower(*specs).report.memory.peak_bytes
  if not measure:
    return name, None, None, peak, None
  params = init()
  state = [tuple(params[k] for k in names)]
  if adam:
    state[0] += tuple(np.zeros(shapes[k], np.float32) for k in names) * 2 + (np.float32(0.0),)

  def call():
    out = f(*batch, *state[0])
    if adam:
      state[0] = tuple(out[1:])
    return out[0].numpy()
  return name, call, None, peak, float(call())


def _whole_prediction(m, mesh):
  """The planner's price of the whole step as one stage on the whole mesh, the whole batch in one call."""
  whole = gs.plan_stages(m.loss, {k: tf.TensorSpec(s, tf.float32) for k, s in m.shapes.items()},
                         *[_spec(b) for b in m.batch], mesh=mesh, layers=m.layers, microbatches=1, max_stages=1,
                         whole_mesh=True)
  assert len(whole.stages) == 1, whole
  return whole


def _stage_memory(plan):
  return max(s.memory_bytes for s in plan.stages)


def _submeshes(plan):
  return ", ".join(f"({r},{c})" for r, c in (s.submesh for s in plan.stages))


def run_model(m, a, devices):
  """The rows of model `m`: measured on 8 devices, planned only (plan mode) on more."""
  measure = devices == 8
  host = _grid(devices, ("host", "device"))
  common = dict(shapes=m.shapes, batch=m.batch, init=m.init, measure=measure, adam=a.optimizer == "adam")
  dp_axes = _grid(devices, ("data", "model"))
  rows, want = [], None
  if measure:
    names = sorted(m.shapes)
    params = m.init()
    ref = tf.function(_grad_step(m.loss, names, len(m.batch)))
    want = float(ref(*[tf.constant(x) for x in tuple(m.batch) + tuple(params[k] for k in names)])[0])
  rows.append(_spmd_row(f"data parallel ({devices})", m.loss, dp_axes,
                        [P(("data", "model"), *(None,) * (len(b.shape) - 1)) for b in m.batch],
                        {k: P() for k in m.shapes}, **common))
  label, mesh, batch_specs, specs, loss = m.hand
  rows.append(_spmd_row(label, loss, mesh, batch_specs, specs, **common))
  start = time.perf_counter()
  auto = _spmd_row('intra-op auto (`in_shardings="auto"`)', m.loss, dp_axes, None, "auto", **common)
  whole = _whole_prediction(m, host)
  rows.append(auto[:2] + (whole.predicted_seconds,) + auto[3:])
  print(f"[{m.name}] intra-op auto lowered and priced in {time.perf_counter() - start:.1f} s", flush=True)
  if isinstance(m.pipeline, str):
    rows.append(("GSPMD pipeline: - (" + m.pipeline + ")", None, None, None, None))
  else:
    label, mesh, ploss, pshapes, pinit, pbatch, pspecs = m.pipeline
    rows.append(_spmd_row(label, ploss, mesh, pbatch, pspecs, **dict(common, shapes=pshapes, init=pinit)))
  rows += two_level_rows(m, a, host, measure, whole)
  return _time_rows(rows, a.repeats), want


def two_level_rows(m, a, mesh, measure, whole):
  start = time.perf_counter()
  if not measure:   # what gs.auto_parallel plans: the pipelined plan, or the whole-mesh one when priced below it
    micro = [tf.TensorSpec((b.shape[0] // a.microbatches,) + b.shape[1:], tf.as_dtype(b.dtype)) for b in m.batch]
    plan = gs.plan_stages(m.loss, {k: tf.TensorSpec(s, tf.float32) for k, s in m.shapes.items()}, *micro,
                          mesh=mesh, layers=m.layers, microbatches=a.microbatches)
    took = time.perf_counter() - start
    print(plan, flush=True)
    print(f"[{m.name}] two-level planned for {mesh.size} devices in {took:.1f} s", flush=True)
    piped = (f"{len(plan.stages)} stage(s) on {_submeshes(plan)}; {a.microbatches} microbatches; planned in "
             f"{took:.0f} s")
    if whole.predicted_seconds < plan.predicted_seconds:
      return [(f"auto pipelined, turned down ({piped})", None, plan.predicted_seconds, _stage_memory(plan), None),
              ("auto two-level (the intra-operator plan alone, no pipeline)", None, whole.predicted_seconds,
               _stage_memory(whole), None)]
    return [(f"auto two-level ({piped})", None, plan.predicted_seconds, _stage_memory(plan), None)]
  params = m.init()
  two = gs.auto_parallel(m.loss, params, *m.batch, mesh=mesh, microbatches=a.microbatches, layers=m.layers)
  took = time.perf_counter() - start
  print(two, flush=True)
  chosen = two.plan
  what = (f"{len(chosen.stages)} stages on {_submeshes(chosen)}; {two.microbatches} microbatches"
          if chosen is two.pipelined_plan else
          f"no pipeline: one gs.function, {two.whole_layouts} layouts, the fastest of "
          + ", ".join(f"{k} {_ms(v, 1)} ms" for k, v in two.whole_timings.items()))
  def runner(plan):
    """A call of `plan`'s step (with Adam: its update on the stages' submeshes, the parameters and moments kept
    there from call to call)."""
    two.select(plan)   # (each plan's runtime is built once: switching lowers nothing again)
    if a.optimizer != "adam":
      return lambda: two.select(plan) or two(params, *m.batch)[0]
    opt, state = two.adam(LR), [two.place(params)]

    def call():
      two.select(plan)
      loss, grads = two(state[0], *m.batch)
      state[0] = opt(state[0], grads)
      return loss
    return call

  run_chosen = runner(chosen)
  last = (f"auto two-level ({what}; planned and profiled in {took:.0f} s, {two.profiled_rounds} pipelined plan(s) "
          f"timed)", run_chosen, chosen.predicted_seconds, _stage_memory(chosen), float(run_chosen()))
  rows = []
  other = two.pipelined_plan if chosen is not two.pipelined_plan else two.intra_plan
  if other is not None:   # the plan the planner turned down, run for its measurement
    desc = (f"{len(other.stages)} stage(s) on {_submeshes(other)}" if other is two.pipelined_plan else
            f"no pipeline, {two.whole_layouts} layouts")
    run_other = runner(other)
    rows.append((f"auto, turned down ({desc})", run_other, other.predicted_seconds, _stage_memory(other),
                 float(run_other())))
  return rows + [last]


def _ms(x, digits):
  return "-" if x is None else f"{x * 1e3:.{digits}f}"


def table(m, rows, want, devices):
  print(f"\n{m.name} on {devices} devices" + (f"; unpartitioned loss {want:.6f}" if want is not None else
                                             " (planned, no devices)"))
  print("| plan | measured ms | predicted ms | memory / device (MiB) | loss |")
  print("|---|---:|---:|---:|---:|")
  for name, sec, pred, mem, value in rows:
    mem_s = "-" if mem is None else f"{mem / 2**20:.2f}"
    loss_s = "-" if value is None else f"{value:.6f}"
    print(f"| {name} | {_ms(sec, 1)} | {_ms(pred, 2)} | {mem_s} | {loss_s} |")
  if want is None:
    return
  for name, _, _, _, value in rows:
    if value is not None:
      np.testing.assert_allclose(value, want, rtol=1e-4, err_msg=f"{m.name}: {name}")
  hand = [r[1] for r in rows[:-1] if r[1] is not None and "turned down" not in r[0]]
  two = rows[-1]
  print(f"\nauto two-level / best other plan (measured): {two[1] / min(hand):.2f}x; predicted / measured "
        f"(two-level): {two[2] / two[1]:.3f}", flush=True)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--model", choices=MODELS + ("all",), default="all")
  p.add_argument("--plan_devices", type=int, default=None,
                 help="plan every row for a (N / 8, 8) mesh without devices (a larger config) instead of measuring")
  p.add_argument("--layers", type=int, default=None, help="transformer decoder blocks (4; 16 planned)")
  p.add_argument("--d_model", type=int, default=64)
  p.add_argument("--heads", type=int, default=None, help="attention heads (4; 8 planned, one per `model` device)")
  p.add_argument("--d_ff", type=int, default=256)
  p.add_argument("--vocab", type=int, default=8192)
  p.add_argument("--seq", type=int, default=32)
  p.add_argument("--batch", type=int, default=None, help="transformer sequences (32; 4 per device planned)")
  p.add_argument("--moe_layers", type=int, default=None, help="MoE blocks (2; 4 planned)")
  p.add_argument("--moe_d_ff", type=int, default=128)
  p.add_argument("--experts", type=int, default=8, help="experts (planned: at least one per device)")
  p.add_argument("--moe_vocab", type=int, default=1024)
  p.add_argument("--moe_batch", type=int, default=None, help="MoE groups (16; 2 per device planned)")
  p.add_argument("--image", type=int, default=32, help="U-Net image size (twice that planned)")
  p.add_argument("--image_batch", type=int, default=16)
  p.add_argument("--width", type=int, default=8, help="U-Net channels of the first level")
  p.add_argument("--microbatches", type=int, default=None, help="4 (16 planned)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--optimizer", choices=("adam", "none"), default="adam",
                 help="adam: every row's step applies Adam too, its state kept on the devices; none: loss and "
                      "gradients only")
  a = p.parse_args()
  devices = a.plan_devices or 8
  if devices % 8 or devices < 8:
    p.error(f"--plan_devices {devices}: a multiple of 8 (the mesh is (N / 8, 8))")
  big = devices > 8
  a.layers = a.layers or (16 if big else 4)
  a.moe_layers = a.moe_layers or (4 if big else 2)
  a.heads = a.heads or (8 if big else 4)
  a.batch = a.batch or (4 * devices if big else 32)
  a.moe_batch = a.moe_batch or (2 * devices if big else 16)
  a.microbatches = a.microbatches or (16 if big else 4)
  if not big:
    gs.split_cpu_devices(8)
  for name in (MODELS if a.model == "all" else (a.model,)):
    m = BUILD[name](a, devices, a.microbatches)
    rows, want = run_model(m, a, devices)
    table(m, rows, want, devices)


if __name__ == "__main__":
  main()
