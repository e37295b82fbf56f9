"""Checkpoints of a mesh that spans several processes: one standard TF checkpoint, written by every process.

Every process calls the same `tf.train.Checkpoint.write` / `save` / `CheckpointManager.save` with the same path.
When what is saved includes a variable stored over several processes, the save is shared:

  1. every process publishes the path it saves to; all must agree (else every process raises InputError);
  2. each process writes the distinct tiles whose lowest device is its own (and nothing else) with SaveV2 as a
     part under `<path>_temp/`; the chief's part is TF's own save, with the object graph and every value that
     is not split over processes (replicated values, plain variables, Python state);
  3. barrier; the chief merges the parts into `<path>` (MergeV2Checkpoints, which also removes `<path>_temp`);
  4. barrier: the checkpoint exists before any process's save returns.

No process gathers a variable or writes a tile another process writes. A process that dies before a barrier
makes the others raise ProcessLostError naming it; until the merge completes `<path>` does not exist, so the
previous checkpoint (and CheckpointManager's record of it) stays what a restore finds.
"""

import itertools
import re
import threading

import tensorflow as tf

from tf_gspmd import _cluster
from tf_gspmd import _compat
from tf_gspmd.errors import InputError, ProcessLostError

# Seconds a process waits at a checkpoint barrier for the others (a lost process is usually reported sooner, by
# the cluster's heartbeat).
BARRIER_TIMEOUT_S = 600.0

_saves = itertools.count()
_lock = threading.Lock()
_TASK = re.compile(r"/job:[A-Za-z0-9_]+/replica:\d+/task:\d+")


_pending = threading.local()

# The last shared save of this process: its path, this process's part and the bytes of tensor data it wrote.
last_save = {}


def _data_bytes(part):
  return sum(tf.io.gfile.stat(f).length for f in tf.io.gfile.glob(f"{part}.data-*"))


def note_split_variable():
  """Called as a variable stored over several processes is collected for a save (this process may write none of
  its tiles, and then nothing in the save shows it): the next save of this thread is a shared one."""
  _pending.count = getattr(_pending, "count", 0) + 1


def _spans_processes(obj, storage_of):
  storage = storage_of(obj)
  return storage is not None and len(storage.positions) < len(storage.devices)


def _lost(error, phase, path):
  """A failed barrier or lookup as ProcessLostError naming the process that did not arrive (when TF says)."""
  message = str(getattr(error, "message", error))
  named = [m.group(0) for m in _TASK.finditer(message) if not _cluster.is_local(m.group(0))]
  who = (f"task {named[0]} (process {_cluster.process_of(named[0])})" if named
         else "a process of the cluster")
  return ProcessLostError(f"{who} stopped answering during the checkpoint save of {path!r} ({phase}: not there "
                          f"within {BARRIER_TIMEOUT_S:.0f} s, or reported gone); the checkpoint was not written and the "
                          f"previous one is the latest: restart every process (the training binaries continue with "
                          f"--resume). TF said: {type(error).__name__}: {message.splitlines()[0][:300] if message else ''}")


def _barrier(name, phase, path):
  try:
    _compat.coordination_barrier(name, BARRIER_TIMEOUT_S)
  except (tf.errors.OpError, RuntimeError, ValueError) as e:
    raise _lost(e, phase, path) from e


def _get(key, phase, path):
  try:
    return _compat.config_key_value_get(key, BARRIER_TIMEOUT_S)
  except (tf.errors.OpError, RuntimeError, ValueError) as e:
    raise _lost(e, phase, path) from e


def save_hook(storage_of):
  """The checkpoint save hook (see the module docstring); `storage_of(obj)` is the sharded storage of a saved
  object or None."""

  def hook(saver, save, file_prefix, options):
    if not (_cluster.is_multi_process() and tf.executing_eagerly()):
      return save(saver, file_prefix, options)
    values = _compat.checkpoint_saver_tensors(saver)
    noted, _pending.count = getattr(_pending, "count", 0), 0
    if not noted and not any(_spans_processes(obj, storage_of) for _, _, obj, _ in values):
      return save(saver, file_prefix, options)
    path = file_prefix.numpy().decode() if isinstance(file_prefix, tf.Tensor) else str(file_prefix)
    k, n = _cluster.process_index(), _cluster.process_count()
    with _lock:
      seq = next(_saves)
    tag = f"tf_gspmd_checkpoint_{seq}"
    _compat.config_key_value_set(f"{tag}/path/{k}", path)
    paths = [_get(f"{tag}/path/{j}", "publishing its path", path) for j in range(n)]
    if len(set(paths)) > 1:
      raise InputError(f"the processes save one checkpoint to different paths ({dict(enumerate(paths))}): every "
                       f"process must call the same save with the same path (process 0 writes the merged "
                       f"checkpoint); give them one directory")
    part = f"{path}_temp/gspmd-part-{k:05d}-of-{n:05d}"
    tf.io.gfile.makedirs(f"{path}_temp")
    result = None
    if k == 0:
      result = save(saver, tf.constant(part), options)   # the object graph, unsplit values, the chief's tiles
      wrote = True
    else:
      mine = [(key, spec, read) for key, spec, obj, read in values if _spans_processes(obj, storage_of)]
      wrote = bool(mine)
      if wrote:
        with tf.device(_cluster.host_device()):
          tf.raw_ops.SaveV2(prefix=part, tensor_names=[m[0] for m in mine], shape_and_slices=[m[1] for m in mine],
                            tensors=[m[2]() for m in mine])
    last_save.update(path=path, part=part if wrote else None,
                     bytes_written=_data_bytes(part) if wrote else 0)
    _compat.config_key_value_set(f"{tag}/part/{k}", part if wrote else "")
    _barrier(f"{tag}/written", "writing its part", path)
    if k == 0:
      parts = [p for p in (_get(f"{tag}/part/{j}", "writing its part", path) for j in range(n)) if p]
      with tf.device(_cluster.host_device()):
        tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts, destination_prefix=path, delete_old_dirs=True)
    _barrier(f"{tag}/merged", "waiting for the merge", path)
    return result

  return hook
