"""What a rule may use: the node it is asked about and the context a pass hands it, as Protocols.

A rule (ops/registry.py) is called by two passes that live a floor above ops/: completion calls `forward` and
`backward` with a `CompletionContext`, partitioning calls `partition` (and the helpers it calls) with a
`PartitionContext`; both hand over the node as a `NodeView`. The rewriter implements these Protocols
(rewriter/graph_ir.Node, rewriter/completion.CompletionContext, rewriter/partition.PartitionContext, whose
`backend` is a rewriter/collectives.Backend); ops/ never imports them. tests/op_rules/test_context.py fails
when a rule uses a member these Protocols do not declare, and when an implementation lacks a declared one.

Shardings are tf_gspmd._layout.sharding.Sharding values, meshes tf_gspmd._layout.mesh.Mesh values (the core floor);
tensors are the tf.Tensor values of the per-device graph being built; `r` names a tensor of the global graph
("op:index"); `i` is an input index and `o` an output index of the node.
"""

from typing import Any, Callable, ContextManager, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from tf_gspmd._layout.mesh import Mesh
from tf_gspmd._layout.sharding import Sharding


@runtime_checkable
class TensorInfo(Protocol):
  """Static facts of one tensor of the global graph."""

  shape: Optional[Tuple[int, ...]]       # None: unknown rank
  dtype: Any                             # tf.DType
  value_shape: Optional[Tuple[int, ...]]   # a variable handle's value shape, a TensorList's element shape
  value_dtype: Any

  @property
  def partitionable(self) -> bool: ...   # False for resources, variants, strings and unknown ranks

  @property
  def is_list(self) -> bool: ...

  @property
  def sharding_rank(self) -> Optional[int]: ...


@runtime_checkable
class NodeView(Protocol):
  """One node of the global graph, as rules see it."""

  name: str
  op: str                                # the TF op type
  inputs: Tuple[str, ...]                # the tensors it reads ("op:index")
  outputs: Tuple[str, ...]               # the tensors it produces
  memo: Dict[str, Any]                   # facts a rule derives once per node (e.g. its factors)

  def attr(self, key: str, default: Any = None) -> Any: ...   # an attribute as a Python value

  def ref(self, index: int = 0) -> str: ...                   # the name of output `index`

  def input_info(self, i: int) -> TensorInfo: ...

  def input_shape(self, i: int) -> Optional[Tuple[int, ...]]: ...

  def const_input(self, i: int) -> Any: ...                   # input i's value when it is a constant, else None


@runtime_checkable
class CompletionContext(Protocol):
  """What `forward` and `backward` see besides the node: the program being completed."""

  mesh: Mesh

  def complete_function(self, fname: str, arg_shapes: Sequence[Any], param_shardings: Sequence[Optional[Sharding]],
                        out_shardings: Optional[Sequence[Optional[Sharding]]] = None) -> Any:
    """The completed program of function body `fname` (a While body, an If branch) for these layouts; its
    `param_shardings`, `output_shardings` and `shardings` are what control-flow rules read."""


@runtime_checkable
class Collectives(Protocol):
  """The collectives a rule may emit itself (most reach them through `operand` and `set_output`'s reshards).
  `source` names the node that needs the collective and `reason` says why, for the report."""

  def all_reduce(self, x: Any, axes: Sequence[str], op: str, source: str, reason: str) -> Any: ...

  def all_gather(self, x: Any, dim: int, axes: Sequence[str], source: str, reason: str) -> Any: ...

  def collective_permute(self, x: Any, axes: Sequence[str], pairs: Any = None, shift: Optional[int] = None,
                         cyclic: bool = False, fill: Any = 0, source: str = "", reason: str = "") -> Any:
    """Each member's `x` sent to another member of its group: along `axes` by `shift` positions (`cyclic`: wrapping
    around), or by explicit (from, to) `pairs`; members that receive nothing get `fill`."""


