"""Checkpoints of sharded variables through tf.train.Checkpoint: global tensors, any mesh, atomic saves."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close, sigkill_when
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
    # several saves after the first, most likely in the middle of one
    sigkill_when([proc], 0, marker.exists, 180, lambda: "the saving process did not start", settle=0.7)
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


def _stored(v, mesh, spec):
  """`v`, stored sharded as `spec` on `mesh` (by a gs.function that uses it so)."""
  gs.function(lambda: gs.shard(v, spec) + 0.0, mesh=mesh)()
  assert gs.sharding_of(v).is_replicated if spec == P() else gs.sharding_of(v).spec == spec
  return v


def test_restore_onto_another_mesh_and_layout_reads_tile_by_tile(rng, tmp_path):
  """Each device's tile is read with its own slice spec (never the whole value), from a checkpoint sliced another
  way; values equal the saved ones on every device, with uneven tiles and replicated copies."""
  from tf_gspmd.runtime import state  # pylint: disable=g-import-not-at-top
  value = rng.standard_normal((13, 10)).astype(np.float32)
  w = tf.Variable(value, name="w")
  gs.function(lambda: gs.shard(w, P("x", None)) + 0.0, mesh=MESH8)()
  path = tf.train.Checkpoint(w=w).write(str(tmp_path / "ck"))
  for mesh, spec in ((MESH, P("model", "data")), (MESH, P(None, "model")), (MESH8, P(None, "x")), (MESH, P())):
    target = _stored(tf.Variable(tf.zeros([13, 10])), mesh, spec)
    reads = []
    real = tf.raw_ops.RestoreV2

    def spy(**kw):
      reads.append(kw["shape_and_slices"][0])
      return real(**kw)
    tf.raw_ops.RestoreV2 = spy
    try:
      tf.train.Checkpoint(w=target).read(path).assert_consumed()
    finally:
      tf.raw_ops.RestoreV2 = real
    storage = state.storage_of(target)
    if spec == P():
      assert reads == [""]
    else:   # one read per distinct non-empty tile, each its own slice
      assert sorted(reads) == sorted(s for s in storage.slice_specs()), (spec, reads)
    for shard in gs.shards_of(target):
      np.testing.assert_array_equal(shard.numpy(), value[shard.index])
    np.testing.assert_array_equal(target.numpy(), value)


def test_restore_into_a_variable_of_another_shape_is_an_input_error(tmp_path):
  w = tf.Variable(tf.ones([8, 4]), name="w")
  path = tf.train.Checkpoint(w=w).write(str(tmp_path / "ck"))
  wrong = gs.variable(0.0, (16, 4), mesh=MESH8, spec=P("x", None), name="wrong")
  with pytest.raises((gs.InputError, tf.errors.InvalidArgumentError), match=r"w/\.ATTRIBUTES|shape"):
    tf.train.Checkpoint(w=wrong).read(path)


def test_keras_model_parallel_checkpoint_holds_slices_and_restores_on_another_layout(rng, tmp_path):
  """Keras variables and their optimizer slots are saved slice by slice; a fresh model laid out otherwise, and
  plain TF, read the same values."""
  keras = pytest.importorskip("keras")
  import tf_gspmd.keras  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  from tf_gspmd.runtime import state  # pylint: disable=g-import-not-at-top
  x = rng.standard_normal((8, 24)).astype(np.float32)
  y = rng.standard_normal((8, 20)).astype(np.float32)

  model, dist = _keras_dense_pair((2, 4), (None, "model"), ("model", None))
  with dist.scope():
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
  ckpt = tf.train.Checkpoint(model=model, opt=model.optimizer)
  path = ckpt.write(str(tmp_path / "ck"))
  kernel = model.get_layer("up").kernel
  assert state.storage_of(kernel) is not None
  want = [v.numpy() for v in model.weights + model.optimizer.variables]
  # Plain TF reads the global values (kernels, and Adam's moments of the kernels, were saved as slices).
  shapes = tf.train.load_checkpoint(path).get_variable_to_shape_map()
  assert sorted(tuple(v) for v in shapes.values()).count((24, 40)) == 3, shapes   # kernel, two moments
  key = next(k for k, v in shapes.items() if v == [24, 40] and "trainable" in k)   # the kernel itself
  np.testing.assert_array_equal(tf.train.load_variable(path, key), kernel.numpy())

  fresh, dist2 = _keras_dense_pair((1, 8), ("model", None), (None, "model"))
  assert gs.sharding_of(fresh.get_layer("up").kernel).spec == P("model", None)
  tf.train.Checkpoint(model=fresh, opt=fresh.optimizer).read(path).assert_consumed()
  got = [v.numpy() for v in fresh.weights + fresh.optimizer.variables]
  assert len(got) == len(want)
  for k, (a, b) in enumerate(zip(got, want)):
    np.testing.assert_array_equal(a, b, err_msg=str(k))
  for shard in gs.shards_of(fresh.get_layer("up").kernel):
    np.testing.assert_array_equal(shard.numpy(), kernel.numpy()[shard.index])
  with dist2.scope():   # and training continues from the restored state as it would have from the saved one
    fresh.fit(x, y, batch_size=8, epochs=1, verbose=0)
  with dist.scope():
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  np.testing.assert_allclose(fresh.get_layer("up").kernel.numpy(), model.get_layer("up").kernel.numpy(), rtol=1e-4,
                             atol=1e-5)


def _keras_dense_pair(mesh_shape, up, down=None):
  """(model, distribution): Dense(40, "up") -> Dense(20, "down") on 24 features under Keras's ModelParallel on
  the first 8 CPUs as (batch, model) of `mesh_shape`, the kernels laid out as `up` / `down` (None: not named),
  compiled with Adam(0.01) and mse, its optimizer built; seeded alike on every call."""
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(1)
  mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*up/kernel"] = up
  if down is not None:
    layout_map[".*down/kernel"] = down
  dist = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
  with dist.scope():
    model = keras.Sequential([keras.Input((24,)), keras.layers.Dense(40, name="up"),
                              keras.layers.Dense(20, name="down")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)
  return model, dist


def test_asynchronous_save_of_a_keras_model_parallel_model_writes_slices_while_it_trains(rng, tmp_path):
  """A Keras ModelParallel model saved with experimental_enable_async_checkpoint: the host copy is this process's
  tiles (no whole kernel), training steps run while the write is pending, the next save waits for the previous
  one, and each checkpoint holds its save's values (read by plain TF and restored onto another layout)."""
  keras = pytest.importorskip("keras")
  import tf_gspmd.keras  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  from tf_gspmd.runtime import checkpoint, state  # pylint: disable=g-import-not-at-top
  x = rng.standard_normal((8, 24)).astype(np.float32)
  y = rng.standard_normal((8, 20)).astype(np.float32)

  model, dist = _keras_dense_pair((2, 4), (None, "model"))
  kernel = model.get_layer("up").kernel
  assert state.storage_of(kernel) is not None
  options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
  ckpt = tf.train.Checkpoint(model=model, opt=model.optimizer)
  with dist.scope():
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    first_values = [v.numpy().copy() for v in model.weights + model.optimizer.variables]
    first = ckpt.write(str(tmp_path / "first"), options=options)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)   # steps while the first write may be pending
    second_values = [v.numpy().copy() for v in model.weights + model.optimizer.variables]
    second = ckpt.write(str(tmp_path / "second"), options=options)   # waits for the first write
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  copies = ckpt._async_checkpointer()._object_map   # pylint: disable=protected-access
  snapshot = copies[kernel]
  assert isinstance(snapshot, checkpoint.HostSnapshot)
  tiles = snapshot._serialize_to_tensors()["VARIABLE_VALUE"]   # pylint: disable=protected-access
  assert len(tiles) == 4 and all(t.shape == (24, 10) for t in tiles.values()), {k: t.shape for k, t in tiles.items()}
  ckpt.sync()
  assert not np.array_equal(first_values[0], second_values[0])
  key = next(k for k, v in tf.train.load_checkpoint(first).get_variable_to_shape_map().items()
             if v == [24, 40] and "trainable" in k)
  for path, values in ((first, first_values), (second, second_values)):
    np.testing.assert_array_equal(tf.train.load_variable(path, key), values[0])
    fresh, _ = _keras_dense_pair((2, 4), ("model", None))
    tf.train.Checkpoint(model=fresh, opt=fresh.optimizer).read(path).assert_existing_objects_matched()
    got = [v.numpy() for v in fresh.weights + fresh.optimizer.variables]
    assert len(got) == len(values)
    for k, (a, b) in enumerate(zip(got, values)):
      np.testing.assert_array_equal(a, b, err_msg=str(k))


