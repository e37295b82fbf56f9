"""A failed check in a program with collectives is raised after every device has finished (rewriter/backend/checks.py,
tf_gspmd/runtime/checks.py): the step raises TF's InvalidArgumentError, writes no variable, and never leaves the
process's collectives aborted, so the steps after it run. The programs run in subprocesses: before this pass, a
check failing on one device while the others waited in an all-reduce could abort the process's collectives for
good."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd.rewriter.backend import checks

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

_PROGRAM = r'''
import json, sys
import numpy as np
import tensorflow as tf
import tf_gspmd as gs

gs.split_cpu_devices(8)
mesh = gs.Mesh((8,), ("d",))
exchange = sys.argv[1]

def make(v):
  def step(x):
    y = tf.debugging.check_numerics(x, "x went bad")   # fails on the device whose piece holds the NaN
    v.assign_add(y * 2.0)                              # a write after the check
    return tf.reduce_sum(y) + v                         # an all-reduce after it
  return step

ours_v, plain_v = tf.Variable(np.zeros(16, np.float32)), tf.Variable(np.zeros(16, np.float32))
ours = gs.function(make(ours_v), mesh=mesh, in_shardings=gs.P("d"), exchange=exchange)
plain = tf.function(make(plain_v))
for k in range(40):
  x = np.arange(16, dtype=np.float32) / (k + 1)
  if k % 2:
    x[(3 * k) % 16] = np.nan if k % 4 == 1 else np.inf
  row = {"k": k}
  for name, fn in (("plain", plain), ("ours", ours)):
    try:
      row[name] = fn(x).numpy().tolist()
    except tf.errors.InvalidArgumentError as e:
      row[name] = "InvalidArgumentError"
      row[name + "_message"] = e.message
    except Exception as e:  # pylint: disable=broad-except
      row[name] = f"{type(e).__name__}: {e}"
  row["variables_equal"] = bool(np.allclose(ours_v.numpy(), plain_v.numpy(), rtol=1e-6))
  print("ROW " + json.dumps(row), flush=True)
'''


@pytest.mark.parametrize("exchange", ["auto", "collectives"])
def test_a_failed_check_before_an_all_reduce_raises_writes_nothing_and_later_steps_run(tmp_path, exchange):
  path = tmp_path / "checks_program.py"
  path.write_text(_PROGRAM)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path), TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONWARNINGS="ignore")
  out = subprocess.run([sys.executable, str(path), exchange], capture_output=True, text=True, timeout=600, env=env,
                       cwd=ROOT, check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
  assert len(rows) == 40, out.stdout[-3000:] + out.stderr[-3000:]
  for row in rows:
    if isinstance(row["plain"], list):               # the values of plain TF (sums in another order)
      np.testing.assert_allclose(row["ours"], row["plain"], rtol=1e-6, err_msg=str(row))
    else:                                            # or InvalidArgumentError where TF raises
      assert row["ours"] == row["plain"], row
    assert row["variables_equal"], row               # a failed step writes nothing, as in TF
    if row["plain"] == "InvalidArgumentError":
      kind = "NaN" if row["k"] % 4 == 1 else "Inf"
      assert f"x went bad : Tensor had {kind} values" in row["plain_message"], row
      assert f"x went bad : Tensor had {kind} values" in row["ours_message"], row
  assert sum(r["plain"] == "InvalidArgumentError" for r in rows) == 20


@pytest.mark.parametrize("writes", [False, True])
def test_the_checks_are_named_and_the_devices_agree_on_the_verdict_where_writes_wait_for_it(writes):
  """Where the program writes a variable, one all-reduce of 4 bytes (in the report) tells every device whether a
  check failed; without writes, in one process, the runtime reads every device's verdict and nothing is added."""
  mesh = gs.Mesh((8,), ("d",))
  v = tf.Variable(0.0)

  def step(x):
    tf.debugging.assert_less(x, 5.0, message="x too big")
    total = tf.reduce_sum(tf.debugging.check_numerics(x, "x went bad"))
    if writes:
      v.assign_add(total)
    return total

  f = gs.function(step, mesh=mesh, in_shardings=gs.P("d"), exchange="collectives")
  lowered = f.lower(tf.TensorSpec([16], tf.float32))
  program = lowered.executable().program
  assert sorted(c.op for c in program.checks) == ["Assert", "CheckNumerics"]
  assert any("[x too big]" in c.message for c in program.checks)
  assert any(c.message == "x went bad" for c in program.checks)
  assert program.verdict == checks.VERDICT and program.verdict_agreed == writes
  verdict = [c for c in lowered.report.collectives if c.source == checks.VERDICT]
  if writes:
    assert len(verdict) == 1 and verdict[0].kind == "all-reduce" and verdict[0].bytes == 4, verdict
  else:
    assert not verdict
  # Good input: the values of plain TF; bad input: its error, no write, and the next call runs.
  x = np.arange(16, dtype=np.float32) / 4.0
  np.testing.assert_allclose(f(x).numpy(), x.sum())
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"x too big"):
    f(x * 4.0)
  np.testing.assert_allclose(f(x).numpy(), x.sum())
  assert v.numpy() == (2 * x.sum() if writes else 0.0)


def test_a_program_without_collectives_keeps_tf_s_own_checks():
  mesh = gs.Mesh((8,), ("d",))
  f = gs.function(lambda x: tf.debugging.check_numerics(x, "bad") * 2.0, mesh=mesh, in_shardings=gs.P("d"),
                  exchange="collectives")
  program = f.lower(tf.TensorSpec([16], tf.float32)).executable().program
  assert program.checks == () and program.verdict is None
  assert any(n.op == "CheckNumerics" for n in program.graph_def.node)


def test_a_check_failing_on_one_process_raises_in_every_process_and_writes_nothing():
  """2 processes x 4 devices, through TF's collectives: a NaN in one process's piece fails the step in both."""
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  import cluster_runs  # pylint: disable=g-import-not-at-top
  results = cluster_runs.launch(2, "checks_step.py", timeout=420, exchange="collectives")
  for r in results.values():
    assert len(r["rows"]) == 8
    for s, row in enumerate(r["rows"]):
      assert row["shards_equal"], (r["process"], s, row)
      if s % 2:
        assert row["plain"] == row["ours"] == "InvalidArgumentError", (r["process"], s, row)
        # the process whose device holds the NaN names the check; the other says where it failed
        mine = (s % 4 == 1) == (r["process"] == 0)
        assert ("x went bad : Tensor had NaN values" if mine else "failed on a device of another process") in (
            row["ours_message"]), (r["process"], s, row)
      else:
        np.testing.assert_allclose(row["ours"], row["plain"], rtol=1e-6)
