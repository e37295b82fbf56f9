"""TPUs: a mesh over a slice's cores, the TPUStrategy that runs it, and gs.functions run through it.

On TPU, XLA partitions the program (TensorFlow's bridge runs XLA's SPMD partitioner under
`tf.distribute.TPUStrategy(..., experimental_spmd_xla_partitioning=True)`); tf_gspmd completes the shardings,
exports them as XLA annotations (`gs.function(..., partitioner="xla")`), orders the cores of the mesh, and builds
the device assignment and strategy that run it, XLA's partition p on mesh device p.

Example (on a TPU VM):
  >>> mesh = gs.tpu_mesh((2, 4), ("data", "model"))     # initialises this VM's TPU; cores in locality order
  >>> strategy = gs.tpu.strategy(mesh)                  # TPUStrategy(resolver, device assignment, SPMD)
  >>> step = gs.function(f, mesh=mesh, in_shardings=(P("data", None), P(None, "model")), partitioner="xla")
  >>> out = gs.tpu.run(step, x, w)                      # strategy.run of the exported program; global results

Without a TPU: `gs.tpu.simulated_topology((4, 4, 1, 2))` stands for a v3-32's topology, and
`gs.tpu_mesh(..., topology=...)`, `gs.tpu.device_assignment`, `gs.tpu.partitions`, `f.lower(...)` plan for it.
"""

import tensorflow as tf

from tf_gspmd._layout.mesh import Mesh as _Mesh
from tf_gspmd.errors import InputError
from tf_gspmd.runtime import tpu as _tpu
from tf_gspmd.runtime.tpu import (AnnotatedProgram, Partition, Runner, annotated_program, core_order,  # noqa: F401
                                  device_assignment, initialize, is_tpu_mesh, partitions, simulated_topology,
                                  strategy_arguments, use_strategy, xla_device_id)


def mesh(shape, axis_names, topology=None, resolver=None, job=None):
  """A `gs.Mesh` of `shape` over TPU cores, ordered so that mesh neighbours are physical neighbours
  (`core_order` states the rule).

  Args:
    shape, axis_names: as for `gs.Mesh`.
    topology: a `tf.tpu.experimental.Topology` (or its serialized proto, or a shape for `simulated_topology`);
      default: `initialize(resolver)`, which connects to and initialises the TPU system.
    resolver: a `TPUClusterResolver` (default: this TPU VM's).
    job: the TF job of the cores (default: the resolver's, else "localhost" on one host, "worker" on several).

  Raises MeshError when no topology is given and no TPU is attached (its message says how to plan without one).
  """
  _Mesh(shape, axis_names)   # a malformed shape or axis names is said before the TPU system is initialised
  if topology is None:
    topology = initialize(resolver)
  if job is None and resolver is not None:
    job = _tpu.job_of(resolver)
  return _tpu.mesh(shape, axis_names, topology, job)


def strategy(m, resolver=None, topology=None, factory=None):
  """The `tf.distribute.TPUStrategy` that runs mesh `m`'s programs (one replica, logical core p = mesh device p,
  XLA SPMD partitioning); remembered as `m`'s strategy (gs.function calls and `run` on `m` use it)."""
  s = _tpu.strategy(m, resolver=resolver, topology=topology, factory=factory)
  use_strategy(m, s)
  return s


def program(f, *args):
  """The AnnotatedProgram of gs.function `f` for `args` (arrays or TensorSpecs): its export when `f` has
  partitioner="xla", else `f`'s Python function with the completed argument and result shardings annotated
  (and its own annotations; XLA completes the rest). Returns (program, lowering)."""
  specs = tuple(a if isinstance(a, tf.TensorSpec) else tf.TensorSpec(tf.convert_to_tensor(a).shape,
                                                                      tf.convert_to_tensor(a).dtype) for a in args)
  if not hasattr(f, "lower") or not hasattr(f, "mesh"):
    raise InputError(f"expected a gs.function; got {f!r}")
  low = f.lower(*specs)
  if getattr(low.program, "exported", None) is not None:
    return _tpu.from_exported(low.exported, f.mesh), low
  return annotated_program(f.fn, f.mesh, tuple(low.in_shardings), tuple(low.out_shardings)), low


def run(f, *args, strategy=None):  # pylint: disable=redefined-outer-name
  """Runs gs.function `f` (or an AnnotatedProgram) on `args` (global values) through `strategy`, default its
  mesh's (`gs.tpu.strategy(mesh)`, else one built now); returns the results as global values."""
  if isinstance(f, AnnotatedProgram):
    return _tpu.run(f, *args, strategy_=strategy)
  prog, low = program(f, *args)
  out = _tpu.run(prog, *args, strategy_=strategy)
  if getattr(low.program, "exported", None) is None:
    return out   # f's own function, annotated: its own result structure
  flat = list(out)   # the export's flat results
  return tf.nest.map_structure(lambda k: None if k is None else flat[k], low.program.output_structure)
