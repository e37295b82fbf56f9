"""Long runs: a transformer's Keras training step run for many steps through a gs.function, and Keras `fit` under a
ModelParallel distribution, each through both exchanges (the one graph of the process's CPUs, and TF's collectives:
`gs.keras.step_options(exchange=...)` for fit), on 8 logical CPUs.

Every `--every` steps it prints the process's resident memory and the mean step time of those steps; at the end,
after a warm-up of `--warmup` steps: the growth of resident memory from the end of warm-up to the end (percent),
the mean step time of the last `--every` steps against the mean of the first `--every` after warm-up (percent),
and the lowerings (the pipeline runs of the step's gs.function: one per distinct signature, no retrace).

  .venv/bin/python bench/soak.py [--steps 2000] [--fit_steps 500] [--every 100] [--warmup 100]
  .venv/bin/python bench/soak.py --json --steps 200 --fit_steps 0 --exchange auto     # one run, as JSON
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_gspmd as gs  # noqa: E402
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top


def rss_bytes():
  with open("/proc/self/statm", encoding="utf-8") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _summary(name, exchange, rows, warmup, every, lowerings):
  after = [r for r in rows if r["step"] - every >= warmup]   # windows wholly after the warm-up
  if len(after) < 2:
    raise SystemExit(f"{name}: give more --steps than --warmup + --every")
  growth = 100.0 * (after[-1]["rss"] - after[0]["rss"]) / after[0]["rss"]
  slowing = 100.0 * (after[-1]["ms"] - after[0]["ms"]) / after[0]["ms"]
  return dict(name=name, exchange=exchange, rows=rows, rss_growth_pct=growth, slowing_pct=slowing,
              lowerings=lowerings)


def step_loop(exchange, steps, every, warmup):
  """The training binary's transformer (Keras layers, Adam) stepped through one gs.function."""
  cfg = tm.Config(layers=2)
  mesh = gs.Mesh((2, 4), ("data", "model"))
  model = tm.keras_model(cfg)
  optimizer = keras.optimizers.Adam(1e-3)
  step = gs.function(tm.make_keras_train_step(model, optimizer), mesh=mesh, in_shardings=(gs.P("data", None),) * 2,
                     exchange=exchange)
  rows, start = [], time.perf_counter()
  for k in range(steps):
    tokens, targets = tm.synthetic_batch(cfg, seed=k % 16)
    float(np.asarray(step(tokens, targets)))
    if (k + 1) % every == 0:
      now = time.perf_counter()
      rows.append(dict(step=k + 1, rss=rss_bytes(), ms=1e3 * (now - start) / every))
      start = now
  return _summary("gs.function step", exchange, rows, warmup, every, step.lowerings)


def fit_loop(exchange, steps, every, warmup):
  """Keras `fit` under a ModelParallel distribution: the train step tf_gspmd builds for it."""
  import tf_gspmd.keras  # pylint: disable=g-import-not-at-top
  previous = tf_gspmd.keras.step_options(exchange=exchange)
  dist = keras.distribution
  mesh = dist.DeviceMesh((2, 4), ("batch", "model"), devices=[f"cpu:{i}" for i in range(8)])
  layout_map = dist.LayoutMap(mesh)
  layout_map["up/kernel"] = (None, "model")
  layout_map["down/kernel"] = ("model", None)
  dist.set_distribution(dist.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
  try:
    inputs = keras.Input((32,))
    h = keras.layers.Dense(128, activation="gelu", name="up")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(8, name="down")(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16 * every, 32)).astype(np.float32), rng.standard_normal((16 * every, 8)).astype(
        np.float32)
    rows = []
    for k in range(steps // every):
      start = time.perf_counter()
      model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
      rows.append(dict(step=(k + 1) * every, rss=rss_bytes(), ms=1e3 * (time.perf_counter() - start) / every))
    lowerings = sum(f.lowerings for f in model.train_function.functions.values())
    return _summary("keras fit", exchange, rows, warmup, every, lowerings)
  finally:
    dist.set_distribution(None)
    tf_gspmd.keras.step_options(**previous)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--fit_steps", type=int, default=500)
  parser.add_argument("--every", type=int, default=100)
  parser.add_argument("--warmup", type=int, default=100)
  parser.add_argument("--exchange", default="auto,collectives")
  parser.add_argument("--json", action="store_true", help="print one JSON object per run instead of the table")
  args = parser.parse_args()
  gs.split_cpu_devices(8)
  runs = []
  for exchange in args.exchange.split(","):
    if args.steps:
      runs.append(step_loop(exchange, args.steps, args.every, args.warmup))
    if args.fit_steps:
      runs.append(fit_loop(exchange, args.fit_steps, args.every, args.warmup))
  for r in runs:
    if args.json:
      print(json.dumps(r), flush=True)
      continue
    print(f"{r['name']} (exchange={r['exchange']}): {len(r['rows']) * args.every} steps, lowerings {r['lowerings']}")
    for row in r["rows"]:
      print(f"  step {row['step']:6d}  resident {row['rss'] / 2**20:9.1f} MiB  {row['ms']:8.2f} ms/step")
    print(f"  after warm-up: resident memory {r['rss_growth_pct']:+.2f}%, step time of the last {args.every} "
          f"{r['slowing_pct']:+.1f}% against the first {args.every}", flush=True)


if __name__ == "__main__":
  main()
