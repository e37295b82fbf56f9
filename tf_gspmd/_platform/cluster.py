"""Several processes, one SPMD program: the cluster this process belongs to (multi-controller, like JAX
multi-process and DTensor multi-client).

Every process runs the same Python program and drives its own (local) devices; collectives span all processes
through TF's own collective runtime over gRPC (the one MultiWorkerMirroredStrategy uses). `initialize` joins the
cluster that a `tf.distribute.cluster_resolver.ClusterResolver` describes -- `TF_CONFIG` by default, or Slurm,
Kubernetes, or a `SimpleClusterResolver` -- before TensorFlow runs anything. Afterwards TF lists every task's
devices; a mesh takes them in the order of `_mesh.device_order` (tasks major: the chief, then workers by index; then
device type and index), so every process builds the same mesh, the same group keys and the same program without
exchanging any Python state.

A process that never calls `initialize` (or whose resolver describes no cluster) is a cluster of one.
"""

import functools
import json
import numbers
import os
import re
import signal
import socket
import threading
import time

import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd._layout.mesh import JOB_ORDER
from tf_gspmd._layout.mesh import _device_name  # the canonical device name meshes use
from tf_gspmd.errors import ClusterJoinError, MeshError, ProcessLostError

DEVICES_ENV = "TF_GSPMD_CPU_DEVICES_PER_PROCESS"   # logical CPUs per process, from the launcher
EXITED_ENV = "TF_GSPMD_EXITED"   # a file the launcher writes "<worker index> <exit status>" to for each failed worker
_lock = threading.Lock()
_state = {"job": None, "task": None, "tasks": None}


def initialize(cluster_resolver=None, *, cpu_devices=None, heartbeat_timeout=30.0, join_timeout=120.0):
  """Joins this process to its cluster (call once, before TensorFlow runs anything).

  Args:
    cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`; default: `TFConfigClusterResolver`
      (the `TF_CONFIG` environment variable). Its tasks of jobs "chief" and "worker" are the processes.
    cpu_devices: when given, the CPU is split into logical devices so that the whole cluster has this many
      (each of the P processes gets cpu_devices / P): the same program runs on 1 process x 8 devices or on
      2 x 4 with `cpu_devices=8`. A whole number of 1 or more (MeshError otherwise: 0 would leave no CPU).
    heartbeat_timeout: seconds after which the cluster declares a silent process lost (its peers' collectives
      then fail naming it instead of waiting for the collective deadline).
    join_timeout: seconds to wait for every process to start (registering with the cluster and the first barrier
      each get this long); past it, ClusterJoinError names the tasks that did not connect.

  Returns:
    (process index, process count).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  per_process = _devices_per_process(os.environ.get(DEVICES_ENV))
  for name, value in (("join_timeout", join_timeout), ("heartbeat_timeout", heartbeat_timeout)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
      raise MeshError(f"gs.initialize({name}={value!r}): give a positive number of seconds")
  if cpu_devices is not None:
    cpu_devices = count(cpu_devices, "cpu_devices", "gs.initialize(cpu_devices=...) takes the logical CPU devices "
                        "of the whole cluster (e.g. 8), or None to keep the devices TensorFlow finds")
  if cluster_resolver is None:
    _check_tf_config(os.environ.get("TF_CONFIG"))
    cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  elif not callable(getattr(cluster_resolver, "cluster_spec", None)):
    raise MeshError(f"gs.initialize(cluster_resolver={cluster_resolver!r}): give a "
                    "tf.distribute.cluster_resolver.ClusterResolver (e.g. TFConfigClusterResolver(), "
                    "SlurmClusterResolver()), or None to read TF_CONFIG", node="cluster_resolver")
  spec = cluster_resolver.cluster_spec()
  jobs = spec.jobs
  other = [j for j in jobs if j not in JOB_ORDER]
  if other:
    raise MeshError(f"the cluster has jobs {other}; tf_gspmd runs one SPMD program on the tasks of jobs "
                    f"{list(JOB_ORDER)} (no parameter servers or evaluators): remove them from the cluster spec")
  tasks = tuple((j, i) for j in JOB_ORDER if j in jobs for i in sorted(spec.task_indices(j)))
  if per_process:   # set by the launcher (python -m tf_gspmd.launch --devices_per_worker)
    if cpu_devices and per_process * max(len(tasks), 1) != cpu_devices:
      raise MeshError(f"the program asks for cpu_devices={cpu_devices} in all, but it was launched with "
                      f"{per_process} devices for each of {max(len(tasks), 1)} processes; make them agree")
    cpu_devices = per_process * max(len(tasks), 1)
  with _lock:
    if _state["tasks"] is not None:
      raise MeshError("gs.initialize was already called in this process; call it once, before any TF op")
    if len(tasks) <= 1:
      _state["tasks"] = ()
      if cpu_devices:
        split_cpu_devices(cpu_devices)
      return 0, 1
    job, task = cluster_resolver.task_type, cluster_resolver.task_id
    if (job, task) not in tasks:
      raise MeshError(f"this process is task {job}:{task}, which the cluster spec {spec.as_dict()} does not list; "
                      "set TF_CONFIG's \"task\" (or the resolver's task_type/task_id) to one of its tasks")
    if cpu_devices:
      if cpu_devices % len(tasks):
        raise MeshError(f"cpu_devices={cpu_devices} cannot be split evenly over {len(tasks)} processes; give a "
                        f"multiple of {len(tasks)}")
      _configure_cpu_devices(cpu_devices // len(tasks))
    leader = f"/job:{tasks[0][0]}/replica:0/task:{tasks[0][1]}"
    _wait_for_peers(spec, tasks, (job, task), join_timeout)
    try:
      _compat.enable_cluster_collectives(spec, job, task, leader, heartbeat_timeout, join_timeout)
      _compat.coordination_barrier("tf_gspmd_initialize", join_timeout)
    except (RuntimeError, ValueError, tf.errors.OpError) as e:
      raise _join_error(e, spec, tasks, (job, task), join_timeout) from e
    _state.update(job=job, task=task, tasks=tasks)
    return tasks.index((job, task)), len(tasks)


def count(value, what, fix):
  """`value` as an int of 1 or more; MeshError naming `what` and its value, with `fix`, for anything else (zero, a
  negative number, a fraction, a bool, a string): a device or process count TensorFlow would otherwise take as an
  empty device list (no CPU at all) or a multiplier of Python lists."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise MeshError(f"{what}={value!r} is not a positive whole number: {fix}", node=what)
  return int(value)


