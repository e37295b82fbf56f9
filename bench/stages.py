"""Plan a transformer's pipeline stages, submeshes and intra-operator plans without devices (gs.plan_stages).

  python bench/stages.py --blocks 64 --layers 64 --mesh 32,8 --microbatches 64

prints the plan table and the wall time of the planning (the figure of docs/parallelism.md "Automatic stages").
"""

import argparse
import dataclasses
import os
import sys
import time

import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import transformer_model as tm  # noqa: E402  pylint: disable=g-import-not-at-top

import tf_gspmd as gs  # noqa: E402  pylint: disable=g-import-not-at-top
from tf_gspmd.rewriter.stages import calibrate  # noqa: E402  pylint: disable=g-import-not-at-top


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--blocks", type=int, default=64)
  p.add_argument("--layers", type=int, default=64)
  p.add_argument("--mesh", default="32,8")
  p.add_argument("--microbatches", type=int, default=64)
  p.add_argument("--d_model", type=int, default=1024)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--d_ff", type=int, default=4096)
  p.add_argument("--vocab", type=int, default=32768)
  p.add_argument("--seq", type=int, default=512)
  p.add_argument("--batch", type=int, default=16, help="sequences per microbatch")
  p.add_argument("--memory_budget", default=None)
  p.add_argument("--calibrated", action="store_true",
                 help="time this machine (else the documented defaults, with every device of the mesh computing at "
                      "once, as the devices of a real cluster do: the defaults' logical CPUs share 2 cores)")
  a = p.parse_args()
  cfg = tm.Config(layers=a.blocks, d_model=a.d_model, heads=a.heads, d_ff=a.d_ff, vocab=a.vocab, seq=a.seq,
                  batch=a.batch)
  specs = ({k: tf.TensorSpec(s, tf.float32) for k, s in tm.param_shapes(cfg).items()},
           tf.TensorSpec((cfg.batch, cfg.seq), tf.int32), tf.TensorSpec((cfg.batch, cfg.seq), tf.int32))

  def loss(params, tokens, targets):
    return tm.loss_fn(params, tokens, targets, cfg)

  shape = tuple(int(x) for x in a.mesh.split(","))
  mesh = gs.Mesh(shape, ("host", "device")[-len(shape):])
  start = time.perf_counter()
  plan = gs.plan_stages(loss, *specs, mesh=mesh, layers=a.layers, microbatches=a.microbatches,
                        memory_budget=a.memory_budget,
                        calibration=None if a.calibrated else dataclasses.replace(
                            calibrate.DEFAULT, parallel_devices=float("inf")))
  took = time.perf_counter() - start
  print(plan)
  print(f"planned {a.blocks} blocks as {a.layers} layers on {mesh.size} devices {shape} in {took:.1f} s")


if __name__ == "__main__":
  main()
