"""The training binaries: they train (losses fall, first steps match unpartitioned), plan 2048 devices, resume."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import sigkill_when

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SMALL = {
    "train_transformer.py": ["--layers=1", "--d_model=32", "--d_ff=64", "--seq_len=16", "--batch=8", "--lr=1e-2"],
    "train_moe.py": ["--layers=1", "--d_model=32", "--d_ff=32", "--seq_len=16", "--batch=8", "--lr=1e-2"],
    "train_convnet.py": ["--image_size=32", "--width=8", "--batch=4", "--lr=1e-2"],
}


def _env():
  path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
  return dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")


def _run(binary, *flags, timeout=300):
  out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", binary), *SMALL[binary], *flags],
                       capture_output=True, text=True, timeout=timeout, env=_env(), check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


def _losses(text, worker=None):
  prefix = "" if worker is None else re.escape(f"[worker {worker}] ")
  return {int(k): float(v) for k, v in re.findall(rf"^{prefix}step (\d+) loss ([0-9.eE+-]+)", text, re.M)}


def _launched(workers, binary, *flags, timeout=420):
  """The binary as `workers` processes (python -m tf_gspmd.launch), the mesh's 8 CPUs split among them."""
  out = subprocess.run([sys.executable, "-m", "tf_gspmd.launch", f"--workers={workers}", "--",
                        os.path.join(ROOT, "examples", binary), *SMALL[binary], *flags], capture_output=True,
                       text=True, timeout=timeout, env=_env(), cwd=ROOT, check=False)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
  return out.stdout


_ONE_PROCESS = {}


def _one_process_losses(binary, tmp_path_factory):
  """The binary's first 16 losses in one process x 8 CPUs (run once per binary; checkpoints do not change them)."""
  if binary not in _ONE_PROCESS:
    logdir = tmp_path_factory.mktemp(binary.replace(".", "_"))
    out = _run(binary, "--steps=16", "--check_steps=2", "--ckpt_every=0", f"--logdir={logdir}", "--profile=4,5")
    _ONE_PROCESS[binary] = (out, logdir)
  return _ONE_PROCESS[binary]


@pytest.mark.parametrize("binary", sorted(SMALL))
def test_binary_trains_and_matches_the_unpartitioned_program(binary, tmp_path_factory):
  out, tmp_path = _one_process_losses(binary, tmp_path_factory)
  losses = _losses(out)
  assert sorted(losses) == list(range(16))
  assert sum(losses[k] for k in range(13, 16)) < 0.9 * sum(losses[k] for k in range(3)), losses
  assert "check: first 2 losses match the unpartitioned program" in out
  events = [f for _, _, files in os.walk(tmp_path) for f in files if f.startswith("events.out.tfevents")]
  assert events   # TensorBoard scalars
  traces = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".xplane.pb")]
  assert traces and "profile of steps 4-5 written" in out   # the profiler trace of --profile


@pytest.mark.parametrize("binary", sorted(SMALL))
def test_plan_for_2048_devices_without_them(binary):
  out = _run(binary, "--plan")
  assert "(2048 devices)" in out and "B/device" in out and "collective" in out
  assert re.search(r"estimated peak memory: [\d.,]+ MiB per device", out) and "peak memory" in out


def test_moe_plan_for_2048_devices_does_not_gather_the_padded_loss():
  """train_moe's default plan (8 experts, a batch of 16 over 2048 devices): the loss's reshape of the logits
  [16, 32, 128] moves their split by one all-to-all instead of gathering every device's padded shard (33.5 MB)."""
  out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_moe.py"), "--plan"],
                       capture_output=True, text=True, timeout=300, env=_env(), check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  gathers = [int(b.replace(",", "")) for b in re.findall(r"all-gather \S+ over expert \(group 2048\), ([\d,]+) "
                                                          r"B/device - SparseSoftmax", out.stdout)]
  assert gathers and max(gathers) <= 4 << 20, out.stdout[-3000:]
  assert re.search(r"all-to-all float32\[[\d,]+\] over expert .* - SparseSoftmaxCrossEntropyWithLogits/Reshape:",
                   out.stdout), out.stdout[-3000:]
  total = int(re.search(r"collective\(s\), ([\d,]+) bytes per device", out.stdout).group(1).replace(",", ""))
  assert total < 110 << 20


def test_plan_over_hosts_sends_across_them_one_slice_per_member_in_a_host():
  """--plan_hosts: 2048 devices on 256 hosts of 8 put each `model` group's 64 members 8 to a host, so its
  collectives run in two levels and what crosses hosts per device falls below the plan with one device a host."""
  across = {}
  for hosts in (256, 2048):
    out = _run("train_transformer.py", "--plan", f"--plan_hosts={hosts}")
    assert f"(2048 devices on {hosts} hosts x {2048 // hosts})" in out
    across[hosts] = int(re.search(r"; ([\d,]+) across processes\)", out).group(1).replace(",", ""))
    assert ("within each process" in out) == (hosts == 256)
    if hosts == 256:   # every all-gather and all-reduce over `model` runs in two levels (all-to-alls stay flat)
      lines = out.splitlines()
      over_model = [k for k, line in enumerate(lines)
                    if re.match(r"\s+all-(gather|reduce) \S+ over model \(group 64, across processes\)", line)]
      assert over_model
      for k in over_model:
        assert "hierarchical (8 members in each of 8 processes)" in lines[k + 1], lines[k:k + 2]
  assert 0 < across[256] < across[2048]