def _devices_per_process(text):
  """The launcher's per-process device count (the value of DEVICES_ENV), or None when it is unset or empty."""
  if text is None or not text.strip():
    return None
  try:
    return count(int(text), DEVICES_ENV, "")
  except (ValueError, MeshError):
    raise MeshError(f"the environment variable {DEVICES_ENV}={text!r} (which python -m tf_gspmd.launch "
                    "--devices_per_worker sets) is not a positive whole number: give the logical CPU devices of "
                    "each process, e.g. 4, or unset it", node=DEVICES_ENV) from None


_TF_CONFIG_EXAMPLE = ('{"cluster": {"worker": ["host0:port", "host1:port"]}, '
                      '"task": {"type": "worker", "index": 0}}')


def _check_tf_config(text):
  """MeshError naming TF_CONFIG unless `text` (the variable's value; None or empty: no cluster) is a cluster
  description TFConfigClusterResolver reads."""
  if not text or not text.strip():
    return
  fix = f"set TF_CONFIG to JSON like {_TF_CONFIG_EXAMPLE}, or unset it to run as one process"
  try:
    config = json.loads(text)
  except ValueError as e:
    raise MeshError(f"the environment variable TF_CONFIG is not valid JSON ({e}): {fix}", node="TF_CONFIG") from None
  if not isinstance(config, dict):
    raise MeshError(f"TF_CONFIG is a JSON {type(config).__name__}, not an object: {fix}", node="TF_CONFIG")
  cluster, task = config.get("cluster", {}), config.get("task", {})
  if not isinstance(cluster, dict) or not all(isinstance(v, (list, dict)) for v in cluster.values()):
    raise MeshError(f"TF_CONFIG's \"cluster\" must map each job to a list of \"host:port\" addresses; got "
                    f"{cluster!r}: {fix}", node="TF_CONFIG")
  if not isinstance(task, dict) or (cluster and not (isinstance(task.get("type"), str) and isinstance(
      task.get("index"), int) and not isinstance(task.get("index"), bool))):
    raise MeshError(f"TF_CONFIG's \"task\" must give this process's job \"type\" (a string) and \"index\" (an int); "
                    f"got {task!r}: {fix}", node="TF_CONFIG")


def _host_port(address):
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


