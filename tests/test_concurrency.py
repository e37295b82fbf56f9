"""Concurrent callers: several Python threads calling different gs.functions on one mesh (a server), and a thread
assigning a variable while others step, through both exchanges. Results equal sequential calls, nothing deadlocks
(every collective has its timeout), and no step sees a variable written on some devices only."""

import threading

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P

MESH = gs.Mesh((2, 4), ("data", "model"))
CALLS = 1000
THREADS = 4


def _run_threads(targets):
  errors = []

  def guarded(fn):
    def run():
      try:
        fn()
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)
    return run

  threads = [threading.Thread(target=guarded(t), daemon=True) for t in targets]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=300)
  assert not any(t.is_alive() for t in threads), "a caller is stuck"
  assert not errors, errors


@pytest.mark.parametrize("exchange", ["auto", "collectives"])
def test_threads_calling_different_functions_get_the_sequential_results(rng, exchange):
  x = rng.standard_normal((8, 16)).astype(np.float32)
  w = rng.standard_normal((16, 8)).astype(np.float32)
  functions = [
      gs.function(lambda a, b: tf.nn.relu(a @ b), mesh=MESH, in_shardings=(P("data", None), P(None, "model")),
                  exchange=exchange, collective_timeout=60),
      gs.function(lambda a, b: tf.reduce_sum(a @ b, axis=0), mesh=MESH, in_shardings=(P("data", "model"),
                                                                                        P("model", None)),
                  exchange=exchange, collective_timeout=60),
      gs.function(lambda a, b: tf.transpose(a) @ (a @ b), mesh=MESH, in_shardings=(P("data", None), P()),
                  exchange=exchange, collective_timeout=60),
      gs.function(lambda a, b: tf.nn.softmax(a, axis=1)[:, :8] * b[:8], mesh=MESH,
                  in_shardings=(P(None, "model"), P("data", None)), exchange=exchange, collective_timeout=60),
  ]
  want = [f(x, w).numpy() for f in functions]   # sequentially, once each
  wrong = []

  def caller(k):
    def run():
      for i in range(CALLS // THREADS):
        f = functions[(k + i) % len(functions)]
        got = f(x, w).numpy()
        if not np.allclose(got, want[(k + i) % len(functions)], rtol=1e-5, atol=1e-5):
          wrong.append((k, i))
    return run

  _run_threads([caller(k) for k in range(THREADS)])
  assert not wrong, wrong[:5]
  assert all(f.lowerings == 1 for f in functions)


@pytest.mark.parametrize("exchange", ["auto", "collectives"])
def test_a_variable_assigned_while_others_step_is_read_whole(exchange):
  """One thread assigns v = c (c = 0..49) over and over while two others step a function reading v split over the
  whole mesh: every result is sum(x @ v) for one c, never a mix of two versions' shards."""
  v = gs.variable(0.0, (16, 8), mesh=MESH, spec=P("data", "model"))
  f = gs.function(lambda a: tf.reduce_sum(a @ v), mesh=MESH, in_shardings=P(None, "data"), exchange=exchange,
                  collective_timeout=60)
  x = np.ones((4, 16), np.float32)
  versions = {float(c * 4 * 16 * 8) for c in range(50)}
  stop, seen, torn = threading.Event(), set(), []

  def writer():
    c = 0
    while not stop.is_set():
      c = (c + 1) % 50
      v.assign(np.full((16, 8), c, np.float32))

  def reader():
    for _ in range(CALLS // 4):
      got = float(f(x).numpy())
      seen.add(got)
      if got not in versions:
        torn.append(got)

  w = threading.Thread(target=writer, daemon=True)
  w.start()
  try:
    _run_threads([reader, reader])
  finally:
    stop.set()
    w.join(timeout=60)
  assert not torn, sorted(set(torn))[:5]
  assert len(seen) > 1   # the writes were seen
  v.assign(np.full((16, 8), 3.0, np.float32))
  assert float(f(x).numpy()) == 3.0 * 4 * 16 * 8   # the last write, not a stale one
