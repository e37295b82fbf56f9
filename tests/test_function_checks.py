"""Assertions and prints inside a gs.function keep TF's meaning: tf.debugging.check_numerics, assert_less,
assert_all_finite and tf.debugging.Assert raise InvalidArgumentError exactly when the plain tf.function does, and
otherwise give its results; on a split tensor every device checks its own piece. tf.print prints once per call on
one process of CPUs (exchange="auto") and once per device through TF's collectives (exchange="collectives").

Both exchanges, XLA on and off. The cases run in subprocesses, which then check that later steps still run (a
failed check that aborted a step's collectives would stop every later one; rewriter/backend/checks.py keeps it from
failing inside a program with collectives).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

_PROGRAM = r'''
import json, sys
import numpy as np
import tensorflow as tf
import tf_gspmd as gs

gs.split_cpu_devices(8)
mesh = gs.Mesh((8,), ("d",))
exchange, jit = sys.argv[1], {"True": True, "False": False}[sys.argv[2]]

def check_numerics(x):
  return tf.debugging.check_numerics(x, "x went bad") * 2.0

def assert_less(x):
  tf.debugging.assert_less(x, 5.0, message="x too big")
  return x * 2.0

def assert_all_finite(x):
  tf.debugging.assert_all_finite(x, "x not finite")   # result unused: the check still runs, as in tf.function
  return x + 1.0

def assert_op(x):
  with tf.control_dependencies([tf.debugging.Assert(tf.reduce_all(x < 5.0), [x])]):
    return x - 1.0

@tf.function
def _finite_plus_one(x):
  tf.debugging.assert_all_finite(x, "x not finite inside")
  return x + 1.0

def nested(x):   # a check inside a called function whose result nobody reads
  _finite_plus_one(x)
  return x * 4.0

good = np.arange(16, dtype=np.float32) / 4.0            # every value < 4
inputs = {"good": good}
for k in (0, 13, 15):                                  # device 0's, device 6's and device 7's piece
  for name, v in (("nan", np.nan), ("inf", np.inf), ("big", 7.0)):
    x = good.copy()
    x[k] = v
    inputs[f"{name}{k}"] = x

for fn in (check_numerics, assert_less, assert_all_finite, assert_op, nested):
  f = gs.function(fn, mesh=mesh, in_shardings=gs.P("d"), exchange=exchange, jit_compile=jit)
  for label, x in inputs.items():
    row = {"fn": fn.__name__, "input": label}
    try:
      row["plain"] = tf.function(fn)(x).numpy().tolist()
    except tf.errors.InvalidArgumentError as e:
      row["plain"] = "InvalidArgumentError"
      row["plain_message"] = e.message.splitlines()[0][:40]
    try:
      row["ours"] = f(x).numpy().tolist()
    except tf.errors.InvalidArgumentError as e:
      row["ours"] = "InvalidArgumentError"
      row["message"] = e.message
    except Exception as e:  # pylint: disable=broad-except
      row["ours"] = f"{type(e).__name__}: {e}"
    print("ROW " + json.dumps(row), flush=True)

# After failed checks, the process still runs partitioned programs (an all-reduce).
total = gs.function(lambda x: tf.reduce_sum(x) + x, mesh=mesh, in_shardings=gs.P("d"), exchange=exchange,
                    jit_compile=jit)(good).numpy()
print("AFTER " + json.dumps(bool(np.allclose(total, good.sum() + good))), flush=True)

def printing(x):
  tf.print("PRINTED sum", tf.reduce_sum(x), output_stream=sys.stdout)
  tf.print("PRINTED err", x[:2])   # stderr
  return x * 3.0

r = gs.function(printing, mesh=mesh, in_shardings=gs.P("d"), exchange=exchange, jit_compile=jit)(good)
sys.stdout.flush()
print("PRINT_RESULT " + json.dumps(bool(np.array_equal(r.numpy(), good * 3.0))), flush=True)
'''


@pytest.fixture(scope="module")
def program(tmp_path_factory):
  path = tmp_path_factory.mktemp("checks") / "checks.py"
  path.write_text(_PROGRAM)
  return str(path)


def _run(program, exchange, jit):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path), TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
  out = subprocess.run([sys.executable, program, exchange, str(jit)], capture_output=True, text=True, timeout=600,
                       env=env, cwd=ROOT, check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
  return rows, out


@pytest.mark.parametrize("jit", [False, True], ids=["tf", "xla"])
@pytest.mark.parametrize("exchange", ["auto", "collectives"])
def test_checks_raise_exactly_when_tf_function_does_and_prints_print(program, exchange, jit):
  rows, out = _run(program, exchange, jit)
  assert len(rows) == 5 * 10, out.stdout[-3000:]
  for row in rows:
    # No check fails inside a program with collectives (rewriter/backend/checks.py): none is cancelled, and no step
    # after a failed one finds the process's collectives aborted.
    assert row["ours"] == row["plain"], row   # the same values, or InvalidArgumentError where TF raises
    if row["plain"] == "InvalidArgumentError":
      assert row["input"] != "good"
      assert row["plain_message"].split(" : ")[0] in row["message"], row   # the user's message
  raised = {(r["fn"], r["input"]) for r in rows if r["ours"] == "InvalidArgumentError"}
  # The checks on split data fail whichever device's piece holds the bad value.
  for k in (0, 13, 15):
    assert {("check_numerics", f"nan{k}"), ("check_numerics", f"inf{k}"), ("assert_all_finite", f"nan{k}"),
            ("assert_less", f"big{k}"), ("assert_less", f"inf{k}"),
            ("assert_op", f"big{k}"), ("assert_op", f"inf{k}"), ("nested", f"nan{k}")} <= raised, sorted(raised)
  assert "AFTER true" in out.stdout, out.stdout[-2000:]
  assert "PRINT_RESULT true" in out.stdout
  printed = [line for line in out.stdout.splitlines() if line.startswith("PRINTED sum")]
  errs = [line for line in out.stderr.splitlines() if line.startswith("PRINTED err")]
  devices = 1 if exchange == "auto" else 8    # once per call in one graph; once per device through collectives
  assert printed == ["PRINTED sum 30"] * devices, out.stdout[-2000:]
  assert errs == ["PRINTED err [0 0.25]"] * devices, out.stderr[-2000:]
  assert "Requested return node" not in out.stdout + out.stderr


def test_xla_on_gpus_keeps_checks_outside_its_clusters():
  """On GPUs XLA would drop a check it compiled: the check runs between XLA clusters, in TF's executor, and the
  program around it is compiled; a check with the collectives XLA does not lower likewise."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  gpus = [f"/job:worker/replica:0/task:0/device:GPU:{i}" for i in range(8)]
  mesh = gs.Mesh((8,), ("d",), devices=gpus)

  def check(x):
    return tf.debugging.check_numerics(tf.sin(x), "bad") * 2.0

  low = gs.function(check, mesh=mesh, in_shardings=gs.P("d")).lower(tf.TensorSpec([16]))
  assert low.program.jit == "segments"
  top = {n.name: n.op for n in low.program.local_graph_def.node}
  assert "CheckNumerics" in top.values() and "Sin" not in top.values() and "Mul" not in top.values(), top
  low = gs.function(check, mesh=mesh, in_shardings=gs.P("d"), jit_compile=False).lower(tf.TensorSpec([16]))
  assert {"CheckNumerics", "Sin", "Mul"} <= {n.op for n in low.program.local_graph_def.node}

  def guarded(x):   # the condition is all-reduced, the message's data all-gathered: segments
    with tf.control_dependencies([tf.debugging.Assert(tf.reduce_all(x < 5.0), [x])]):
      return x * 2.0

  low = gs.function(guarded, mesh=mesh, in_shardings=gs.P("d")).lower(tf.TensorSpec([16]))
  assert low.program.jit == "segments"
  top = {n.name: n.op for n in low.program.local_graph_def.node}
  assert any(op == "If" for op in top.values()), top          # the AssertGuard, outside every compiled segment
  assert any(top.get(s) == "If" for s in low.program.side_effects), low.program.side_effects