def _wait_for_peers(spec, tasks, me, join_timeout):
  """Waits, in Python, until every other task of the cluster has started: its address accepts connections (this
  process's own address listens meanwhile, as its server will). TensorFlow's join that follows holds the GIL and
  takes over SIGTERM until every task has registered; waiting for the peers here first keeps a process whose peer
  never starts responsive: SIGTERM stops it at once with ClusterJoinError, and past `join_timeout`
  ClusterJoinError names the tasks that never started."""
  deadline = time.monotonic() + join_timeout
  listener = None
  try:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("", _host_port(spec.task_address(*me))[1]))
    listener.listen(64)   # the kernel accepts the peers' probes: no thread needed
  except (OSError, ValueError):
    if listener is not None:
      listener.close()
    listener = None   # (the address is taken or not this host's: TensorFlow's join reports what it finds)
  waiting = [t for t in tasks if t != me]

  def stop(signum, frame):  # pylint: disable=unused-argument
    raise _missing_error(spec, tasks, me, waiting, join_timeout, "it received SIGTERM while waiting for them")

  previous = None
  if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
    previous = signal.signal(signal.SIGTERM, stop)
  try:
    while waiting:
      for t in list(waiting):
        try:
          socket.create_connection(_host_port(spec.task_address(*t)), timeout=0.2).close()
          waiting.remove(t)
        except (OSError, ValueError):
          pass
      if waiting:
        gone = [(t, code) for t, code in _exited_workers() if t in waiting]
        if gone:
          raise _exited_error(spec, me, gone)
        if time.monotonic() >= deadline:
          raise _missing_error(spec, tasks, me, waiting, join_timeout, "they never started")
        time.sleep(0.1)
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
    if listener is not None:
      listener.close()


def _exited_workers():
  """[(("worker", k), exit status)] of the workers the launcher (python -m tf_gspmd.launch) saw fail, read from the
  file it names in EXITED_ENV (none without the launcher)."""
  path = os.environ.get(EXITED_ENV)
  try:
    with open(path) as f:
      lines = f.read().split("\n")
  except (TypeError, OSError):
    return []
  found = []
  for line in lines:
    parts = line.split()
    if len(parts) == 2 and all(p.lstrip("-").isdigit() for p in parts):
      found.append((("worker", int(parts[0])), int(parts[1])))
  return found


def _exited_error(spec, me, gone):
  """ProcessLostError for peers that started and exited before the cluster formed (the launcher saw them fail)."""
  where = ", ".join(f"/job:{j}/replica:0/task:{t} ({spec.task_address(j, t)}, exit status {code})"
                    for (j, t), code in gone)
  return ProcessLostError(
      f"task {me[0]}:{me[1]} could not join the cluster {spec.as_dict()}: task(s) {where} exited before joining it "
      "(the launcher saw them fail); restart every process of the cluster", node=f"{me[0]}:{me[1]}")


def _missing_error(spec, tasks, me, missing, join_timeout, detail):
  where = ", ".join(f"{j}:{t} ({spec.task_address(j, t)})" for j, t in missing)
  return ClusterJoinError(
      f"task {me[0]}:{me[1]} could not join the cluster {spec.as_dict()} within join_timeout={join_timeout:g} s: "
      f"task(s) {where} did not connect ({detail}). Start every process of the cluster (the same cluster spec, its "
      "own task index), check that their addresses are reachable, or give gs.initialize a larger join_timeout.",
      missing=[f"/job:{j}/replica:0/task:{t}" for j, t in missing], node=f"{me[0]}:{me[1]}")


_TASK_NAME = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


def _join_error(error, spec, tasks, me, join_timeout):
  """ClusterJoinError for `error` of the coordination service: the tasks that did not connect, by name and address.

  The leader's service names the tasks missing at its registration barrier; the other tasks time out registering
  with the leader, so then the leader is the one missing."""
  text = str(error)
  timed_out = text.split("timed out task names:", 1)
  if len(timed_out) == 2:
    missing = [(j, int(t)) for j, t in _TASK_NAME.findall(timed_out[1])]
  elif "RegisterTask" in text and me != tasks[0]:
    missing = [tasks[0]]
  else:
    missing = []
  missing = [m for m in dict.fromkeys(missing) if m in tasks and m != me]
  where = ", ".join(f"{j}:{t} ({spec.task_address(j, t)})" for j, t in missing)
  what = f"task(s) {where} did not connect" if missing else "the cluster did not form"
  first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
  return ClusterJoinError(
      f"task {me[0]}:{me[1]} could not join the cluster {spec.as_dict()} within join_timeout={join_timeout:g} s: "
      f"{what}. Start every process of the cluster (the same cluster spec, its own task index), check that their "
      f"addresses are reachable, or give gs.initialize a larger join_timeout. (TensorFlow: {first})",
      missing=[f"/job:{j}/replica:0/task:{t}" for j, t in missing], node=f"{me[0]}:{me[1]}")


