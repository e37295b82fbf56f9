"""The launcher (tf_gspmd/launch.py): argument checks, the first failing worker noticed and named, --grace.

The workers are tiny `python -c` programs (no TensorFlow), so these tests take seconds.
"""

import io
import sys
import time

import pytest

from tf_gspmd import launch

# Each worker reads its index `k` from its TF_CONFIG.
_INDEX = "import json, os, sys, time; k = json.loads(os.environ['TF_CONFIG'])['task']['index']; "


def _run(body, workers=2, grace=60.0, timeout=None):
  out = io.StringIO()
  start = time.monotonic()
  status = launch.launch([sys.executable, "-c", _INDEX + body], workers, grace=grace, timeout=timeout, out=out)
  return status, out.getvalue(), time.monotonic() - start


@pytest.mark.parametrize("workers", ["0", "-1"])
def test_fewer_than_one_worker_is_refused(workers, capsys):
  with pytest.raises(SystemExit) as e:
    launch.main([f"--workers={workers}", "--", sys.executable, "-c", "print('ran')"])
  assert e.value.code != 0
  err = capsys.readouterr().err
  assert f"--workers={workers}" in err and "at least 1" in err
  with pytest.raises(ValueError, match="at least one worker"):
    launch.launch([sys.executable, "-c", "print('ran')"], int(workers))


def test_negative_grace_is_refused(capsys):
  with pytest.raises(SystemExit) as e:
    launch.main(["--workers=1", "--grace=-1", "--", sys.executable, "-c", "pass"])
  assert e.value.code != 0 and "--grace=-1" in capsys.readouterr().err


def test_a_later_worker_failing_is_noticed_at_once_and_named():
  # Worker 0 would run for a minute; worker 1 fails after 0.3 s. With grace 0.5 s, the launcher must stop
  # worker 0 well before its minute is up, blame worker 1 and return worker 1's status.
  status, out, took = _run("time.sleep(60) if k == 0 else (time.sleep(0.3), sys.exit(5))", grace=0.5)
  assert status == 5, out
  assert "[launch] worker 1 exited with status 5" in out, out
  assert "worker 0 exited with status 5" not in out
  assert "[launch] stopping worker 0" in out, out
  assert took < 4.0, (took, out)   # 0.3 s + noticed within a second + 0.5 s grace + start-up


def test_grace_lets_the_others_finish_on_their_own():
  # Worker 0 fails at once; worker 1 needs 1 s more and exits by itself within the 5 s grace: it is not stopped.
  status, out, took = _run("sys.exit(7) if k == 0 else (time.sleep(1.0), print('done', k))", grace=5.0)
  assert status == 7, out
  assert "[launch] worker 0 exited with status 7" in out and "[worker 1] done 1" in out, out
  assert "stopping" not in out, out
  assert took < 4.5, (took, out)


def test_grace_runs_out_then_the_others_are_stopped():
  status, out, took = _run("sys.exit(2) if k == 1 else time.sleep(60)", workers=3, grace=1.0)
  assert status == 2, out
  assert "[launch] worker 1 exited with status 2" in out
  assert "[launch] stopping worker 0" in out and "[launch] stopping worker 2" in out, out
  assert 1.0 <= took < 5.0, (took, out)


def test_all_workers_succeeding_exit_zero():
  status, out, _ = _run("print('ok', k)", workers=3)
  assert status == 0 and all(f"[worker {k}] ok {k}" in out for k in range(3)), out
  assert "[launch]" not in out


def test_dash_c_and_dash_m_run_with_this_python_like_python_does(capsys):
  # `-- -c CODE` used to be run as a program named "-c" (FileNotFoundError after starting nothing useful).
  code = _INDEX + "print('code', k, os.environ['TF_GSPMD_CPU_DEVICES_PER_PROCESS'])"
  assert launch.main(["--workers=2", "--devices_per_worker=3", "--", "-c", code]) == 0
  out = capsys.readouterr().out
  assert "[worker 0] code 0 3" in out and "[worker 1] code 1 3" in out, out
  assert launch.main(["--workers=1", "--", "-m", "json.tool", "--help"]) == 0
  assert "[worker 0] usage:" in capsys.readouterr().out


def test_help_documents_what_may_follow_the_double_dash(capsys):
  with pytest.raises(SystemExit) as e:
    launch.main(["--help"])
  assert e.value.code == 0
  text = capsys.readouterr().out
  assert all(form in text for form in ("script.py [ARGS]", "-c CODE [ARGS]", "-m MODULE [ARGS]", "PROGRAM [ARGS]"))
  assert "before any worker starts" in text


@pytest.mark.parametrize("argv,named", [
    (["--workers=2", "--devices_per_worker=-3"], "--devices_per_worker=-3"),   # used to wait 60 s for the join
    (["--workers=1", "--timeout=-1"], "--timeout=-1"),                         # used to stop the workers at once
    (["--workers=1", "--grace=nan"], "--grace=nan"),
])
def test_bad_numbers_are_refused_before_any_worker_starts(argv, named, capsys, monkeypatch):
  monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("a worker was started"))
  with pytest.raises(SystemExit) as e:
    launch.main(argv + ["--", "-c", "pass"])
  assert e.value.code == 2 and named in capsys.readouterr().err


def test_a_missing_script_is_named_before_any_worker_starts(capsys, monkeypatch, tmp_path):
  monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("a worker was started"))
  with pytest.raises(SystemExit):
    launch.main(["--workers=2", "--", str(tmp_path / "train.py"), "--steps=1"])
  assert f"the script '{tmp_path / 'train.py'}' does not exist" in capsys.readouterr().err


def test_a_failed_job_is_started_again_up_to_max_restarts():
  # Start 0: worker 1 fails; start 1 (TF_GSPMD_RESTART=1): both succeed.
  body = "r = int(os.environ['TF_GSPMD_RESTART']); print('start', r, k); sys.exit(3 if r == 0 and k == 1 else 0)"
  out = io.StringIO()
  status = launch.launch([sys.executable, "-c", _INDEX + body], 2, grace=5.0, out=out, max_restarts=2)
  text = out.getvalue()
  assert status == 0, text
  assert "starting it again (1 of 2 restarts)" in text and "(2 of 2" not in text, text
  assert "[worker 0] start 1 0" in text and "[worker 1] start 1 1" in text, text
  out = io.StringIO()   # without restarts the failure is the job's status
  assert launch.launch([sys.executable, "-c", _INDEX + body], 2, grace=5.0, out=out) == 3
  with pytest.raises(ValueError, match="max_restarts=-1"):
    launch.launch([sys.executable, "-c", "pass"], 1, max_restarts=-1)


def test_a_job_failing_every_time_stops_after_its_restarts():
  out = io.StringIO()
  status = launch.launch([sys.executable, "-c", _INDEX + "sys.exit(4)"], 1, grace=1.0, out=out, max_restarts=2)
  assert status == 4 and out.getvalue().count("starting it again") == 2, out.getvalue()