_MEMORY = textwrap.dedent("""
    import json, sys
    import numpy as np, tensorflow as tf
    import tf_gspmd as gs
    gs.split_cpu_devices(8)

    def rss():
      return int(open("/proc/self/statm").read().split()[1]) * 4096

    def peak_since(start):
      for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
          return int(line.split()[1]) * 1024 - start

    def mark():
      open("/proc/self/clear_refs", "w").write("5")   # VmHWM restarts from the current resident size
      return rss()

    directory, kind = sys.argv[1], sys.argv[2]
    out = {}
    if kind == "variable":
      rows = 48 << 20 >> 12          # a 48 MiB float32 [rows, 1024] variable
      v = gs.variable("uniform", (rows, 1024), mesh=gs.Mesh((8,), ("d",)), spec=gs.P(None, "d"))
      start = mark(); path = tf.train.Checkpoint(v=v).write(directory + "/ck"); out["save"] = peak_since(start)
      u = gs.variable(0.0, (rows, 1024), mesh=gs.Mesh((2, 4), ("x", "y")), spec=gs.P("x", "y"))
      start = mark(); tf.train.Checkpoint(v=u).read(path).assert_consumed(); out["restore"] = peak_since(start)
      out["bytes"] = rows * 1024 * 4
      whole = tf.train.load_checkpoint(path).get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE")   # after measuring
      out["equal"] = (all(np.array_equal(s.numpy(), whole[s.index]) for s in gs.shards_of(u)) and
                      all(np.array_equal(s.numpy(), whole[s.index]) for s in gs.shards_of(v)))
    else:
      import keras
      import tf_gspmd.keras
      n = 2048                        # 16 MiB kernels, split over "model"
      mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices("cpu")[:8])
      layout_map = keras.distribution.LayoutMap(mesh)
      layout_map[".*up/kernel"] = (None, "model")
      layout_map[".*down/kernel"] = ("model", None)
      with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
        model = keras.Sequential([keras.Input((n,)), keras.layers.Dense(n, name="up"), keras.layers.Dense(n, name="down")])
      start = mark(); tf.train.Checkpoint(model=model).write(directory + "/ck"); out["save"] = peak_since(start)
      out["bytes"] = n * n * 4
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.parametrize("kind", ["variable", "keras"])
def test_save_and_restore_hold_at_most_a_fraction_of_a_split_variable(kind, tmp_path):
  """Resident memory (VmHWM) while saving a split variable, or a Keras ModelParallel model, and restoring the
  variable onto another mesh and layout: a tile or two at a time, never the whole value (fresh process)."""
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
  out = subprocess.run([sys.executable, "-c", _MEMORY, str(tmp_path), kind], capture_output=True, text=True,
                       timeout=600, env=env, check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  r = json.loads(out.stdout.split("RESULT ", 1)[1])
  assert r["save"] <= 0.25 * r["bytes"], r
  if kind == "variable":
    assert r["equal"]
    # A (2,4) tile is 1/8 of the value; TF's reader also holds the saved (8,) tile a read overlaps.
    assert r["restore"] <= 0.4 * r["bytes"], r


def test_asynchronous_save_copies_the_tiles_then_writes_while_steps_run(rng, tmp_path):
  """CheckpointOptions(experimental_enable_async_checkpoint=True): the save copies this process's tiles to the
  host and returns; steps that update the shards meanwhile do not reach the checkpoint being written; the next
  save waits for the previous one. Both checkpoints hold the values of their save's step."""
  value = rng.standard_normal((64, 48)).astype(np.float32)
  w = _stored(tf.Variable(value, name="w"), MESH, P("data", "model"))
  step = gs.function(lambda: w.assign(w * 0.5 + 1.0), mesh=MESH)
  step()
  options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
  ckpt = tf.train.Checkpoint(w=w)
  first_value = w.numpy().copy()
  first = ckpt.write(str(tmp_path / "first"), options=options)
  step()
  step()
  second_value = w.numpy().copy()
  second = ckpt.write(str(tmp_path / "second"), options=options)   # waits for the first write
  step()
  ckpt.sync()
  for path, want in ((first, first_value), (second, second_value)):
    np.testing.assert_array_equal(tf.train.load_checkpoint(path).get_tensor("w/.ATTRIBUTES/VARIABLE_VALUE"), want)
  restored = _stored(tf.Variable(tf.zeros([64, 48])), MESH8, P(None, "x"))
  tf.train.Checkpoint(w=restored).read(second).assert_existing_objects_matched()
  np.testing.assert_array_equal(restored.numpy(), second_value)


_ASYNC_OPTIONS = {"enable_async": dict(enable_async=True),
                  "experimental": dict(experimental_enable_async_checkpoint=True)}
_EAGER_WRITES = {
    "assign": lambda v: v.assign(np.full((8, 8), 7.0, np.float32)),
    "assign_add": lambda v: v.assign_add(np.full((8, 8), 2.0, np.float32)),
    "assign_sub": lambda v: v.assign_sub(np.arange(64, dtype=np.float32).reshape(8, 8)),
    "scatter_nd_update": lambda v: v.scatter_nd_update([[1, 2], [7, 7]], [5.0, 6.0]),
}


def _async_saves(v, directory, options, writes):
  """The value saved by each asynchronous save of `v`: one save, then one after each write of `writes`."""
  ckpt = tf.train.Checkpoint(v=v)
  paths = [ckpt.save(str(directory / "ck"), options=options)]
  for write in writes:
    ckpt.sync()
    write(v)
    paths.append(ckpt.save(str(directory / "ck"), options=options))
  ckpt.sync()
  return [tf.train.load_checkpoint(p).get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE") for p in paths]


@pytest.mark.parametrize("option", sorted(_ASYNC_OPTIONS))
@pytest.mark.parametrize("write", sorted(_EAGER_WRITES))
def test_asynchronous_save_after_an_eager_write_saves_the_written_value(write, option, rng, tmp_path):
  """An eager write between asynchronous saves reaches the next save, as plain TF saves it: TF traces its copy
  to the host once and reruns it for every later save, and a sharded variable's copy brings the write into the
  shards whenever it runs (not only while traced)."""
  value = rng.standard_normal((8, 8)).astype(np.float32)
  options = tf.train.CheckpointOptions(**_ASYNC_OPTIONS[option])
  writes = [_EAGER_WRITES[write], _EAGER_WRITES["assign_add"], _EAGER_WRITES[write]]
  want = _async_saves(tf.Variable(value), tmp_path / "plain", options, writes)
  v = _stored(tf.Variable(value), MESH, P("data", "model"))
  got = _async_saves(v, tmp_path / "sharded", options, writes)
  assert not np.array_equal(want[0], want[1])
  for k, (a, b) in enumerate(zip(got, want)):
    np.testing.assert_array_equal(a, b, err_msg=f"save {k}")
  np.testing.assert_array_equal(v.numpy(), want[-1])


def test_asynchronous_save_after_steps_and_a_new_layout_saves_the_current_value(rng, tmp_path):
  """Asynchronous saves between gs.function steps that write the variable, eager writes, and a step on another
  mesh that stores it in another layout: each save holds the value of that moment, as plain TF's saves do."""
  value = rng.standard_normal((8, 8)).astype(np.float32)
  options = tf.train.CheckpointOptions(enable_async=True)
  plain = tf.Variable(value)
  v = _stored(tf.Variable(value), MESH, P("data", "model"))
  step = gs.function(lambda: v.assign(gs.shard(v.read_value(), P("data", "model")) * 0.5 + 1.0), mesh=MESH)
  step8 = gs.function(lambda: v.assign(gs.shard(v.read_value(), P(None, "x")) - 3.0), mesh=MESH8)
  writes = [lambda x: step() if x is v else x.assign(x * 0.5 + 1.0),
            lambda x: x.assign_add(tf.ones([8, 8])),
            lambda x: step8() if x is v else x.assign(x - 3.0),
            lambda x: step8() if x is v else x.assign(x - 3.0)]
  want = _async_saves(plain, tmp_path / "plain", options, writes)
  got = _async_saves(v, tmp_path / "sharded", options, writes)
  assert gs.sharding_of(v).spec == P(None, "x")
  for k, (a, b) in enumerate(zip(got, want)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=f"save {k}")


@pytest.mark.parametrize("shape,spec", [((0, 6), P(None, "model")), ((0, 6), P("data", "model")),
                                        ((4, 0), P("model", None)), ((0,), P("model"))])
def test_a_zero_size_split_variable_saves_and_restores_as_plain_tf_does(shape, spec, tmp_path):
  """A variable with no elements stored split is saved whole (plain TF saves an empty tensor of its shape, which
  has no tiles to save) and restores onto plain, sharded and other-layout variables."""
  v = _stored(tf.Variable(np.zeros(shape, np.float32)), MESH, spec)
  path = tf.train.Checkpoint(v=v).write(str(tmp_path / "sharded"))
  want = tf.train.Checkpoint(v=tf.Variable(np.zeros(shape, np.float32))).write(str(tmp_path / "plain"))
  got_map, want_map = (tf.train.load_checkpoint(p).get_variable_to_shape_map() for p in (path, want))
  assert got_map["v/.ATTRIBUTES/VARIABLE_VALUE"] == want_map["v/.ATTRIBUTES/VARIABLE_VALUE"] == list(shape)
  assert tf.train.load_checkpoint(path).get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE").shape == shape
  restored = [tf.Variable(np.zeros(shape, np.float32)), _stored(tf.Variable(np.zeros(shape, np.float32)), MESH, spec),
              _stored(tf.Variable(np.zeros(shape, np.float32)), MESH8, P(*(["x"] + [None] * (len(shape) - 1))))]
  for u in restored:
    tf.train.Checkpoint(v=u).read(path).assert_consumed()
    assert u.numpy().shape == shape
  for p in (path, want):   # the sharded variable restores from either checkpoint
    tf.train.Checkpoint(v=v).read(p).assert_consumed()
    assert v.numpy().shape == shape
  options = tf.train.CheckpointOptions(enable_async=True)
  ckpt = tf.train.Checkpoint(v=v)
  later = ckpt.write(str(tmp_path / "async"), options=options)
  ckpt.sync()
  assert tf.train.load_checkpoint(later).get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE").shape == shape


def test_asynchronous_saves_of_a_variable_first_saved_plain_then_stored_sharded(rng, tmp_path):
  """The first asynchronous save copies a plain variable whole; a step then stores it sharded: the later saves
  copy its tiles (in place of the whole host copy) and hold each save's value, as plain TF's saves do."""
  value = rng.standard_normal((8, 8)).astype(np.float32)
  options = tf.train.CheckpointOptions(enable_async=True)
  plain, v = tf.Variable(value), tf.Variable(value)
  step = gs.function(lambda: v.assign(gs.shard(v.read_value(), P("data", "model")) + 10.0), mesh=MESH)
  writes = [lambda x: step() if x is v else x.assign_add(tf.fill([8, 8], 10.0)),
            lambda x: step() if x is v else x.assign_add(tf.fill([8, 8], 10.0))]
  want = _async_saves(plain, tmp_path / "plain", options, writes)
  got = _async_saves(v, tmp_path / "sharded", options, writes)
  assert gs.sharding_of(v).spec == P("data", "model")
  for k, (a, b) in enumerate(zip(got, want)):
    np.testing.assert_array_equal(a, b, err_msg=f"save {k}")


def test_asynchronous_saves_traced_while_plain_then_stored_sharded(rng, tmp_path):
  """Two asynchronous saves while the variable is plain (TF traces its copy to the host at the second), then
  steps store it sharded: every later save holds that moment's value (the copy is traced again once the variable's
  storage changed), never the plain buffer the first trace read."""
  value = rng.standard_normal((8, 8)).astype(np.float32)
  options = tf.train.CheckpointOptions(enable_async=True)
  plain, v = tf.Variable(value), tf.Variable(value)
  step = gs.function(lambda: v.assign(gs.shard(v.read_value(), P("data", "model")) + 10.0), mesh=MESH)
  writes = [lambda x: x.assign_add(tf.fill([8, 8], 1.0)),
            lambda x: step() if x is v else x.assign_add(tf.fill([8, 8], 10.0)),
            lambda x: step() if x is v else x.assign_add(tf.fill([8, 8], 10.0)),
            lambda x: x.assign_add(tf.fill([8, 8], 1.0))]
  want = _async_saves(plain, tmp_path / "plain", options, writes)
  got = _async_saves(v, tmp_path / "sharded", options, writes)
  assert gs.sharding_of(v).spec == P("data", "model")
  for k, (a, b) in enumerate(zip(got, want)):
    np.testing.assert_array_equal(a, b, err_msg=f"save {k}")
