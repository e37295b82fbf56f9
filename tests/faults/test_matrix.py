"""The fault matrix: one process of two SIGKILLed at each point where a distributed training job can die, on
127.0.0.1 through `python -m tf_gspmd.launch` (tests/cluster_programs/fault_cell.py is the job).

In every cell the surviving process stops with ProcessLostError naming the lost task within DEADLINE_S of the
death (the cell's cluster declares a silent process lost after 10 s: gs.initialize(heartbeat_timeout=10)), nothing
hangs (each cell has a hard timeout well above the deadline), the launcher exits non-zero, and the checkpoint or
weights file completed before the fault restores equal to the values saved. The cells run a few at a time: they
spend most of their time waiting for the cluster to notice the loss.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROGRAM = os.path.join(ROOT, "tests", "cluster_programs", "fault_cell.py")
DEADLINE_S = 60.0
HARD_TIMEOUT_S = 300
AT_ONCE = 6
CELLS = {   # name: (point, exchange, devices per worker, the victim's process)
    "before_join": ("before_join", "auto", 2, 1),
    "first_lowering": ("first_lowering", "auto", 2, 1),
    "step_one_graph": ("step", "auto", 2, 1),
    "step_collectives": ("step", "collectives", 2, 1),
    "checkpoint_save_worker": ("checkpoint_save", "auto", 2, 1),
    "checkpoint_save_chief": ("checkpoint_merge", "auto", 2, 0),
    "keras_weights_file_save": ("weights_save", "auto", 2, 1),
    "cross_process_reshard": ("reshard", "auto", 2, 1),
    "mpmd_pipeline_sender": ("mpmd_sender", "auto", 4, 0),
    "mpmd_pipeline_receiver": ("mpmd_receiver", "auto", 4, 1),
    "auto_parallel_step": ("auto_parallel", "auto", 4, 1),
}


def _start(name, directory):
  point, exchange, devices, _ = CELLS[name]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
             TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
  env.pop("TF_CONFIG", None)
  log = open(os.path.join(directory, "log"), "w")
  return subprocess.Popen([sys.executable, "-m", "tf_gspmd.launch", "--workers=2", f"--devices_per_worker={devices}",
                           "--grace=150", "--", PROGRAM, f"--point={point}", f"--dir={directory}",
                           f"--exchange={exchange}"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
  """{cell: (the launcher's exit status, its output, the cell's directory)}, the cells run AT_ONCE at a time."""
  found, names = {}, list(CELLS)
  for i in range(0, len(names), AT_ONCE):
    running = {}
    for name in names[i:i + AT_ONCE]:
      directory = tmp_path_factory.mktemp(name)
      running[name] = (_start(name, str(directory)), directory)
    for name, ((proc, log), directory) in running.items():
      try:
        code = proc.wait(HARD_TIMEOUT_S)
      except subprocess.TimeoutExpired:
        proc.kill()
        code = "hung"
      log.close()
      found[name] = (code, (directory / "log").read_text(), directory)
  return found


@pytest.mark.parametrize("name", list(CELLS))
def test_the_survivor_names_the_lost_process_in_time(outcomes, name):
  code, out, directory = outcomes[name]
  victim = CELLS[name][3]
  assert code not in (0, "hung"), out[-4000:]
  assert "fault drill: this process kills itself" in out, out[-4000:]
  death = float((directory / "death").read_text())
  lost = re.findall(r"\[worker (\d+)\] LOST (\w+) ([\d.]+) (.*)", out)
  survivors = [k for k in range(2) if k != victim]
  assert sorted(int(k) for k, *_ in lost) == survivors, out[-4000:]
  for _, kind, when, message in lost:
    message = json.loads(message)
    assert kind == "ProcessLostError", message
    assert f"task:{victim}" in message, message   # names the lost task ("/job:worker/.../task:1" or "worker:1")
    assert float(when) - death <= DEADLINE_S, (float(when) - death, message)
  assert "DONE" not in out


@pytest.mark.parametrize("name", ["first_lowering", "step_one_graph", "step_collectives", "checkpoint_save_worker",
                                  "checkpoint_save_chief", "cross_process_reshard"])
def test_the_last_complete_checkpoint_restores_equal(outcomes, name):
  _, out, directory = outcomes[name]
  if name == "first_lowering":   # killed before anything was saved
    assert not (directory / "good.npz").exists(), out[-2000:]
    return
  want = np.load(directory / "good.npz")
  reader = tf.train.load_checkpoint(str(directory / "good" / "ckpt"))
  for key in ("w1", "w2"):
    np.testing.assert_array_equal(reader.get_tensor(f"{key}/.ATTRIBUTES/VARIABLE_VALUE"), want[key])
  again = directory / "again" / "ckpt.index"
  if again.exists():   # a save that completed before the fault is whole too
    reader = tf.train.load_checkpoint(str(directory / "again" / "ckpt"))
    assert all(np.isfinite(reader.get_tensor(f"{k}/.ATTRIBUTES/VARIABLE_VALUE")).all() for k in ("w1", "w2"))


def test_the_weights_file_saved_before_the_fault_loads_in_plain_keras(outcomes):
  _, out, directory = outcomes["keras_weights_file_save"]
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="up"), keras.layers.Dense(16, name="down")])
  model.load_weights(str(directory / "good.weights.h5"))
  want = np.load(directory / "good_keras.npz")
  got = [np.asarray(v) for v in model.weights]
  assert len(got) == len(want.files) == 4, out[-2000:]
  for k, g in enumerate(got):
    np.testing.assert_array_equal(g, want[f"arr_{k}"])
