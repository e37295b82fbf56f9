"""Checkpoints of sharded variables through tf.train.Checkpoint: global tensors, any mesh, atomic saves."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))
MESH8 = gs.Mesh((8,), ("x",))
ROOT = os.path.join(os.path.dirname(__file__), "..")


def _trained_on_2x4(rng):
  """Variables (one with uneven dims) updated by a gs.function on (2,4), so the shards are newer than the host."""
  w = tf.Variable(rng.standard_normal((10, 6)).astype(np.float32), name="w")
  b = tf.Variable(rng.standard_normal((6,)).astype(np.float32), name="b")
  step_count = tf.Variable(0, dtype=tf.int64, name="step")

  @gs.function(mesh=MESH)
  def step():
    wv = gs.shard(w, P("model", "data"))
    w.assign(wv * 2.0 + 1.0)
    b.assign_add(tf.ones([6]))
    step_count.assign_add(1)
    return tf.reduce_sum(wv)

  step()
  step()
  return w, b, step_count


def test_save_on_2x4_restore_on_8_on_one_device_and_with_plain_tf(rng, tmp_path):
  w, b, n = _trained_on_2x4(rng)
  assert gs.sharding_of(w).spec == P("model", "data")
  want_w, want_b = w.numpy(), b.numpy()
  path = tf.train.Checkpoint(w=w, b=b, n=n).save(str(tmp_path / "ck"))
  # Plain TF reads the global tensors (saved as slices, one per distinct tile).
  reader = tf.train.load_checkpoint(path)
  assert reader.get_variable_to_shape_map()["w/.ATTRIBUTES/VARIABLE_VALUE"] == [10, 6]
  assert_close(reader.get_tensor("w/.ATTRIBUTES/VARIABLE_VALUE"), want_w, rtol=0, atol=0)
  assert_close(reader.get_tensor("b/.ATTRIBUTES/VARIABLE_VALUE"), want_b, rtol=0, atol=0)
  assert reader.get_tensor("n/.ATTRIBUTES/VARIABLE_VALUE") == 2

  # Restore onto variables already stored sharded on another mesh (8,) and layout.
  w8, b8, n8 = tf.Variable(tf.zeros([10, 6])), tf.Variable(tf.zeros([6])), tf.Variable(0, dtype=tf.int64)
  read8 = gs.function(lambda: (gs.shard(w8, P("x", None)) + 0.0, gs.shard(b8, P("x")) + 0.0, n8 + 0), mesh=MESH8)
  read8()
  assert gs.sharding_of(w8).spec == P("x", None)
  tf.train.Checkpoint(w=w8, b=b8, n=n8).restore(path).assert_consumed()
  got = read8()
  assert_close(got[0].numpy(), want_w, rtol=0, atol=0)
  assert_close(got[1].numpy(), want_b, rtol=0, atol=0)
  assert int(got[2].numpy()) == 2
  assert_close(w8.numpy(), want_w, rtol=0, atol=0)

  # Restore onto ordinary variables (one device).
  w1, b1, n1 = tf.Variable(tf.zeros([10, 6])), tf.Variable(tf.zeros([6])), tf.Variable(0, dtype=tf.int64)
  tf.train.Checkpoint(w=w1, b=b1, n=n1).restore(path).assert_consumed()
  assert_close(w1.numpy(), want_w, rtol=0, atol=0)
  assert_close(b1.numpy(), want_b, rtol=0, atol=0)

  # And back: an unsharded checkpoint restores onto sharded storage.
  w1.assign(w1 * 3.0)
  path1 = tf.train.Checkpoint(w=w1).save(str(tmp_path / "plain"))
  tf.train.Checkpoint(w=w8).restore(path1).assert_consumed()
  assert_close(read8()[0].numpy(), want_w * 3.0, rtol=0, atol=0)


def test_checkpoint_manager_keeps_training_state_of_a_keras_optimizer(rng, tmp_path):
  keras = pytest.importorskip("keras")
  kernel0 = rng.standard_normal((8, 16)).astype(np.float32)
  x = rng.standard_normal((4, 8)).astype(np.float32)

  def make():
    w = keras.Variable(kernel0, name="kernel")
    opt = keras.optimizers.Adam(0.05)
    opt.build([w])

    def step(xb):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.tanh(xb @ gs.shard(w, P(None, "model")))))
      opt.apply(tape.gradient(loss, [w]), [w])
      return loss
    return w, opt, step

  w, opt, step = make()
  f = gs.function(step, mesh=MESH, in_shardings=(P("data", None),))
  manager = tf.train.CheckpointManager(tf.train.Checkpoint(w=w, opt=opt), str(tmp_path), max_to_keep=2)
  for _ in range(3):
    f(x)
  manager.save()
  after = [float(f(x).numpy()) for _ in range(3)]

  # A fresh model and optimizer on another mesh continue from the checkpoint with the same losses.
  w2, opt2, step2 = make()
  g = gs.function(step2, mesh=gs.Mesh((8,), ("model",)), in_shardings=(P(),))
  g(x)   # storage created (and one step taken) before the restore overwrites it
  tf.train.Checkpoint(w=w2, opt=opt2).restore(manager.latest_checkpoint).assert_consumed()
  assert int(opt2.iterations.numpy()) == 3
  again = [float(g(x).numpy()) for _ in range(3)]
  np.testing.assert_allclose(again, after, rtol=1e-5)


_SAVER = textwrap.dedent("""
    import os, sys
    import numpy as np, tensorflow as tf
    import tf_gspmd as gs
    gs.split_cpu_devices(8)
    mesh = gs.Mesh((2, 4), ("data", "model"))
    directory, marker = sys.argv[1], sys.argv[2]
    w = tf.Variable(tf.zeros([2048, 4096]))   # 32 MiB: a save takes long enough to be interrupted
    step = gs.function(lambda: w.assign_add(gs.shard(tf.ones_like(w), gs.P("data", "model"))), mesh=mesh)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(w=w), directory, max_to_keep=3)
    for k in range(1000):
      step()
      if k == 1:
        open(marker, "w").close()   # one checkpoint (w == 1) is complete
      manager.save()
""")


def test_sigkill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
  directory, marker = tmp_path / "ckpts", tmp_path / "first_done"
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(directory), str(marker)], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 180
    while not marker.exists():
      assert proc.poll() is None and time.time() < deadline, "the saving process did not start"
      time.sleep(0.05)
    time.sleep(0.7)    # several saves later, most likely in the middle of one
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
  finally:
    if proc.poll() is None:
      proc.kill()
  latest = tf.train.latest_checkpoint(str(directory))
  assert latest is not None
  value = tf.train.load_checkpoint(latest).get_tensor("w/.ATTRIBUTES/VARIABLE_VALUE")
  assert value.shape == (2048, 4096)
  k = value[0, 0]
  assert k >= 1 and np.all(value == k)   # a whole, consistent checkpoint of some step
  restored = tf.Variable(tf.zeros([2048, 4096]))
  tf.train.Checkpoint(w=restored).restore(latest).assert_consumed()
  assert float(restored[5, 7].numpy()) == k
