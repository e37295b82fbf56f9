"""gs.plan_scope() with gs.variable and Keras distributions: shape-only, layouts kept for the plan, running refused
with a typed error naming the variable."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
import tf_gspmd.keras  # noqa: F401  pylint: disable=unused-import
from tf_gspmd import P
from tf_gspmd._layout.plan_scope import is_shape_only

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MESH = gs.Mesh((2, 4), ("data", "model"))

# A 256 GiB float32 variable in a process whose address space is capped at 8 GiB: computing any shard of it (32 GiB)
# fails there, where the machine would otherwise run out of memory.
_HUGE = textwrap.dedent("""
    import json, resource, time
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    import tensorflow as tf
    import tf_gspmd as gs
    from tf_gspmd import P
    gs.split_cpu_devices(8)
    mesh = gs.Mesh((2, 4), ("data", "model"))
    start = time.monotonic()
    with gs.plan_scope():
      v = gs.variable("glorot_uniform", (2 ** 20, 2 ** 16), mesh=mesh, spec=P("data", "model"), name="huge")
    seconds = time.monotonic() - start
    low = gs.function(lambda: tf.reduce_sum(v), mesh=mesh).lower()   # the variable's layout is the plan's
    out = {"seconds": seconds, "shape_only": gs._layout.plan_scope.is_shape_only(v), "shape": v.shape.as_list(),
           "spec": repr(gs.sharding_of(v).spec), "state": [r.bytes_per_device for r in low.report.state],
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
      v.numpy()
    except gs.InputError as e:
      out["read"] = str(e)
    print("RESULT " + json.dumps(out))
""")


def test_a_huge_gs_variable_in_plan_scope_is_shape_only():
  """gs.variable inside gs.plan_scope() computes nothing: a (2**20, 2**16) float32 variable (256 GiB) is created at
  once in a process that cannot hold one shard of it; its layout is what a plan lowers it in."""
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
  out = subprocess.run([sys.executable, "-c", _HUGE], capture_output=True, text=True, timeout=600, env=env,
                       check=False)
  assert out.returncode == 0 and "RESULT " in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
  r = json.loads(out.stdout.split("RESULT ", 1)[1])
  assert r["seconds"] < 5, r
  assert r["shape_only"] and r["shape"] == [2 ** 20, 2 ** 16] and r["spec"] == "P('data', 'model')", r
  assert r["state"] == [2 ** 36 * 4 // 8], r   # one (2^19, 2^14) float32 tile per device
  assert r["peak_rss"] < 4 << 30, r
  assert "'huge:0'" in r["read"] and "plan_scope" in r["read"], r


class _Refuses(gs.initializers.Initializer):
  """An initializer that fails the test if any value of it is computed."""

  def block(self, shape, starts, lengths, dtype):
    raise AssertionError(f"gs.variable computed a block {lengths} inside gs.plan_scope()")


def test_gs_variable_in_plan_scope_computes_no_value_and_refuses_to_run():
  with gs.plan_scope():
    v = gs.variable(_Refuses(), (64, 32), mesh=MESH, spec=P(None, "model"), name="w")
  assert is_shape_only(v) and v.shape == (64, 32) and v.dtype == tf.float32
  assert gs.sharding_of(v) == gs.Sharding.from_spec(MESH, P(None, "model"))
  f = gs.function(lambda x: x @ v, mesh=MESH, in_shardings=(P("data", None),))
  low = f.lower(tf.TensorSpec((8, 64), tf.float32))
  assert low.shardings[low.program.variable_names[0]] == gs.Sharding.from_spec(MESH, P(None, "model"))
  with pytest.raises(gs.InputError, match=r"'w:0'.*plan_scope"):
    f(np.zeros((8, 64), np.float32))
  with pytest.raises(gs.InputError, match=r"'w:0'.*plan_scope"):
    v.numpy()


def _model_parallel():
  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*up/kernel"] = (None, "model")
  layout_map[".*down/kernel"] = ("model", None)
  return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _dense_pair():
  model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="up"), keras.layers.Dense(4, name="down")])
  model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
  return model


@pytest.mark.parametrize("built_under", ["plan_scope", "plan_scope_and_distribution"])
def test_keras_fit_of_a_model_built_in_plan_scope_is_an_input_error_naming_the_variable(built_under):
  """Keras fit under ModelParallel of a model built in gs.plan_scope() (with or without the distribution):
  InputError naming the variable and gs.plan_scope, not an IndexError."""
  dist = _model_parallel()
  with gs.plan_scope():
    if built_under == "plan_scope":
      model = _dense_pair()
    else:
      with dist.scope():
        model = _dense_pair()
      assert gs.sharding_of(model.get_layer("up").kernel).spec == P(None, "model")   # the layout map's, recorded
  assert is_shape_only(model.get_layer("up").kernel)
  x, y = np.zeros((8, 16), np.float32), np.zeros((8, 4), np.float32)
  with dist.scope():
    with pytest.raises(gs.InputError, match=r"variable '[^']*kernel:0' was created inside gs\.plan_scope\(\).*"
                                            r"create the model outside the scope"):
      model.fit(x, y, batch_size=8, epochs=1, verbose=0)



def test_a_keras_kernel_over_the_whole_init_limit_builds_shape_only_in_plan_scope():
  """A kernel larger than gs.keras.WHOLE_INIT_MAX_BYTES (created shard by shard outside the scope) built in
  gs.plan_scope() under ModelParallel is shape-only with the layout map's layout: nothing is initialized (Keras's
  seeded initializer would read a shape-only seed)."""
  mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*big/kernel"] = (None, "model")
  with gs.plan_scope(), keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
    model = keras.Sequential([keras.Input((8192,)), keras.layers.Dense(16384, name="big")])
  kernel = model.get_layer("big").kernel
  assert kernel.shape == (8192, 16384) and 8192 * 16384 * 4 > gs.keras.WHOLE_INIT_MAX_BYTES
  assert is_shape_only(kernel) and gs.sharding_of(kernel).spec == P(None, "model")