def test_sigkill_then_resume_continues_with_the_same_losses(tmp_path):
  binary = "train_transformer.py"
  flags = ["--steps=24", "--check_steps=0", "--ckpt_every=4"]
  straight = _losses(_run(binary, *flags, f"--logdir={tmp_path / 'straight'}"))
  log = open(tmp_path / "killed.log", "w")
  proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", binary), *SMALL[binary], *flags,
                           f"--logdir={tmp_path / 'resumed'}"], stdout=log, stderr=subprocess.STDOUT, env=_env())
  try:
    text = lambda: open(tmp_path / "killed.log").read()
    sigkill_when([proc], 0, lambda: "step 9 loss" in text(), 240, lambda: text()[-2000:])
    proc.wait(30)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == -signal.SIGKILL   # killed mid-run, not finished
  out = _run(binary, *flags, f"--logdir={tmp_path / 'resumed'}", "--resume")
  start = int(re.search(r"resumed from \S+ at step (\d+)", out).group(1))
  assert start >= 8 and start % 4 == 0 and start < 24   # the last checkpoint written before the kill
  resumed = _losses(out)
  assert sorted(resumed) == list(range(start, 24))
  for k in resumed:
    assert abs(resumed[k] - straight[k]) <= 1e-5 * abs(straight[k]), (k, resumed[k], straight[k])


@pytest.mark.parametrize("binary,workers,exchange", [
    ("train_transformer.py", 2, "auto"), ("train_transformer.py", 4, "auto"), ("train_moe.py", 2, "auto"),
    ("train_convnet.py", 2, "auto"), ("train_transformer.py", 2, "collectives")])
def test_binary_over_several_processes_gives_the_one_process_losses(binary, workers, exchange, tmp_path,
                                                                    tmp_path_factory):
  """Each process runs its devices as one graph (exchange auto), or each device's program on its own thread."""
  one = _losses(_one_process_losses(binary, tmp_path_factory)[0])
  out = _launched(workers, binary, "--steps=10", "--check_steps=0", "--ckpt_every=5", f"--logdir={tmp_path}",
                  f"--exchange={exchange}")
  for k in range(workers):
    losses = _losses(out, k)
    assert sorted(losses) == list(range(10)), out[-3000:]
    for step, loss in losses.items():
      assert abs(loss - one[step]) <= 1e-5 * abs(one[step]), (k, step, loss, one[step])


def test_auto_sharded_moe_finds_expert_sharding_within_the_gshard_memory(tmp_path):
  """--auto with the GShard plan's memory as the budget: experts split over `expert`, no more bytes than
  the GShard plan, and the first losses of the unpartitioned program."""
  hand = _run("train_moe.py", "--plan", "--plan_mesh=8")
  budget = re.search(r"memory as --memory_budget_mib counts it: ([\d.]+) MiB", hand).group(1)
  hand_bytes = int(re.search(r"collective\(s\), ([\d,]+) bytes per device", hand).group(1).replace(",", ""))
  out = _run("train_moe.py", "--auto", f"--memory_budget_mib={budget}", "--steps=3", "--check_steps=3",
             "--ckpt_every=0", f"--logdir={tmp_path}")
  assert "check: first 3 losses match the unpartitioned program" in out
  assert re.search(r"variable l0_w1 +\[8, 32, 32\] +P\('expert', None, None\)", out), out[-3000:]
  assert re.search(r"variable l0_w2 +\[8, 32, 32\] +P\('expert', None, None\)", out)
  auto_bytes = int(re.search(r"collectives per step: .*?, ([\d,]+) B/device", out).group(1).replace(",", ""))
  assert auto_bytes <= hand_bytes
  planned = int(re.search(r"auto sharding: predicted ([\d,]+) B/device", out).group(1).replace(",", ""))
  assert auto_bytes <= planned   # (partial sums added before they travel send less than each reduced where made)


def test_auto_plan_for_2048_devices_without_them():
  out = _run("train_transformer.py", "--plan", "--auto")
  assert "(2048 devices)" in out and re.search(r"auto sharding: predicted [\d,]+ B/device", out)
  assert "runner-up" in out and "Optimal" in out


def test_2d_layout_trains_and_matches_the_unpartitioned_program(tmp_path):
  out = _run("train_transformer.py", "--layout=2d", "--steps=3", "--check_steps=2", "--ckpt_every=0",
             f"--logdir={tmp_path}")
  assert "check: first 2 losses match the unpartitioned program" in out


