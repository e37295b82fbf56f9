"""A terminal picture of how a tensor is laid out over the mesh (in the spirit of JAX's
`visualize_array_sharding`): one cell per tile of the first two dims, naming the devices that hold it."""

import io
import numbers

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.errors import InputError
from tf_gspmd.runtime.sharded_tensor import ShardedTensor


def tile_grid(sharding, shape):
  """The tiles of dims 0 and 1 of a tensor of `shape` laid out as `sharding`: (rows, columns, {(row, column): the
  mesh positions holding that tile}, [the element ranges (start, stop) of each row tile, of each column tile])."""
  rank = len(shape)
  if sharding.is_maximal:
    return 1, 1, {(0, 0): [sharding.maximal]}, [[(0, shape[0] if rank else 1)], [(0, shape[1] if rank > 1 else 1)]]
  s = sharding.with_rank(rank)
  rows = s.tiles(0) if rank > 0 else 1
  cols = s.tiles(1) if rank > 1 else 1
  cells = {}
  for p in range(sharding.mesh.size):
    key = (s.tile_index(p, 0) if rank > 0 else 0, s.tile_index(p, 1) if rank > 1 else 0)
    cells.setdefault(key, []).append(p)
  local = s.shard_shape(shape)

  def ranges(d, n):
    if d >= rank:
      return [(0, 1)]
    c = local[d]
    return [(min(i * c, shape[d]), min((i + 1) * c, shape[d])) for i in range(n)]

  return rows, cols, cells, [ranges(0, rows), ranges(1, cols)]


def visualize_sharding(x, shape=None, *, show=True, width=None):
  """Draws the layout of `x` (a ShardedTensor, or a Sharding with `shape`) and returns the drawing as text.

  Each cell is one tile of dims 0 and 1 (rows x columns); it lists the mesh positions holding that tile
  (several when the tensor is replicated over unused mesh axes) and the tile's element range.

  Example:
    >>> gs.visualize_sharding(gs.Sharding.from_spec(mesh, P("data", "model")), (64, 1024))
  """
  from rich.console import Console  # pylint: disable=g-import-not-at-top
  from rich.table import Table  # pylint: disable=g-import-not-at-top
  from rich import box  # pylint: disable=g-import-not-at-top

  if isinstance(x, ShardedTensor):
    sharding, shape = x.sharding, tuple(x.shape.as_list())
  elif isinstance(x, Sharding):
    sharding = x
    if shape is None or isinstance(shape, (str, bytes)) or not all(
        isinstance(d, numbers.Integral) and d >= 0 for d in (shape if hasattr(shape, "__iter__") else [None])):
      raise InputError(f"visualize_sharding(sharding, shape): give the tensor's shape as a tuple of sizes; got "
                       f"shape={shape!r}", node="shape")
    shape = tuple(int(d) for d in shape)
  else:
    raise InputError(f"visualize_sharding draws a ShardedTensor or a Sharding (with its tensor's shape); got "
                     f"{type(x).__name__} {x!r:.60}: give y.sharding of a result, or gs.sharding_of(v)", node="x")
  mesh = sharding.mesh
  rank = len(shape)
  title = f"{list(shape)} {sharding} on {mesh}"
  rows, cols, cells, bounds = tile_grid(sharding, shape)
  if rank > 2:
    title += f"  (dims 0 and 1 shown; dims 2.. split as {sharding.spec[2:] if sharding.spec else '-'})"
  table = Table(title=title, show_header=False, box=box.SQUARE, show_lines=True)
  for _ in range(cols):
    table.add_column(justify="center")
  for r in range(rows):
    row = []
    for c in range(cols):
      devs = cells.get((r, c), [])
      (r0, r1), (c0, c1) = bounds[0][r], bounds[1][c]
      rng = f"[{r0}:{r1}" + (f", {c0}:{c1}]" if rank > 1 else "]")
      row.append(("dev " if len(devs) == 1 else "devs ") + ",".join(map(str, devs)) + "\n" + rng)
    table.add_row(*row)
  buf = io.StringIO()
  console = Console(file=buf, width=width or max(40, 22 * cols), force_terminal=False, color_system=None)
  console.print(table)
  text = buf.getvalue()
  if show:
    print(text, end="")
  return text
