"""First-step latency and warm step time of Keras training, plain and partitioned.

A small keras-hub Gemma causal LM (built from its constructor, random weights) trained with `train_on_batch`:
the first call traces the train step and, under a distribution, completes, partitions and lowers it for the
mesh before running it; later calls run the cached program. Each configuration runs in a fresh process on 8
logical CPU devices: plain Keras (no distribution), DataParallel over 8, and ModelParallel with Gemma's own
layout map on (2, 4). Also the first `evaluate` and `predict` batch after training (each a function of its own).

The warm step is the median of 20 steps after 3 warm-up steps; with `--rounds=N` the three configurations run N
times, interleaved (plain, data, model, plain, ...), so that load on a shared machine falls on all of them alike,
and each row reports the median over rounds and its ratio to plain Keras's warm step.

  .venv/bin/python bench/keras_latency.py [--rounds=3]
"""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np
import tf_gspmd as gs
gs.split_cpu_devices(8)
import keras, keras_hub
import tf_gspmd.keras  # noqa
mode = sys.argv[1]
VOCAB, SEQ, BATCH = 96, 12, 8
rng = np.random.default_rng(0)
tokens = rng.integers(1, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((BATCH, SEQ), bool)}
y = tokens[:, 1:]
devices = keras.distribution.list_devices("cpu")[:8]
if mode == "data":
  keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
elif mode == "model":
  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices)
  keras.distribution.set_distribution(keras.distribution.ModelParallel(
      layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh), batch_dim_name="batch"))
keras.utils.set_random_seed(3)
backbone = keras_hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                          num_key_value_heads=4, hidden_dim=40, intermediate_dim=56, head_dim=12)
lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
lm.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
t = time.perf_counter(); lm.train_on_batch(x, y); first = time.perf_counter() - t
for _ in range(3):
  lm.train_on_batch(x, y)
times = []
for _ in range(20):
  t = time.perf_counter(); lm.train_on_batch(x, y); times.append(time.perf_counter() - t)
t = time.perf_counter(); lm.test_on_batch(x, y); first_eval = time.perf_counter() - t
t = time.perf_counter(); lm.predict_on_batch(x); first_pred = time.perf_counter() - t
print(json.dumps({"first": first, "warm": float(np.median(times)), "eval": first_eval, "pred": first_pred}))
"""


def _run(mode):
  out = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=ROOT, capture_output=True, text=True)
  if out.returncode:
    raise SystemExit(f"{mode} failed:\n{out.stderr[-4000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
  rounds = 1
  for a in argv:
    if a.startswith("--rounds="):
      rounds = int(a.split("=", 1)[1])
  modes = ("plain", "data", "model")
  runs = {m: [] for m in modes}
  for _ in range(rounds):
    for mode in modes:
      runs[mode].append(_run(mode))
  rows = {m: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for m, rs in runs.items()}
  base = rows["plain"]
  names = {"plain": "plain Keras", "data": "DataParallel (8,)", "model": "ModelParallel (2,4), Gemma's layout map"}
  head = ("configuration", "first train step s", "vs plain", "warm step ms", "vs plain", "first evaluate s",
          "first predict s")
  table = [(names[m], f"{r['first']:.2f}", f"{r['first'] / base['first']:.2f}", f"{1e3 * r['warm']:.1f}",
            f"{r['warm'] / base['warm']:.2f}", f"{r['eval']:.2f}", f"{r['pred']:.2f}") for m, r in rows.items()]
  widths = [max(len(c) for c in col) for col in zip(head, *table)]
  print(f"median of {rounds} interleaved round(s)")
  for row in [head] + table:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
  main(sys.argv[1:])
