"""Keras `fit` / `evaluate` under `keras.distribution.ModelParallel` on mesh (2, 4), run by every process of a
cluster (or by one process). Prints one JSON line: per-step losses, the evaluation and a digest of the weights.

With `--backup=DIR` the fit runs 4 epochs under Keras's own `BackupAndRestore(DIR)` (its state saved at every
epoch's end, restored when `fit` starts again) and the last process writes the final weights to DIR/final.npz;
`--crash_at_step=K` is a fault drill: the cluster's last process kills itself (SIGKILL) as global step K starts, in
the job's first start only (`python -m tf_gspmd.launch --max_restarts=1` starts the job again).
"""

import json
import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))


def fit(keras, backup=None, crash_at_step=None):
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  import transformer_model as tm  # pylint: disable=g-import-not-at-top
  cfg = tm.Config(layers=1, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=8)
  xs, ys = zip(*[tm.synthetic_batch(cfg, seed=i) for i in range(4)])
  x, y = np.concatenate(xs), np.concatenate(ys)
  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*(query|key|value)/kernel"] = (None, "model", None)
  layout_map[".*attention_output/kernel"] = ("model", None, None)
  layout_map[".*_up/kernel"] = (None, "model")
  layout_map[".*_down/kernel"] = ("model", None)
  layout_map["head/kernel"] = (None, "model")
  losses = []

  steps_per_epoch = len(x) // cfg.batch

  class Record(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
      step = self.params_epoch * steps_per_epoch + batch
      if step == crash_at_step and os.environ.get("TF_GSPMD_RESTART", "0") == "0" and \
          gs.process_index() == gs.process_count() - 1:
        print(f"fault drill: process {gs.process_index()} kills itself as step {step} starts", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_begin(self, epoch, logs=None):
      self.params_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
      losses.append(float(logs["loss"]))

  callbacks = [Record()]
  if backup:
    # (made before fit: each process's BackupAndRestore creates a missing directory at its first save, and of two
    # processes creating it at once one fails with FileExistsError)
    os.makedirs(backup, exist_ok=True)
    callbacks.insert(0, keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False))

  # Every process feeds the same global batches (tf_gspmd keeps each process's slices): no dataset sharding.
  with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch",
                                        auto_shard_dataset=False).scope():
    keras.utils.set_random_seed(0)
    model = tm.keras_model(cfg)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=cfg.batch, epochs=4 if backup else 2, shuffle=False, verbose=0, callbacks=callbacks)
    evaluation = model.evaluate(x, y, batch_size=cfg.batch, verbose=0)
    weights = [float(np.abs(w).sum()) for w in model.get_weights()]
    if backup and gs.process_index() == gs.process_count() - 1:
      state = {v.path: np.asarray(v) for v in model.weights + model.optimizer.variables}
      np.savez(os.path.join(backup, "final.npz"), **state)
  return {"losses": losses, "evaluate": float(evaluation), "weights": weights}


def main():
  import keras  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  import tf_gspmd.keras  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  keras.distribution.initialize()   # the cluster of TF_CONFIG (python -m tf_gspmd.launch sets it)
  options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
  out = fit(keras, backup=options.get("backup"),
            crash_at_step=int(options["crash_at_step"]) if "crash_at_step" in options else None)
  out.update(process=gs.process_index(), processes=gs.process_count())
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  sys.exit(main())
