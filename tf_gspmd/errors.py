"""Typed errors raised by tf_gspmd.

Every error names what is wrong (the tensor or node, the dimension, the mesh axis) and how to fix it.
"""


class ShardingError(ValueError):
  """Base class of all tf_gspmd errors about shardings, meshes and programs.

  Attributes:
    message: what is wrong and how to fix it (the text without the node prefix).
    node: name of the graph node or tensor the error is about, when known.
    op_type: TF op type of that node, when known.
  """

  # Raised while a tf.function traces: AutoGraph must let it through unchanged (type and message).
  ag_pass_through = True

  def __init__(self, message, node=None, op_type=None):
    self.message = message
    self.node = node
    self.op_type = op_type
    where = ""
    if node is not None:
      where = f"[{node}{' (' + op_type + ')' if op_type else ''}] "
    super().__init__(where + message)


class MeshError(ShardingError):
  """A mesh is malformed or cannot be placed on the available devices."""


class SpecError(ShardingError):
  """A partition spec, dims_mapping or OpSharding does not fit its tensor or mesh."""


class ShapeError(ShardingError):
  """A tensor has a shape tf_gspmd cannot partition (for example a dynamic one)."""


class UnsupportedOpError(ShardingError):
  """An op has no partitioning rule and strict mode forbids the replicated fallback."""


class PartitionError(ShardingError):
  """The partitioner or a verifier found an inconsistency in the per-device program."""



class GpuFormError(PartitionError):
  """The GPU form of a program (gs.gpu_form) would not compile on GPUs or could hang there."""

class InputError(ShardingError):
  """A gs.function's arguments do not match its declaration, or it is given or returns a value it cannot
  carry (e.g. a split string argument, a SparseTensor result)."""


class ClusterJoinError(MeshError):
  """`gs.initialize` could not join the cluster: a task of it did not start (or could not be reached) within
  `join_timeout`. Attributes: `missing`, the names of the tasks that did not connect (when known)."""

  def __init__(self, message, missing=(), node=None):
    self.missing = tuple(missing)
    super().__init__(message, node=node)


class ProcessLostError(ShardingError):
  """Another process of a mesh that spans several processes stopped answering during a step (it died, hung or
  lost its network); the step's collectives were aborted. Restart every process (e.g. with --resume)."""


class AutoShardingError(ShardingError):
  """Automatic sharding found no plan: the memory budget is below what any layout needs, or no solver."""
