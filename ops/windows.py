"""Windows along a split dim: the geometry of 2-D convolutions and pooling, the halo plan, and the rule the
windowed ops share.

A result row of a windowed op reads a run of input rows: a slice, pad or concat one row per result row, a
convolution or pooling window its dilated size at its stride. With the result split along that dim, each
device computes its rows of the result from its own input rows plus halo rows from its neighbours (GSPMD's
windowed input); with several spatial dims split, one dim after the other. Nothing here emits a window; it is what the emitters compute from:
- `WindowDim`, `geometry`: per spatial dim of a 2-D NHWC convolution or pooling (forward or a gradient), the
  input rows each result row reads;
- `rows_read_by`, `plan_halo` (a `HaloPlan`): per device, the input rows its window reads, the layout the input
  is read in, and the halo rows it takes from each neighbour. `PartitionContext.window_rows` emits the plan:
  `Backend.halo_exchange` moves the halos, then each device cuts its window at its offset (`take_bounds`);
- `Shift`: a pad or slice along the split dim left unemitted, whose readers' windows read its operand (one
  halo exchange for both ops; `PartitionContext.defer`);
- `WindowedRule`: the rules of those ops, whose `partition` is their shared prologue (geometry, the split
  spatial dims, the mesh axes left for batch and channels, the gathered fallback) before the op's own emission.
"""

import dataclasses
import math
from typing import Any, Dict, NamedTuple, Tuple

import numpy as np

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops.factors import FactorRule

# The ops whose split spatial dims take halos: 2-D and 3-D convolutions and pooling, forward and gradients
# (channels last), with the rank of their activations.
WINDOWED = {**dict.fromkeys(("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "MaxPool", "AvgPool",
                             "MaxPoolGrad", "AvgPoolGrad"), 4),
            **dict.fromkeys(("Conv3D", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "MaxPool3D", "AvgPool3D",
                             "MaxPool3DGrad", "AvgPool3DGrad"), 5)}
_IMAGE_OUT = ("Conv2DBackpropInput", "AvgPoolGrad", "Conv3DBackpropInputV2", "AvgPool3DGrad")   # d_in is the result
_FORWARD = ("Conv2D", "MaxPool", "AvgPool", "Conv3D", "MaxPool3D", "AvgPool3D")


def attr_text(node, name, default):
  """The string attr `name` of `node` (decoded), or `default` when it is absent or empty."""
  v = node.attr(name)
  v = v.decode() if isinstance(v, bytes) else v
  return v or default


