"""One cell of the fault matrix (tests/faults/test_matrix.py), run by 2 processes: one process kills itself
(SIGKILL) at `--point`, the other must stop with ProcessLostError naming it.

Every process prints `LOST <error type> <time.time()> <message as JSON>` when an error stops it (exit status 3) or
`DONE` when it finishes; the one that dies first writes the time of its death to DIR/death. Where the cell trains
first, process 0 saves a complete checkpoint (DIR/good/ckpt, every process the same call) and the values it holds
(DIR/good.npz), which must restore equal after the fault.

Points (the victim is the last process unless said otherwise):
  before_join        before gs.initialize (the survivor waits for it to join)
  first_lowering     before the first step (the survivor lowers, then runs it)
  step               as the second step starts (the survivor is inside it); --exchange=collectives: TF's collectives
  checkpoint_save    a few ms into the fourth of repeated shared tf.train.Checkpoint saves
  checkpoint_merge   the same, the victim the chief (process 0, which merges the processes' parts)
  weights_save       a few ms into the fourth of repeated shared Keras weights-file saves (ModelParallel)
  reshard            before a cross-process gs.reshard the survivor waits in
  mpmd_sender        process 0 (the first stage, which sends activations) as the second MPMD pipeline step starts
  mpmd_receiver      process 1 (the later stages) as the second MPMD pipeline step starts
  auto_parallel      process 1 (the first and last stage of a gs.auto_parallel plan) as its second step starts
"""

import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

POINTS = ("before_join", "first_lowering", "step", "checkpoint_save", "checkpoint_merge", "weights_save", "reshard",
          "mpmd_sender", "mpmd_receiver", "auto_parallel")
HEARTBEAT_S = 10.0   # the cluster declares a silent process lost after this (gs.initialize(heartbeat_timeout=...))


def _die(directory, point, delay=0.0):
  """SIGKILL this process, after `delay` seconds (from a thread: the caller goes on into the operation)."""
  def kill():
    time.sleep(delay)
    with open(os.path.join(directory, "death"), "w") as f:
      f.write(repr(time.time()))
    print(f"fault drill: this process kills itself at {point}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
  if delay:
    threading.Thread(target=kill, daemon=True).start()
  else:
    kill()


def _train(gs, tf, args, victim):
  """A Megatron MLP on mesh (2, 2): steps, a saved checkpoint, then the cell's fault."""
  P = gs.P
  k = gs.process_index()
  mesh = gs.Mesh((2, 2), ("data", "model"))   # 2 processes x 2 devices
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 16)).astype(np.float32)
  w1 = tf.Variable(rng.standard_normal((16, 32)).astype(np.float32) * 0.1, name="w1")
  w2 = tf.Variable(rng.standard_normal((32, 16)).astype(np.float32) * 0.1, name="w2")
  ckpt = tf.train.Checkpoint(w1=w1, w2=w2)

  @gs.function(mesh=mesh, in_shardings=P("data", None), exchange=args.exchange)
  def step(x):
    gs.shard(w1, P(None, "model"))
    gs.shard(w2, P("model", None))
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean((tf.nn.relu(x @ w1) @ w2) ** 2)
    g1, g2 = tape.gradient(loss, [w1, w2])
    w1.assign_sub(0.1 * g1)
    w2.assign_sub(0.1 * g2)
    return loss

  if victim and args.point == "first_lowering":
    _die(args.dir, args.point)
  step(x)
  ckpt.write(os.path.join(args.dir, "good", "ckpt"))
  if k == 0:
    np.savez(os.path.join(args.dir, "good.npz"), w1=w1.numpy(), w2=w2.numpy())
  if victim and args.point == "step":
    _die(args.dir, args.point)
  step(x)
  if args.point in ("checkpoint_save", "checkpoint_merge"):
    for i in range(500):
      if victim and i == 3:
        _die(args.dir, args.point, delay=0.003)
      ckpt.write(os.path.join(args.dir, "again", "ckpt"))
  if args.point == "reshard":
    other = gs.Mesh((4,), ("d",))
    value = gs.from_process_local_data(x[k * 4:(k + 1) * 4], mesh, P("data", None))
    value = gs.reshard(value, other, P("d"))
    if victim:
      _die(args.dir, args.point)
    for _ in range(100):
      value = gs.reshard(gs.reshard(value, mesh, P(None, "model")), other, P("d"))


