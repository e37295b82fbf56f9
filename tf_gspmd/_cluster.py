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

import os
import threading

from tf_gspmd import _compat
from tf_gspmd._mesh import JOB_ORDER
from tf_gspmd.errors import MeshError

DEVICES_ENV = "TF_GSPMD_CPU_DEVICES_PER_PROCESS"   # logical CPUs per process, from the launcher
_lock = threading.Lock()
_state = {"job": None, "task": None, "tasks": None}


def initialize(cluster_resolver=None, *, cpu_devices=None, heartbeat_timeout=30.0, join_timeout=120.0):
  """Joins this process to its cluster (call once, before TensorFlow runs anything).

  Args:
    cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`; default: `TFConfigClusterResolver`
      (the `TF_CONFIG` environment variable). Its tasks of jobs "chief" and "worker" are the processes.
    cpu_devices: when given, the CPU is split into logical devices so that the whole cluster has this many
      (each of the P processes gets cpu_devices / P): the same program runs on 1 process x 8 devices or on
      2 x 4 with `cpu_devices=8`.
    heartbeat_timeout: seconds after which the cluster declares a silent process lost (its peers' collectives
      then fail naming it instead of waiting for the collective deadline).
    join_timeout: seconds to wait for every process to start.

  Returns:
    (process index, process count).
  """
  import os  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  per_process = os.environ.get(DEVICES_ENV)
  if cluster_resolver is None:
    cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  spec = cluster_resolver.cluster_spec()
  jobs = spec.jobs
  other = [j for j in jobs if j not in JOB_ORDER]
  if other:
    raise MeshError(f"the cluster has jobs {other}; tf_gspmd runs one SPMD program on the tasks of jobs "
                    f"{list(JOB_ORDER)} (no parameter servers or evaluators): remove them from the cluster spec")
  tasks = tuple((j, i) for j in JOB_ORDER if j in jobs for i in sorted(spec.task_indices(j)))
  if per_process:   # set by the launcher (python -m tf_gspmd.launch --devices_per_worker)
    if cpu_devices and int(per_process) * max(len(tasks), 1) != cpu_devices:
      raise MeshError(f"the program asks for cpu_devices={cpu_devices} in all, but it was launched with "
                      f"{per_process} devices for each of {max(len(tasks), 1)} processes; make them agree")
    cpu_devices = int(per_process) * max(len(tasks), 1)
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
    try:
      _compat.enable_cluster_collectives(spec, job, task, leader, heartbeat_timeout)
      _compat.coordination_barrier("tf_gspmd_initialize", join_timeout)
    except (RuntimeError, ValueError, tf.errors.OpError) as e:
      raise MeshError(f"task {job}:{task} could not join the cluster {spec.as_dict()}: {e}") from e
    _state.update(job=job, task=task, tasks=tasks)
    return tasks.index((job, task)), len(tasks)


def process_count():
  return len(_state["tasks"]) if _state["tasks"] else 1


def process_index():
  return _state["tasks"].index((_state["job"], _state["task"])) if _state["tasks"] else 0


def is_multi_process():
  return process_count() > 1


def _task_of(name):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  spec = tf.DeviceSpec.from_string(name)
  return spec.job, spec.task or 0


def is_local(device):
  """Whether device name `device` belongs to this process."""
  if not _state["tasks"]:
    return True
  return _task_of(device) == (_state["job"], _state["task"])


def process_of(device):
  """The index of the process that drives device name `device`."""
  if not _state["tasks"]:
    return 0
  return _state["tasks"].index(_task_of(device))


def host_device():
  """This process's CPU (where it reads and writes files)."""
  if not _state["tasks"]:
    return "/device:CPU:0"
  return f"/job:{_state['job']}/replica:0/task:{_state['task']}/device:CPU:0"


def local_devices(mesh):
  """The devices of `mesh` this process drives (all of them unless the mesh spans several processes)."""
  return tuple(d for d in mesh.resolve_devices() if is_local(d))


def split_cpu_devices(n, intra_op_threads=None):
  """Splits the host CPU into `n` logical devices (call before TensorFlow runs anything).

  Lets a mesh of `n` devices run on one machine without accelerators. Returns the logical CPU names.
  The devices' programs run concurrently, one thread each, and share TF's pool of intra-op threads (the
  threads one op splits its work over); unless the process already chose its size
  (`tf.config.threading.set_intra_op_parallelism_threads`), it is set to `intra_op_threads`, by default the
  cores per device (at least 1): with more devices than cores, an op that splits its work over the pool only
  waits for threads the other devices keep busy.
  Raises MeshError when TensorFlow has already initialised with a different number of devices.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
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
