"""tf_gspmd: GSPMD sharding completion and SPMD partitioning for TensorFlow.

Annotate a few tensors of a function with shardings over a device mesh; tf_gspmd completes the shardings
of every other tensor, rewrites the graph into one per-device program with TF collectives, and runs it on
every device of the mesh.

Example:
  >>> import tf_gspmd as gs
  >>> mesh = gs.Mesh((2, 4), ("data", "model"))
  >>> @gs.function(mesh=mesh, in_shardings=(gs.P("data", None), gs.P(None, "model")))
  ... def f(x, w):
  ...   return tf.nn.relu(x @ w)
"""

from tf_gspmd import initializers
from tf_gspmd import tpu
from tf_gspmd._layout.annotations import mesh_split, replicate, shard
from tf_gspmd._function import Lowered, ShardedFunction, function
from tf_gspmd._platform.cluster import (initialize, is_local, local_devices, process_count, process_index,
                                        split_cpu_devices)
from tf_gspmd._layout.mesh import Mesh, P
from tf_gspmd._parallel.mpmd import MpmdPipeline, RunRecord, Stage, mpmd_pipeline, schedule_order
from tf_gspmd._parallel.pipeline import pipeline, stack_stages, unstack_stages
from tf_gspmd._layout.plan_scope import plan_scope
from tf_gspmd._layout.sharding import Sharding
from tf_gspmd._parallel.stages import plan_stages
from tf_gspmd._parallel.auto_parallel import AutoParallel, auto_parallel
from tf_gspmd._gpu_form import GpuForm, gpu_form
from tf_gspmd._explore import explore
from tf_gspmd._visualize import visualize_sharding
from tf_gspmd.errors import (AutoShardingError, ClusterJoinError, GpuFormError, InputError, MeshError, PartitionError,
                             ProcessLostError, ShapeError, ShardingError, SpecError, UnsupportedOpError)
from tf_gspmd.runtime.cross_mesh import Transfer, TransferLog, plan_transfer, reshard, value_elsewhere, wait_for_sends
from tf_gspmd.runtime.sharded_tensor import ShardedTensor, from_process_local_data
from tf_gspmd.runtime.shards import Shard, shards_of
from tf_gspmd.runtime.create import variable
from tf_gspmd.runtime.state import sharding_of

tpu_mesh = tpu.mesh

__all__ = [
    "Mesh", "P", "Sharding", "split_cpu_devices", "initialize", "process_count", "process_index", "is_local", "local_devices", "mesh_split", "shard", "replicate", "function", "ShardedFunction",
    "Lowered", "ShardedTensor", "plan_scope", "pipeline", "stack_stages", "unstack_stages", "plan_stages", "auto_parallel", "AutoParallel",
    "from_process_local_data", "sharding_of", "shards_of", "Shard", "variable", "initializers", "visualize_sharding", "ShardingError",
    "MeshError", "SpecError", "ShapeError", "PartitionError", "UnsupportedOpError", "InputError", "ProcessLostError", "ClusterJoinError",
    "AutoShardingError", "tpu", "tpu_mesh", "Stage", "mpmd_pipeline", "MpmdPipeline", "RunRecord", "schedule_order",
    "reshard", "plan_transfer", "Transfer", "TransferLog", "value_elsewhere", "wait_for_sends", "gpu_form", "GpuForm",
    "GpuFormError", "explore",
]
__version__ = "0.1.0"


def __getattr__(name):
  """`gs.keras` (the Keras 3 integration) is imported on first use: it needs Keras, the core does not."""
  if name == "keras":
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module("tf_gspmd.keras")
  raise AttributeError(f"module 'tf_gspmd' has no attribute {name!r}")
