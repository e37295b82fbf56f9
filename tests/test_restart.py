"""A whole job killed and started again from its last checkpoint (what preemptible machines do): the transformer
binary on 2 processes x 4 logical CPUs, one process SIGKILLed as step 3 starts (`--crash_at_step`), the launcher
starting the job again (`--max_restarts=1`), the binary going on from its last checkpoint (`--resume`). Its final
weights equal an uninterrupted run of the same steps (data order included) to 1e-6."""

import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
STEPS = 6


def _train(logdir, launcher=(), binary=()):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path), TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONWARNINGS="ignore")
  env.pop("TF_CONFIG", None)
  out = subprocess.run([sys.executable, "-m", "tf_gspmd.launch", "--workers=2", "--devices_per_worker=4", "--grace=10",
                        *launcher, "--", "examples/train_transformer.py", f"--steps={STEPS}", "--ckpt_every=1",
                        "--resume", "--check_steps=0", f"--logdir={logdir}", *binary],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
  return out.stdout


def _weights(logdir):
  reader = tf.train.load_checkpoint(os.path.join(logdir, "transformer", "checkpoints"))
  keys = [k for k in reader.get_variable_to_shape_map() if "save_counter" not in k
          and not k.startswith("_CHECKPOINTABLE_OBJECT_GRAPH")]
  return {k: reader.get_tensor(k) for k in keys}


def test_a_killed_job_restarted_from_its_checkpoint_ends_as_an_uninterrupted_run(tmp_path):
  whole = str(tmp_path / "whole")
  crashed = str(tmp_path / "crashed")
  _train(whole)
  log = _train(crashed, launcher=["--max_restarts=1"], binary=["--crash_at_step=3"])
  assert "fault drill: process 1 kills itself as step 3 starts" in log, log[-3000:]
  assert "starting it again (1 of 1 restarts)" in log, log[-3000:]
  assert "resumed from" in log and "at step 3" in log, log[-3000:]
  want, got = _weights(whole), _weights(crashed)
  assert set(want) == set(got) and any("step" in k for k in want), sorted(want)
  big = [k for k in want if want[k].size >= 64 * 64]   # the weights and their Adam moments
  assert len(big) >= 8, sorted(want)
  slots = [k for k in big if k.startswith("optimizer/_variables/")]   # Adam's moments (and the weights' copies)
  assert slots and max(np.abs(want[k]).max() for k in slots) > 0, slots   # the moments are 0 until trained
  step = next(k for k in want if k.startswith("step/"))
  assert int(want[step]) == int(got[step]) == STEPS
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_keras_fit_killed_mid_epoch_resumes_from_its_backup_as_an_uninterrupted_fit(tmp_path):
  """Keras `fit` under ModelParallel on 2 processes x 4 devices with Keras's own `BackupAndRestore`: one process
  SIGKILLed as global step 6 starts (epoch 1 of 4, its third batch), the launcher starting the job again, `fit`
  restoring the weights and Adam's slots saved at epoch 0's end (the shared weights file) and running epochs 1-3:
  every variable, the optimizer's included, ends as in an uninterrupted fit."""
  import cluster_runs  # pylint: disable=g-import-not-at-top
  whole, crashed = tmp_path / "whole", tmp_path / "crashed"
  uninterrupted = cluster_runs.launch(2, "keras_fit.py", f"--backup={whole}", devices_per_worker=4, timeout=600)
  log = []
  restarted = cluster_runs.launch(2, "keras_fit.py", f"--backup={crashed}", "--crash_at_step=6",
                                  devices_per_worker=4, timeout=900, launcher=("--max_restarts=1", "--grace=10"),
                                  output=log)
  lines = [l for l in log[0].splitlines() if "fault drill" in l or "[launch]" in l or "Error" in l]
  assert len(uninterrupted[0]["losses"]) == 16
  assert "fault drill" in log[0], "\n".join(lines)
  # epochs 1-3 only: it went on from the backup of epoch 0
  assert len(restarted[0]["losses"]) == 12, "\n".join(lines)
  np.testing.assert_allclose(restarted[0]["losses"], uninterrupted[0]["losses"][4:], rtol=1e-6)
  want, got = np.load(whole / "final.npz"), np.load(crashed / "final.npz")
  assert sorted(got.files) == sorted(want.files) and any("adam" in k or "momentum" in k for k in want.files)
  for k in want.files:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
