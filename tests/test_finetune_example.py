"""examples/finetune_keras_hub.py: a keras-hub causal LM fine-tuned under ModelParallel with its own layout map.

Each run trains, generates, and passes the binary's own check (the same model trained by plain Keras without a
distribution: every step's loss within --check_rtol; with the trained weights, the same generated text).
"""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("keras_hub")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BINARY = os.path.join(ROOT, "examples", "finetune_keras_hub.py")
TINY = ["--layers=1", "--hidden_dim=32", "--heads=2", "--kv_heads=1", "--intermediate_dim=32", "--seq_len=16",
        "--batch_size=4", "--steps=8", "--check_steps=0", "--generate_len=4"]


def _run(*flags, timeout=300):
  return subprocess.run([sys.executable, BINARY, *flags], capture_output=True, text=True, timeout=timeout,
                        env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1"),
                        cwd=ROOT, check=False)


@pytest.mark.parametrize("model,lora_rank", [("gemma", 0), ("llama", 2)])
def test_finetune_matches_plain_keras(model, lora_rank):
  out = _run(*TINY, f"--model={model}", f"--lora_rank={lora_rank}")
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  text = out.stdout
  losses = {int(k): float(v) for k, v in re.findall(r"^step (\d+) loss ([0-9.eE+-]+)", text, re.M)}
  assert sorted(losses) == list(range(8)), text
  check = re.search(r"^check: the first 8 losses match plain Keras without a distribution \(max relative "
                    r"difference ([0-9.eE+-]+) <= 1e-05\); generate\(\) gives plain Keras's text with the trained "
                    r"weights$", text, re.M)
  assert check and float(check.group(1)) <= 1e-5, text
  assert re.search(r"^generate: 'it was the .{4}'$", text, re.M), text
  split, total = map(int, re.search(r"^(\d+) of (\d+) weights stored split", text, re.M).groups())
  assert 0 < split < total
  trained, params = (int(n.replace(",", "")) for n in
                     re.search(r"([\d,]+) of ([\d,]+) parameters train", text).groups())
  frozen = re.findall(r"^  \S+/kernel +\([\d, ]+\) +P\(.*'model'.*\)  \(frozen\)$", text, re.M)
  if lora_rank:   # only the adapters train; the frozen weights are still stored split
    assert trained < params / 10 and frozen, text
    assert re.search(r"^  \S+/lora_kernel_a ", text, re.M), text
  else:
    assert trained == params and not frozen, text
    assert sum(losses[k] for k in (6, 7)) < 0.8 * sum(losses[k] for k in (0, 1)), losses


def test_bad_flags_are_refused_by_name():
  for flag, message in [("--mesh=8", "--mesh must be two positive integers BATCH,MODEL"),
                        ("--kv_heads=3", "--kv_heads (3) must divide --heads (4)"),
                        ("--vocab=8", "--vocab must be at least"),
                        ("--lora_rank=-1", "--lora_rank must be 0 (full fine-tuning) or positive"),
                        ("--check_steps=-1", "--check_steps must be 0 (all) or positive")]:
    out = _run(flag, timeout=60)
    assert out.returncode != 0 and message in out.stderr, (flag, out.stderr[-2000:])