def test_one_process_through_tfs_collectives_trains_as_the_in_process_graph(tmp_path, tmp_path_factory):
  """--exchange=collectives: each device's program on its own thread joined by TF's collective ops (the runtime
  GPUs and several processes use), in one process: the losses are the in-process graph's."""
  binary = "train_transformer.py"
  want = _losses(_one_process_losses(binary, tmp_path_factory)[0])
  out = _run(binary, "--exchange=collectives", "--steps=4", "--check_steps=2", "--ckpt_every=0",
             f"--logdir={tmp_path}")
  assert "check: first 2 losses match the unpartitioned program" in out
  got = _losses(out)
  assert sorted(got) == [0, 1, 2, 3]
  for k, loss in got.items():
    assert loss == pytest.approx(want[k], rel=1e-5)


@pytest.mark.parametrize("layout", ["megatron", "2d"])
def test_plan_at_the_128b_models_dims_keeps_weights_to_the_layouts_arithmetic(layout):
  """2 of DenseLm128B32x32's 64 layers at its full dims on its (32, 64) mesh: the model is built shape-only, the
  weights per device are the layout's arithmetic, and the per-device program holds no constant above 1 MiB."""
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  import scale  # pylint: disable=g-import-not-at-top
  cfg = dict(scale.DENSE["dense128b"], layers=2)
  argv = scale.transformer_argv(cfg, layout)
  out = subprocess.run([sys.executable, os.path.join(ROOT, argv[0]), *argv[1:]], capture_output=True,
                       text=True, timeout=300, env=_env(), check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  weights = int(re.search(r"weight variables: ([\d,]+) B per device", out.stdout).group(1).replace(",", ""))
  assert 0 <= weights - round(scale.weight_bytes(cfg, layout, cfg["mesh"])) <= 16   # + scalars (learning rate)
  constants = re.search(r"(?m)^constants: ([\d,]+) B per device", out.stdout).group(1)   # the per-device program's
  assert int(constants.replace(",", "")) <= 1 << 20


@pytest.mark.parametrize("binary,profile", [("train_transformer.py", "--stage_profile"),
                                            ("train_moe.py", "--nostage_profile")])
def test_auto_parallel_trains_and_matches_the_unpartitioned_program(binary, profile, tmp_path):
  out = _run(binary, "--auto_parallel", profile, "--microbatches=4", "--steps=3", "--check_steps=2",
             f"--logdir={tmp_path}")
  assert "stage plan:" in out and "T* =" in out
  if "runs as one gs.function on the whole mesh" not in out:
    assert "MPMD stages:" in out and "stage 0 (layers 0-" in out
  if profile == "--stage_profile":   # the plans' stages and the step without a pipeline were timed
    assert "measured (model " in out and "steps timed without a pipeline, whole batch: planned" in out
  assert sorted(_losses(out)) == [0, 1, 2]
  assert re.search(r"step 2 loss [\d.]+ time \d+ ms \(plan predicts [\d.]+ ms\)", out)
  assert "check: first 2 losses match the unpartitioned program" in out


def test_auto_parallel_plan_without_devices():
  out = _run("train_transformer.py", "--auto_parallel", "--plan", "--layers=6", "--plan_mesh=8,8",
             "--microbatches=8", "--batch=16")
  assert "mesh (8, 8) (64 devices), 8 layers, 8 microbatches, planned in" in out
  table = re.findall(r"^\s+\d+\s+\d+-\d+\s+\d+\s+\(\d+, \d+\)", out, re.M)
  assert len(table) >= 1 and "stage plan: 8 layers on a (8, 8) mesh" in out


@pytest.mark.parametrize("binary", sorted(SMALL))
def test_help_lists_the_shared_flags_with_the_binarys_own(binary):
  """absl's --help shows the main module's key flags: the binaries adopt examples/training.py's."""
  out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", binary), "--help"], capture_output=True,
                       text=True, timeout=120, env=_env(), check=False)
  assert "Traceback" not in out.stderr, out.stderr[-2000:]   # (absl's --help exits with status 1)
  for flag in ("--plan:", "--plan_mesh:", "--plan_hosts:", "--mesh:", "--steps:", "--resume:", "--logdir:",
               "--batch:"):
    assert flag in out.stdout, f"{binary} --help does not list {flag}"


def test_a_bad_flag_is_absls_usage_error_before_tensorflow_starts():
  start = time.monotonic()
  out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_transformer.py"), "--steps=-1"],
                       capture_output=True, text=True, timeout=120, env=_env(), check=False)
  assert out.returncode == 1 and "flag --steps=-1: -1 is not a positive integer" in out.stderr, out.stderr[-2000:]
  assert "Traceback" not in out.stderr and time.monotonic() - start < 20   # (TensorFlow alone takes longer)