def process_count():
  return len(_state["tasks"]) if _state["tasks"] else 1


def process_index():
  return _state["tasks"].index((_state["job"], _state["task"])) if _state["tasks"] else 0


def is_multi_process():
  return process_count() > 1


def _task_of(device):
  """(job, task) of device name `device` (or a LogicalDevice); MeshError for anything that is not a device name."""
  name = getattr(device, "name", device)
  if not isinstance(name, str):
    raise MeshError(f"{device!r} is not a device: give a TF device name such as '/device:CPU:0' (or a "
                    "tf.config.LogicalDevice)")
  return _parsed_task(name)


@functools.lru_cache(maxsize=None)
def _parsed_task(name):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    spec = tf.DeviceSpec.from_string(name)
  except ValueError as e:
    raise MeshError(f"{name!r} is not a device name ({e}); give one such as '/job:worker/replica:0/task:1/device:"
                    "CPU:0' or '/device:CPU:0'") from None
  return spec.job, spec.task or 0


def is_local(device):
  """Whether device name `device` belongs to this process."""
  task = _task_of(device)   # (checks that it is a device name, in every process)
  if not _state["tasks"]:
    return True
  return task == (_state["job"], _state["task"])


def process_of(device):
  """The index of the process that drives device name `device`."""
  if not _state["tasks"]:
    return 0
  return _state["tasks"].index(_task_of(device))


_TASK = re.compile(r"/job:[A-Za-z0-9_]+/replica:\d+/task:\d+")


def lost_task(message):
  """"task <name> (process k)" of the first task of another process that `message` (a TensorFlow error's text)
  names -- the one its collectives or the coordination service found gone -- or None when it names none."""
  named = [m.group(0) for m in _TASK.finditer(message or "") if not is_local(m.group(0))]
  return f"task {named[0]} (process {process_of(named[0])})" if named else None


RESTART = "restart every process (the training binaries continue with --resume)"


def process_lost(error, during, left, unnamed="a process of the cluster"):
  """ProcessLostError for `error` (what TensorFlow raised) in a multi-process operation: the process TF's message
  names (`unnamed` when it names none) stopped answering `during` (what this process was doing); `left` says what
  state that leaves and what to do."""
  message = str(getattr(error, "message", error) or "")
  who = lost_task(message) or unnamed
  said = message.splitlines()[0][:300] if message else ""
  return ProcessLostError(f"{who} stopped answering during {during}; {left}. TF said: {type(error).__name__}: {said}")


# Seconds a process waits at a barrier or for another process's value (a lost process is usually reported sooner,
# by the cluster's heartbeat), and between health checks of the process a lookup waits for.
EXCHANGE_TIMEOUT_S = 600.0
POLL_S = 2.0


class Exchange:
  """The processes' key-value exchange (TF's coordination service) for one joint operation, `subject` ("the
  checkpoint save of 'path'"): barriers and values one process stores for the others. A process that is gone
  makes each call raise ProcessLostError naming it; `left` says what state that leaves and what to do."""

  def __init__(self, subject, left):
    self.subject, self.left = subject, left

  def _lost(self, error, phase):
    return process_lost(error, f"{self.subject} ({phase}: not there within {EXCHANGE_TIMEOUT_S:.0f} s, or reported "
                        f"gone)", self.left)

  def barrier(self, name, phase):
    """Waits for every process at barrier `name`."""
    try:
      _compat.coordination_barrier(name, EXCHANGE_TIMEOUT_S)
    except (tf.errors.OpError, RuntimeError, ValueError) as e:
      raise self._lost(e, phase) from e

  def publish(self, key, value, phase):
    """Stores `value` under `key` for the other processes (the store is process 0's: its loss is named)."""
    try:
      _compat.config_key_value_set(key, value)
    except (tf.errors.OpError, RuntimeError, ValueError) as e:
      raise self._lost(e, phase) from e

  def lookup(self, key, process, phase):
    """The value process `process` stores under `key`, polled (a lookup TF keeps waiting on when that process
    dies) with a health check of the process between polls."""
    deadline = time.monotonic() + EXCHANGE_TIMEOUT_S
    while True:
      try:
        return _compat.config_key_value_get(key, min(POLL_S, max(deadline - time.monotonic(), 0.001)))
      except tf.errors.DeadlineExceededError as e:
        if time.monotonic() >= deadline:
          raise self._lost(e, phase) from e
        try:
          _compat.check_peer(task_name(process), POLL_S)
        except (tf.errors.OpError, RuntimeError, ValueError) as gone:
          said = str(gone).splitlines()[0] if str(gone) else ""
          raise self._lost(RuntimeError(f"{task_name(process)} does not answer: {type(gone).__name__}: {said}"),
                           phase) from gone
      except (tf.errors.OpError, RuntimeError, ValueError) as e:
        raise self._lost(e, phase) from e


