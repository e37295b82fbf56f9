"""Keras weight files under `keras.distribution.ModelParallel` on mesh (2, 4), the same calls in every process (or
one process).

  --save PATH     trains a step, `model.save_weights(PATH)`; prints the weights and the save's memory growth
  --load PATH     builds the model (another layout with --other_layout), `model.load_weights(PATH)`; prints them
  --own_path      each process saves to a path of its own (refused: one file needs one path)
  --archive       first tries `model.save` to a .keras archive (refused with variables split over processes)

The kernels are split over both mesh axes, so over 2 processes each holds half of every kernel (and of its Adam
moments); the biases are replicated.
"""

import argparse
import json
import os
import sys

import numpy as np

D_IN, D_HID, D_OUT = 16, 64, 16


def build(keras, other_layout=False, distributed=True):
  """The model and its distribution (None and plain Keras when not `distributed`)."""
  if not distributed:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((D_IN,)), keras.layers.Dense(D_HID, name="up"),
                              keras.layers.Dense(D_OUT, name="down")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model, None
  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*up/kernel"] = ("model", "batch") if other_layout else ("batch", "model")
  layout_map[".*down/kernel"] = ("batch", "model") if other_layout else ("model", "batch")
  dist = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch", auto_shard_dataset=False)
  with dist.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((D_IN,)), keras.layers.Dense(D_HID, name="up"),
                              keras.layers.Dense(D_OUT, name="down")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)
  return model, dist


def values(model):
  """Every weight and optimizer variable, as lists (float32 values are exact as JSON floats)."""
  return [np.asarray(v.numpy()).tolist() for v in model.weights + model.optimizer.variables]


def mark():
  open("/proc/self/clear_refs", "w").write("5")
  return int(open("/proc/self/statm").read().split()[1]) * 4096


def peak_growth(start):
  for line in open("/proc/self/status"):
    if line.startswith("VmHWM"):
      return int(line.split()[1]) * 1024 - start
  return None


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--save", default=None)
  parser.add_argument("--load", default=None)
  parser.add_argument("--other_layout", action="store_true")
  parser.add_argument("--own_path", action="store_true")
  parser.add_argument("--archive", action="store_true")
  args = parser.parse_args()
  import keras  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  import tf_gspmd.keras  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  keras.distribution.initialize()   # the cluster of TF_CONFIG (python -m tf_gspmd.launch sets it)
  model, dist = build(keras, args.other_layout)
  out = {"process": gs.process_index(), "processes": gs.process_count()}
  if args.save:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, D_IN)).astype(np.float32)
    y = rng.standard_normal((8, D_OUT)).astype(np.float32)
    with dist.scope():
      model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    if args.archive:
      try:
        model.save(args.save.replace(".weights.h5", f"_{gs.process_index()}.keras"))
      except gs.InputError as e:
        out["archive_error"] = str(e)
    path = args.save.replace(".weights.h5", f"_{gs.process_index()}.weights.h5") if args.own_path else args.save
    start = mark()
    try:
      model.save_weights(path)
    except gs.InputError as e:
      out["error"] = str(e)
    out["growth"] = peak_growth(start)
  else:
    model.load_weights(args.load)
  out["values"] = values(model)
  out["up_spec"] = str(gs.sharding_of(model.get_layer("up").kernel).spec)
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  sys.exit(main())