def _keras_weights(args, victim):
  """Keras ModelParallel over both processes: fit a step, then shared weights-file saves, one cut short."""
  import keras  # pylint: disable=g-import-not-at-top
  import tf_gspmd.keras  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], keras.distribution.list_devices("cpu")[:4])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*up/kernel"] = (None, "model")
  layout_map[".*down/kernel"] = ("model", None)
  with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch",
                                        auto_shard_dataset=False).scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="up"),
                              keras.layers.Dense(16, name="down")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((8, 16)).astype(np.float32),
              batch_size=8, epochs=1, verbose=0)
  good = os.path.join(args.dir, "good.weights.h5")
  model.save_weights(good)
  if not victim:
    np.savez(os.path.join(args.dir, "good_keras.npz"), *[np.asarray(v) for v in model.weights])
  for i in range(500):
    if victim and i == 3:
      _die(args.dir, args.point, delay=0.003)
    model.save_weights(os.path.join(args.dir, "again.weights.h5"))


def _mpmd(gs, args, victim):
  """The 3-stage MPMD pipeline of mpmd_step.py (stage 0 on process 0, stages 1 and 2 on process 1)."""
  import mpmd_step  # pylint: disable=g-import-not-at-top
  worker = lambda t, i: f"/job:worker/replica:0/task:{t}/device:CPU:{i}"  # noqa: E731
  meshes = [gs.Mesh((2, 2), ("d", "m"), devices=[worker(0, i) for i in range(4)]),
            gs.Mesh((1, 2), ("d", "m"), devices=[worker(1, 0), worker(1, 1)]),
            gs.Mesh((2,), ("m",), devices=[worker(1, 2), worker(1, 3)])]
  params, ids, labels = mpmd_step.data()
  pipe = gs.mpmd_pipeline(mpmd_step.stages(gs, meshes), microbatches=4, schedule="1f1b")
  pipe(params, ids, labels)
  if victim:
    _die(args.dir, args.point)
  for _ in range(20):
    pipe(params, ids, labels)


def _auto_parallel(gs, args, victim):
  """The planned step of auto_parallel_step.py (process 1 runs the first and last stage, process 0 the middle)."""
  import auto_parallel_step  # pylint: disable=g-import-not-at-top
  step = auto_parallel_step.planned(gs)
  params, opt = step.place(auto_parallel_step.init()), step.adam(0.01)
  tokens, labels = auto_parallel_step.data()
  for i in range(20):
    if victim and i == 1:
      _die(args.dir, args.point)
    _, grads = step(params, tokens, labels)
    params = opt(params, grads)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--point", choices=POINTS, required=True)
  parser.add_argument("--dir", required=True)
  parser.add_argument("--exchange", default="auto")
  args = parser.parse_args()
  config = json.loads(os.environ["TF_CONFIG"])
  index, workers = config["task"]["index"], len(config["cluster"]["worker"])
  victim = index == (0 if args.point in ("checkpoint_merge", "mpmd_sender") else workers - 1)
  if victim and args.point == "before_join":
    _die(args.dir, args.point)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  try:
    gs.initialize(heartbeat_timeout=HEARTBEAT_S)
    if args.point == "weights_save":
      _keras_weights(args, victim)
    elif args.point.startswith("mpmd"):
      _mpmd(gs, args, victim)
    elif args.point == "auto_parallel":
      _auto_parallel(gs, args, victim)
    else:
      _train(gs, tf, args, victim)
  except Exception as e:  # pylint: disable=broad-except
    print(f"LOST {type(e).__name__} {time.time()!r} {json.dumps(str(e)[:800])}", flush=True)
    return 3
  print("DONE", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
