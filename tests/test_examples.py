"""The training binaries: they train (losses fall, first steps match unpartitioned), plan 2048 devices, resume."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SMALL = {
    "train_transformer.py": ["--layers=1", "--d_model=32", "--d_ff=64", "--seq_len=16", "--batch=8", "--lr=1e-2"],
    "train_moe.py": ["--layers=1", "--d_model=32", "--d_ff=32", "--seq_len=16", "--batch=8", "--lr=1e-2"],
    "train_convnet.py": ["--image_size=32", "--width=8", "--batch=4", "--lr=1e-2"],
}


def _env():
  return dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")


def _run(binary, *flags, timeout=300):
  out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", binary), *SMALL[binary], *flags],
                       capture_output=True, text=True, timeout=timeout, env=_env(), check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


def _losses(text):
  return {int(k): float(v) for k, v in re.findall(r"^step (\d+) loss ([0-9.eE+-]+)", text, re.M)}


@pytest.mark.parametrize("binary", sorted(SMALL))
def test_binary_trains_and_matches_the_unpartitioned_program(binary, tmp_path):
  out = _run(binary, "--steps=12", "--check_steps=2", "--ckpt_every=0", f"--logdir={tmp_path}", "--profile=4,5")
  losses = _losses(out)
  assert sorted(losses) == list(range(12))
  assert sum(losses[k] for k in range(9, 12)) < 0.9 * sum(losses[k] for k in range(3)), losses
  assert "check: first 2 losses match the unpartitioned program" in out
  events = [f for _, _, files in os.walk(tmp_path) for f in files if f.startswith("events.out.tfevents")]
  assert events   # TensorBoard scalars
  traces = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".xplane.pb")]
  assert traces and "profile of steps 4-5 written" in out   # the profiler trace of --profile


@pytest.mark.parametrize("binary", sorted(SMALL))
def test_plan_for_2048_devices_without_them(binary):
  out = _run(binary, "--plan")
  assert "(2048 devices)" in out and "B/device" in out and "collective" in out


def test_sigkill_then_resume_continues_with_the_same_losses(tmp_path):
  binary = "train_transformer.py"
  flags = ["--steps=40", "--check_steps=0", "--ckpt_every=4"]
  straight = _losses(_run(binary, *flags, f"--logdir={tmp_path / 'straight'}"))
  log = open(tmp_path / "killed.log", "w")
  proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", binary), *SMALL[binary], *flags,
                           f"--logdir={tmp_path / 'resumed'}"], stdout=log, stderr=subprocess.STDOUT, env=_env())
  try:
    deadline = time.time() + 240
    while "step 9 loss" not in open(tmp_path / "killed.log").read():
      assert proc.poll() is None and time.time() < deadline, open(tmp_path / "killed.log").read()[-2000:]
      time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == -signal.SIGKILL   # killed mid-run, not finished
  out = _run(binary, *flags, f"--logdir={tmp_path / 'resumed'}", "--resume")
  start = int(re.search(r"resumed from \S+ at step (\d+)", out).group(1))
  assert start >= 8 and start % 4 == 0 and start < 40   # the last checkpoint written before the kill
  resumed = _losses(out)
  assert sorted(resumed) == list(range(start, 40))
  for k in resumed:
    assert abs(resumed[k] - straight[k]) <= 1e-5 * abs(straight[k]), (k, resumed[k], straight[k])