def task_name(k):
  """The task name of process `k` ("/job:worker/replica:0/task:1")."""
  if not _state["tasks"]:
    return "/job:localhost/replica:0/task:0"
  job, task = _state["tasks"][k]
  return f"/job:{job}/replica:0/task:{task}"


def host_device():
  """This process's CPU (where it reads and writes files)."""
  if not _state["tasks"]:
    return "/device:CPU:0"
  return f"/job:{_state['job']}/replica:0/task:{_state['task']}/device:CPU:0"


def local_devices(mesh):
  """The devices of `mesh` this process drives (all of them unless the mesh spans several processes)."""
  if not callable(getattr(mesh, "resolve_devices", None)):
    raise MeshError(f"gs.local_devices({mesh!r}): give a gs.Mesh")
  return tuple(d for d in mesh.resolve_devices() if is_local(d))


_PRESENT = set()   # device tuples runnable_devices found in this process (devices never disappear)


def runnable_devices(mesh):
  """`mesh.resolve_devices()`, checked against the devices TensorFlow has: the devices a program on `mesh` runs on
  now. Raises MeshError naming the devices this process should drive but does not have (e.g. GPUs on a machine
  without them); a mesh of absent devices can still be planned (`lower`)."""
  devices = mesh.resolve_devices()
  if devices in _PRESENT:
    return devices
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  have = {_device_name(d) for d in tf.config.list_logical_devices()}
  missing = [d for d in devices if is_local(d) and d not in have]
  if missing:
    counts = {}
    for d in have:
      kind = tf.DeviceSpec.from_string(d).device_type
      counts[kind] = counts.get(kind, 0) + 1
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    raise MeshError(f"{mesh} is over devices this process does not have: {missing[0]!r}{more} (it has "
                    f"{', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}); build the mesh over devices this "
                    "machine has (gs.Mesh without devices= picks them), or plan for absent ones with f.lower(...)")
  _PRESENT.add(devices)
  return devices


def split_cpu_devices(n, intra_op_threads=None):
  """Splits the host CPU into `n` logical devices (call before TensorFlow runs anything).

  Lets a mesh of `n` devices run on one machine without accelerators. Returns the logical CPU names.
  The devices' programs run concurrently, one thread each, and share TF's pool of intra-op threads (the
  threads one op splits its work over); unless the process already chose its size
  (`tf.config.threading.set_intra_op_parallelism_threads`), it is set to `intra_op_threads`, by default the
  cores per device (at least 1): with more devices than cores, an op that splits its work over the pool only
  waits for threads the other devices keep busy.
  Raises MeshError when `n` (or `intra_op_threads`) is not a whole number of 1 or more -- TensorFlow would take 0 as
  "no CPU device" and fail later, elsewhere -- or when TensorFlow has already initialised with fewer devices.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  n = count(n, "n", "gs.split_cpu_devices(n) splits the host CPU into n logical devices: give 1 or more (e.g. 8 "
            "for a mesh of 8 devices)")
  if intra_op_threads is not None:
    intra_op_threads = count(intra_op_threads, "intra_op_threads", "give the threads one op may split its work "
                             "over (1 or more), or None for the cores per device")
  _configure_cpu_devices(n, intra_op_threads)
  names = [d.name for d in tf.config.list_logical_devices("CPU") if is_local(d.name)]
  if len(names) < n:
    raise MeshError(f"TensorFlow already started with {len(names)} CPU device(s); call split_cpu_devices({n}) "
                    "before running any TensorFlow op")
  return names


def _configure_cpu_devices(n, intra_op_threads=None):
  """Asks for `n` logical CPUs and sizes the intra-op pool (without starting TF; ignored once it has started)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  try:
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
  except RuntimeError:
    pass
  if intra_op_threads is None:
    if tf.config.threading.get_intra_op_parallelism_threads():
      return   # the process chose it
    intra_op_threads = max(1, len(os.sched_getaffinity(0)) // max(n, 1))
  try:
    tf.config.threading.set_intra_op_parallelism_threads(int(intra_op_threads))
  except RuntimeError:
    pass
