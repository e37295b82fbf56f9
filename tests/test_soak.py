"""A shortened soak (bench/soak.py): 200 steps of a transformer's Keras step and 150 Keras `fit` steps, each through
both exchanges, in a fresh process. Exactly one lowering each (no retrace), and after the warm-up neither resident
memory nor the step time grows beyond noise (the full run, `python bench/soak.py`, is 2,000 and 500 steps)."""

import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MEMORY_NOISE_PCT = 3.0     # the allocator's pools settle within this after warm-up
SLOWING_NOISE_PCT = 100.0  # 50-step windows on 2 shared cores vary by half: a doubling is a slowdown


def test_long_runs_lower_once_and_hold_their_memory():
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path), TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONWARNINGS="ignore")
  out = subprocess.run([sys.executable, "bench/soak.py", "--json", "--steps=200", "--fit_steps=150", "--every=50",
                        "--warmup=50"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
  assert [(r["name"], r["exchange"]) for r in runs] == [("gs.function step", "auto"), ("keras fit", "auto"),
                                                       ("gs.function step", "collectives"),
                                                       ("keras fit", "collectives")]
  for r in runs:
    assert r["lowerings"] == 1, r
    assert r["rss_growth_pct"] <= MEMORY_NOISE_PCT, r
    assert r["slowing_pct"] <= SLOWING_NOISE_PCT, r
