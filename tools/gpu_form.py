"""The GPU form of every reference program, checked on this machine (no GPU needed).

  python tools/gpu_form.py [--programs=mlp_megatron,transformer_megatron] [--skip_binaries] [--skip_keras_hub]

For each program -- the oracle's programs (tools/oracle_programs.py: the ten reference workloads and the others),
the three training binaries' steps (each binary run with --gpu_form) and a keras-hub model's train step (a causal
LM built from its constructor, under keras.distribution.ModelParallel with its own layout map) -- gs.gpu_form lowers
the program for a mesh of GPUs of the same shape and hands every XLA cluster to tf2xla here (see
tf_gspmd/_gpu_form.py for what is checked). One line per program states its clusters, the compute ops left outside
XLA, the collectives inside and outside XLA and the largest cluster's share of the arithmetic; the last line says
how many programs were checked and how many passed. Exits non-zero when any check fails.
"""

import os
import re
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

flags.DEFINE_list("programs", [], "Check only these programs (names as printed).")
flags.DEFINE_bool("skip_binaries", False, "Leave out the three training binaries' steps.")
flags.DEFINE_bool("skip_keras_hub", False, "Leave out the keras-hub model's train step.")
FLAGS = flags.FLAGS

BINARIES = ("train_transformer", "train_convnet", "train_moe")
_SUMMARY = re.compile(r"GPU form for mesh \{[^}]*\}: (.*)$", re.M)


def _oracle_programs():
  """(name, check) per oracle program: check() returns the GpuForm's summary."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  import oracle_programs  # pylint: disable=g-import-not-at-top

  def check(build):
    job = build()
    f = gs.function(job.fn, mesh=job.mesh, in_shardings=job.in_specs, out_shardings=job.out_specs)
    specs = [tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in job.args]
    return gs.gpu_form(f, *specs).summary()

  return [(name, lambda build=build: check(build)) for name, build in oracle_programs.PROGRAMS.items()]


def _binary(name):
  def check():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", f"{name}.py"), "--gpu_form"],
                         capture_output=True, text=True, timeout=600, check=False)
    found = _SUMMARY.search(out.stdout)
    if out.returncode or not found:
      lines = (out.stderr or out.stdout).strip().splitlines()
      raise RuntimeError(lines[-1] if lines else f"exit status {out.returncode}")
    return found.group(1)
  return check


def keras_hub_step():
  """A keras-hub causal LM's train step as tf_gspmd partitions it under ModelParallel: (gs.function, arguments)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  import keras_hub  # pylint: disable=g-import-not-at-top
  import tf_gspmd.keras  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  vocab, seq = 96, 12
  devices = keras.distribution.list_devices()[:8]
  mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices)
  layouts = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
  with keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch").scope():
    keras.utils.set_random_seed(3)
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=vocab, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=4, hidden_dim=40, intermediate_dim=56,
                                              head_dim=12)
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, (8, seq + 1)).astype(np.int32)
    data = ({"token_ids": tokens[:, :-1], "padding_mask": np.ones((8, seq), bool)}, tokens[:, 1:])
    step = model.make_train_function()
    return step._function(data)  # pylint: disable=protected-access


def _keras_hub():
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  f, args = keras_hub_step()
  return gs.gpu_form(f, *args).summary()


def programs():
  out = _oracle_programs()
  if not FLAGS.skip_binaries:
    out += [(name, _binary(name)) for name in BINARIES]
  if not FLAGS.skip_keras_hub:
    out.append(("keras_hub_gemma_train_step", _keras_hub))
  return [(n, c) for n, c in out if not FLAGS.programs or n in FLAGS.programs]


def main(_):
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  gs.split_cpu_devices(8)
  failed = []
  chosen = programs()
  for name, check in chosen:
    start = time.perf_counter()
    try:
      summary = check()
    except Exception as e:  # pylint: disable=broad-except
      failed.append(name)
      summary = f"FAILED: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    print(f"{name:28s} {summary}  ({time.perf_counter() - start:.1f} s)", flush=True)
  print(f"gpu form: {len(chosen)} programs checked, {len(chosen) - len(failed)} pass"
        + (f"; failed: {', '.join(failed)}" if failed else ""))
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