@runtime_checkable
class PartitionContext(Protocol):
  """What `partition` sees besides the node: the per-device graph being built and the node's place in it."""

  mesh: Mesh
  pid: Any                               # the partition id (scalar int32 tensor) of the device running the program
  backend: Collectives

  # ---- the node's layouts -----------------------------------------------------------------------------------
  def planned_axes(self) -> Tuple[str, ...]: ...   # mesh axes the node's completed layouts use

  def target(self, o: int) -> Sharding: ...        # the completed layout of output o

  def current(self, i: int) -> Optional[Sharding]: ...   # the layout input i has in the per-device graph now

  def input_shape(self, i: int) -> Optional[Tuple[int, ...]]: ...

  def input_dtype(self, i: int) -> Any: ...

  def local_shape(self, i: int, sharding: Sharding) -> Optional[Tuple[int, ...]]: ...   # input i's shard shape

  def used(self, r: str) -> bool: ...              # whether tensor r is read (by a node or as an output)

  # ---- operands and results ---------------------------------------------------------------------------------
  def operand(self, i: int, sharding: Sharding) -> Any: ...   # input i resharded to `sharding`, as a local tensor

  def operand_cost(self, i: int, sharding: Sharding) -> float: ...   # bytes that resharding would send

  def output_cost(self, o: int, natural: Sharding, partial: Any = None) -> float: ...

  def set_output(self, o: int, value: Any, natural: Sharding, partial: Any = None) -> None:
    """Output o is `value`, laid out as `natural` (with `partial` sums pending over those axes); resharded to the
    target layout when they differ."""

  def parameter(self, node: NodeView) -> None: ...   # the node is an argument of the program

  # ---- building ops -----------------------------------------------------------------------------------------
  def clone(self, node: NodeView, inputs: Any, op_type: Optional[str] = None, attrs: Optional[Dict[str, Any]] = None,
            extra_inputs: Sequence[Any] = (), extra_dtypes: Sequence[Any] = ()) -> List[Any]:
    """The node's op rebuilt on local `inputs` (a list, or {input index: tensor} over the originals); its
    outputs."""

  def identity(self, x: Any) -> Any: ...

  def helper_scope(self) -> ContextManager[Any]: ...   # ops a rule builds by hand go inside it

  def after_control_inputs(self) -> ContextManager[Any]: ...   # ... and, for a side effect, inside this too

  def record(self, op: Any) -> None: ...           # the op that stands for the node when built by hand

  def partition_function(self, fname: str, arg_shapes: Sequence[Any], param_shardings: Sequence[Any],
                         out_shardings: Sequence[Any], return_pid: bool = False, loop: Optional[str] = None) -> str:
    """The per-device function of body `fname`; `loop` ("body" or "cond") when it is that part of the node's
    While (the report counts its collectives per iteration)."""

  def partition_loop_body(self, body: str, cond: str, arg_shapes: Sequence[Any],
                          shardings: Sequence[Any]) -> Tuple[str, Dict[int, Any]]:
    """The per-device body of the node's While (loop variables laid out as `shardings`) and {k: partial}: the
    accumulators carried with their sum pending (each iteration only adds to them), to be reduced after the
    loop."""

  def one_term(self, x: Any, axes: Sequence[str]) -> Any: ...   # x as a sum pending over `axes` (x on one device)

  def lookup(self, table: Any, name: str) -> Any: ...   # this device's row of a per-device numpy table

  def mask(self, x: Any, shape: Sequence[int], sharding: Sharding, dim: int, value: Any) -> Any:
    """`x` (a shard of a tensor of global `shape`) with the padding past the end of `dim` set to `value`."""

  def warn(self, message: str) -> None: ...        # a line in the report's warnings

  # ---- windows (ops/windows.py plans them; these emit) ------------------------------------------------------
  def window(self, i: int, sharding: Sharding, dim: int, out_size: int, start: int, fill: Any, stride: int = 1,
             size: int = 1) -> Any: ...

  def window_fits(self, i: int, sharding: Sharding, dim: int, out_size: int, start: int, stride: int = 1,
                  size: int = 1) -> bool: ...

  def window_bytes(self, i: int, sharding: Sharding, dim: int, out_size: int, start: int, stride: int = 1,
                   size: int = 1) -> Optional[int]: ...

  def window_rows(self, i: int, sharding: Sharding, dim: int, first: Any, length: int, lo: Any, hi: Any,
                  fill: Any) -> Any: ...

  def window_rows_fit(self, i: int, sharding: Sharding, dim: int, first: Any, length: int, lo: Any,
                      hi: Any) -> bool: ...

  def rows_read(self, i: int, sharding: Sharding, dim: int, out_size: int, start: int, stride: int = 1,
                size: int = 1) -> Any: ...   # the windows.Rows of input i a result split like `sharding` reads

  def windows(self, i: int, sharding: Sharding, reads: Any, fill: Any) -> Any: ...   # along several dims at once

  def windows_fit(self, i: int, sharding: Sharding, reads: Any) -> bool: ...

  def take_rows(self, x: Any, sharding: Sharding, dim: int, begin: Any, count: int) -> Any: ...

  def defer(self, shift: Any, emit: Callable[[], None], readers: Any) -> bool:
    """Leave output 0 unemitted for its one reader (of a type in `readers`) to fold into its window (a
    windows.Shift); `emit()` builds it when something else reads it. Whether it was deferred."""


CONTEXTS: Tuple[Tuple[str, Any], ...] = (("completion", CompletionContext), ("partition", PartitionContext))
# The rule methods completion calls (with a CompletionContext); every other function of ops/ that takes `ctx` is
# reached from `partition` (a PartitionContext) or from both.
COMPLETION_METHODS = frozenset({"forward", "backward"})