# ---- geometry -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WindowDim:
  """One spatial dim of a windowed op: result row o reads input rows [o*stride - lo, o*stride - lo + window)."""

  size: int      # input rows
  out: int       # result rows
  window: int    # the dilated window: (taps - 1) * dilation + 1
  stride: int
  lo: int        # padding before
  hi: int        # padding after (VALID's unread tail counts 0, not negative)
  taps: int

  def count(self, o):
    """Input rows (not padding) in the windows of results `o` (0 for results outside the result)."""
    start = np.asarray(o) * self.stride - self.lo
    n = np.minimum(start + self.window, self.size) - np.maximum(start, 0)
    return np.where((np.asarray(o) >= 0) & (np.asarray(o) < self.out), np.maximum(n, 0), 0)

  def reaching(self, n):
    """For a gradient of the input split in n shards: per shard index t (rows [t*c, (t+1)*c)), the result rows
    whose windows reach its rows: (first[t], how many (the same for all), rows that matter [lo[t], hi[t]),
    c). Those results' windows start at input row first*stride - self.lo."""
    c = -(-self.size // n)
    own = np.arange(n) * c
    first = -((self.window - 1 - own - self.lo) // self.stride)   # ceil((own + lo - window + 1) / stride)
    last = (own + c - 1 + self.lo) // self.stride
    count = max(1, int(np.max(last - first + 1)))
    end = np.minimum(own + c, self.size)
    lo = np.clip(first, 0, self.out)
    hi = np.where(end > own, np.clip((end - 1 + self.lo) // self.stride + 1, 0, self.out), lo)
    return first, count, lo, np.maximum(hi, lo), c

  def rows_read(self, first, count, lo, hi):
    """The input rows results [first, first+count) read: (first row, how many, rows that matter), where the
    results that matter are [lo, hi)."""
    start = first * self.stride - self.lo
    r_lo = np.clip(lo * self.stride - self.lo, 0, self.size)
    r_hi = np.where(hi > lo, np.clip((hi - 1) * self.stride - self.lo + self.window, 0, self.size), r_lo)
    return start, (count - 1) * self.stride + self.window, r_lo, np.maximum(r_hi, r_lo)


def _known(shape, rank=4):
  return shape is not None and len(shape) == rank and all(isinstance(v, (int, np.integer)) and v >= 0 for v in shape)


def geometry(node):
  """{spatial dim: WindowDim} of a 2-D (NHWC) or 3-D (NDHWC) convolution or pooling (forward or a gradient), or
  None (other layouts, unknown shapes)."""
  op = node.op
  rank = WINDOWED.get(op)
  if rank is None or attr_text(node, "data_format", "NHWC" if rank == 4 else "NDHWC") not in ("NHWC", "NDHWC"):
    return None
  image = node.outputs[0].shape if op in _IMAGE_OUT else node.input_shape(0)
  if op in _FORWARD:
    result = node.outputs[0].shape
  else:   # a gradient: d_out is input 2 of a conv gradient, input 1 of a pool gradient
    result = node.input_shape(2 if op.startswith("Conv") else 1)
  if op.startswith("Conv"):
    kernel = node.outputs[0].shape if op.startswith("Conv") and "Filter" in op else node.input_shape(1)
    if not _known(kernel, rank):
      return None
    kernel = [1] + list(kernel[:rank - 2]) + [1]
    dilations = list(node.attr("dilations").i) if node.attr("dilations") is not None else [1] * rank
  else:
    kernel = list(node.attr("ksize").i)
    dilations = [1] * rank
  strides = list(node.attr("strides").i)
  last = rank - 1
  if not (_known(image, rank) and _known(result, rank)) or len(kernel) != rank or len(strides) != rank or \
      len(dilations) != rank or kernel[0] != 1 or kernel[last] != 1 or strides[0] != 1 or strides[last] != 1 or \
      dilations[0] != 1 or dilations[last] != 1:
    return None
  padding = attr_text(node, "padding", "VALID")
  explicit = list(node.attr("explicit_paddings").i) if node.attr("explicit_paddings") is not None else []
  dims = {}
  for d in range(1, rank - 1):
    window = (kernel[d] - 1) * dilations[d] + 1
    size, out, s = int(image[d]), int(result[d]), strides[d]
    if padding == "SAME":
      total = max((out - 1) * s + window - size, 0)
      lo, hi = total // 2, total - total // 2
    elif padding == "EXPLICIT" and len(explicit) == 8:
      lo, hi = explicit[2 * d], explicit[2 * d + 1]
    elif padding == "VALID":
      lo = hi = 0
    else:
      return None
    if (size + lo + hi - window) // s + 1 != out or out <= 0:
      return None
    dims[d] = WindowDim(size, out, window, s, lo, hi, kernel[d])
  return dims


# ---- the halo plan --------------------------------------------------------------------------------------------------
class Rows(NamedTuple):
  """The input rows each shard's window reads along one dim, indexed by shard index t: `length` rows from
  `first[t]`, of which those in [lo[t], hi[t]) matter (inside the input, and read by a result row inside the
  result); the others are selected to the window's fill."""

  first: np.ndarray
  length: int
  lo: np.ndarray
  hi: np.ndarray


def rows_read_by(in_size, n, out_size, start, stride=1, size=1):
  """The `Rows` a result of `out_size` rows split in n shards reads from an input of `in_size` rows, result
  row j reading rows [start + j*stride, start + j*stride + size). Shard t computes result rows [t*c, (t+1)*c)."""
  c = -(-out_size // n)
  t = np.arange(n)
  first = start + t * c * stride
  valid = np.clip(out_size - t * c, 0, c)
  lo = np.clip(first, 0, in_size)
  hi = np.where(valid > 0, np.clip(first + (valid - 1) * stride + size, 0, in_size), lo)
  return Rows(first, (c - 1) * stride + size, lo, np.maximum(hi, lo))


@dataclasses.dataclass(frozen=True, eq=False)
class HaloPlan:
  """How every device gets its window of an input along `dim`: the input laid out as `source`, each device's
  shard extended by the last `left` rows of its previous neighbour's shard and the first `right` rows of its
  next neighbour's (one halo exchange over `axes`; none when both are 0), then cut at a per-device offset.

  Per-device arrays are indexed by mesh position; `rows` by shard index.
  """

  shape: Tuple[int, ...]   # the input's global shape
  dim: int
  rows: Rows               # what each shard's window reads
  tiles: np.ndarray        # shard index along `dim` of each device
  own: np.ndarray          # the first row of each device's own shard
  left: int                # halo rows from the previous neighbour
  right: int               # halo rows from the next neighbour
  axes: Tuple[str, ...]    # mesh axes the halos move over (() when the input is whole along `dim`)
  source: Sharding         # the layout the input is read in

  def offsets(self):
    """Per device, where its window starts in its shard extended by the halos (int32)."""
    return (self.rows.first[self.tiles] - (self.own - self.left)).astype(np.int32)

  def valid(self):
    """Per device and window row, whether the row matters (bool [devices, length]); None when all do."""
    first, length, lo, hi = self.rows
    rows = first[self.tiles][:, None] + np.arange(length)[None, :]
    valid = (rows >= lo[self.tiles][:, None]) & (rows < hi[self.tiles][:, None])
    return None if valid.all() else valid

  def halo_elements(self):
    """Elements of the halo rows one device receives."""
    local = list(self.source.with_rank(len(self.shape)).shard_shape(self.shape))
    local[self.dim] = self.left + self.right
    return int(np.prod(local))


def plan_halo(shape, have, sharding, dim, rows):
  """The `HaloPlan` for windows `rows` (a `Rows`) along `dim` of an input of global `shape`, now laid out as
  `have` (None when unknown), for a result split like `sharding` on `dim`; None when some device needs rows
  its neighbours do not hold. Halos count only rows a device reads (in [lo, hi)). An input already whole
  along `dim` is cut locally, with no halo."""
  rows = Rows(*rows)
  n = sharding.tiles(dim)
  c_in = -(-shape[dim] // n)
  tiles = np.array([sharding.tile_index(p, dim) for p in range(sharding.mesh.size)])
  if have is not None and not have.is_maximal and not have.with_rank(len(shape)).dims[dim]:
    dims = sharding.with_rank(len(shape)).dims
    whole = Sharding(sharding.mesh, tuple(() if k == dim else a for k, a in enumerate(dims)))
    return HaloPlan(shape, dim, rows, tiles, np.zeros_like(tiles), 0, 0, (), whole)
  own = tiles * c_in
  lo, hi = rows.lo[tiles], rows.hi[tiles]
  used = hi > lo
  left = int(max(0, np.max((own - lo)[used], initial=0)))
  right = int(max(0, np.max((hi - own - c_in)[used], initial=0)))
  if left > c_in or right > c_in:
    return None
  return HaloPlan(shape, dim, rows, tiles, own, left, right, sharding.dims[dim], sharding)


@dataclasses.dataclass(frozen=True, eq=False)
class Shift:
  """A windowed op along `dim` left unemitted so that its one reader's window reads its operand directly (one
  halo exchange for both): row r of its result along `dim` is row r + `offset` of `source` when that row lies
  in [lo, hi), else `fill`. `local(x)` applies the op to the other dims of such a window (a pad or slice of dims
  that must be whole, `local_dims`); `cost()` is what emitting the op itself would move per device."""

  source: str
  dim: int
  offset: int
  lo: int
  hi: int
  fill: Any
  local_dims: Tuple[int, ...]
  local: Any
  cost: Any

  def rows(self, rows):
    """The `Rows` of `source` that windows `rows` of the result read: the result's rows that matter are the
    source rows inside [lo, hi) (the others are the op's `fill`)."""
    first, length, lo, hi = rows
    s_lo = np.clip(np.asarray(lo) + self.offset, self.lo, self.hi)
    s_hi = np.clip(np.asarray(hi) + self.offset, self.lo, self.hi)
    return Rows(np.asarray(first) + self.offset, length, s_lo, np.maximum(s_hi, s_lo))

  def fills(self, rows):
    """Whether some row that matters in `rows` (of the result) is the op's fill rather than a source row."""
    first, length, lo, hi = rows
    inside = self.rows(rows)
    return bool(np.any((np.asarray(hi) - np.asarray(lo)) > (inside.hi - inside.lo)))


def take_bounds(offset, count, extent):
  """Rows [offset[p], offset[p] + count) of a local dim of `extent` rows on device p, read from that dim
  zero-padded: (rows of zeros before, rows of zeros after, offset[p] into the padded dim)."""
  front = max(0, -int(offset.min()))
  offset = offset + front
  back = max(0, int(offset.max()) + count - (extent + front))
  return front, back, offset


# ---- the windowed rules' prologue -----------------------------------------------------------------------------------
def split_spatial(layout, rank):
  """((dim, axes), ...) of the split spatial dims of an NHWC layout (empty when none), or None (no layout)."""
  if layout is None or layout.is_maximal:
    return None
  layout = layout.with_rank(rank)
  return tuple((d, layout.dims[d]) for d in range(1, rank - 1) if layout.dims[d])


def free_axes(axes, *used):
  """`axes` without those in any of `used`."""
  taken = {a for u in used for a in u}
  return tuple(a for a in axes if a not in taken)


def nhwc_layout(mesh, splits, b_axes, c_axes=(), rank=4):
  """Channels-last layout: batch over `b_axes`, each spatial dim of `splits` ({dim: axes}) over its axes,
  channels over `c_axes`."""
  return Sharding(mesh, tuple(b_axes if i == 0 else c_axes if i == rank - 1 else splits.get(i, ())
                              for i in range(rank)))


@dataclasses.dataclass(frozen=True, eq=False)
class SplitWindow:
  """A 2-D or 3-D channels-last windowed op with the spatial dims of `splits` ({dim: mesh axes}) kept split: the
  op's geometry `dims` ({spatial dim: WindowDim}) and the mesh axes left for batch (`b_axes`) and channels
  (`c_axes`)."""

  mesh: Any
  dims: Dict[int, WindowDim]
  splits: Dict[int, Tuple[str, ...]]
  b_axes: Tuple[str, ...]
  c_axes: Tuple[str, ...]

  @property
  def rank(self):
    return len(self.dims) + 2

  @property
  def ds(self):
    """The split spatial dims, in order."""
    return tuple(sorted(self.splits))

  @property
  def axes(self):
    """The mesh axes of the split spatial dims."""
    return tuple(a for d in self.ds for a in self.splits[d])

  def layout(self, c_axes=()):
    """NHWC layout with batch over `b_axes`, the split dims over their axes and channels over `c_axes`."""
    return nhwc_layout(self.mesh, self.splits, self.b_axes, c_axes, self.rank)


class WindowedRule(FactorRule):
  """A 2-D NHWC convolution or pooling, forward or a gradient, that keeps its split spatial dims split: each
  device's window of input rows along every split dim, the halos exchanged one dim after the other (the second
  exchange carries the first's halo, so corners come with it).

  `partition` is the prologue these rules share: the op's geometry and the layout whose split spatial dims it
  keeps (`split_window`), then the op's own emission (`windowed`); when a window reaches past the neighbouring
  shards the dims are gathered instead (and the report says so). An op with no such split partitions by
  `unsplit`. Automatic sharding prices the halo rows a split exchanges (`internal_bytes`).
  """

  def internal_bytes(self, node, axes_of, mesh):
    dims = geometry(node)
    if dims is None:
      return 0
    image = node.outputs[0].shape if node.op in _IMAGE_OUT else node.input_shape(0)
    total = 0
    for k in dims:
      axes = axes_of.get(f"s{k - 1}", ())
      if not axes:
        continue
      halo = max(dims[k].window - dims[k].stride, 0)
      batch = -(-image[0] // math.prod(mesh.axis_size(a) for a in axes_of.get("b", ())))
      across = math.prod(image[j] for j in dims if j != k) * image[-1]
      total += halo * batch * across * node.outputs[0].dtype.size
    return total

  def factors(self, node, spatial=None):
    raise NotImplementedError

  def split_layout(self, ctx, node):  # pylint: disable=unused-argument
    """The layout whose split spatial dims the op keeps: its result's completed sharding."""
    return ctx.target(0)

  def split_window(self, ctx, node):
    """The `SplitWindow` of `node` under `split_layout`, or None (no 2-D NHWC geometry, or no spatial dim
    split)."""
    dims = geometry(node)
    layout = self.split_layout(ctx, node)
    rank = len(dims) + 2 if dims else None
    split = split_spatial(layout, rank) if dims else None
    if not split:
      return None
    splits = dict(split)
    full = layout.with_rank(rank).dims
    axes = tuple(a for _, ax in split for a in ax)
    b_axes = free_axes(full[0], axes)
    return SplitWindow(ctx.mesh, dims, splits, b_axes, free_axes(full[rank - 1], axes, b_axes))

  def partition(self, ctx, node):
    w = self.split_window(ctx, node)
    if w is None:
      self.unsplit(ctx, node)
    elif not self.windowed(ctx, node, w):
      ctx.warn(f"{node.name} ({node.op}): its windows along dims {list(w.ds)} reach past the neighbouring shards, "
               "so those dims are gathered instead of exchanging halos")
      self.partition_with(ctx, node, self.factors(node, spatial=False))

  def unsplit(self, ctx, node):
    """Partition with the spatial dims whole."""
    self.partition_with(ctx, node, self.factors(node, spatial=False))

  def windowed(self, ctx, node, w):
    """Emit the op with its spatial dims `w.ds` split (the `SplitWindow` w); False when a window reaches past
    the neighbouring shards (nothing emitted then)."""
    raise NotImplementedError
