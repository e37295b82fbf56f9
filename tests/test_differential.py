"""Differential tests: Hypothesis-generated TF programs, partitioned vs. unpartitioned.

Each case is a short straight-line TF program (1-4 ops drawn from element-wise unary and broadcasting
binary ops, (batch) matmul, reductions, transpose, reshape, expand_dims/squeeze, concat, slicing, softmax
and cumsum) over small shapes that include primes and sizes below the mesh axis sizes, with random input
(and sometimes output) shardings, including dims split over several mesh axes. The program runs partitioned
with `gs.function` on the 8 logical CPUs and eagerly, unpartitioned; every case checks

  * the global value of every output against the unpartitioned value,
  * every per-device component's shape against `sharding.shard_shape(global shape)`,
  * every component's valid (unpadded) region against the matching block of the expected value, so
    replicas must agree too,
  * the declared input and output shardings are the ones the lowering uses.

A program is generated as Python source (shown in full in a falsifying example), so a failure is a
ready-to-run reproducer. Runs are derandomized and use no example database, so CI is reproducible.
"""

import dataclasses
import math
from typing import Optional, Tuple

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings, strategies as st

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd._sharding import Sharding

MESHES = {
    "8": gs.Mesh((8,), ("d",)),
    "2x4": gs.Mesh((2, 4), ("data", "model")),
    "4x2": gs.Mesh((4, 2), ("data", "model")),
    "2x2x2": gs.Mesh((2, 2, 2), ("x", "y", "z")),
}

# Sizes of generated dims. Listed first = what a failing example shrinks towards.
DIMS = (8, 12, 2, 3, 5, 7, 1)
MAX_RANK = 5
MAX_INITIAL_ELEMS = 600
MAX_ELEMS = 2048
MAX_INPUTS = 4
# Bound on |value| of every intermediate (inputs are uniform in [-1, 1]); ops that would exceed it are
# not drawn, so exp/cumsum/matmul chains stay well inside float32 and the tolerances below.
MAX_BOUND = 200.0
RTOL = ATOL = 1e-4

# Patterns that hit a known tf_gspmd bug; each has a strict-xfail regression test at the end of this file.
# Remove an entry when its bug is fixed (its xfail test then fails, as a reminder).
EXCLUDED = frozenset()

EXAMPLES_PER_MESH = 500   # 4 meshes -> 2000 cases per run

SETTINGS = settings(
    max_examples=EXAMPLES_PER_MESH,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@dataclasses.dataclass(frozen=True)
class Case:
  """One generated program: the source of `fn`, its argument shapes, shardings and data seed."""

  mesh_key: str
  source: str
  in_shapes: Tuple[Tuple[int, ...], ...]
  in_specs: Tuple[Optional[P], ...]
  out_specs: Optional[Tuple[Optional[P], ...]]
  out_shapes: Tuple[Tuple[int, ...], ...]
  bound: float
  seed: int

  def _repr_pretty_(self, p, cycle):  # how Hypothesis prints a falsifying example
    p.text(repr(self))

  def __repr__(self):
    mesh = MESHES[self.mesh_key]
    out = "None" if self.out_specs is None else repr(self.out_specs)
    return ("\n# --- reproducer (after: import numpy as np, tensorflow as tf, tf_gspmd as gs; "
            "from tf_gspmd import P; gs.split_cpu_devices(8)) ---\n"
            f"mesh = gs.Mesh({mesh.shape}, {mesh.axis_names})\n"
            f"{self.source}\n"
            f"f = gs.function(fn, mesh=mesh, in_shardings={self.in_specs!r}, out_shardings={out})\n"
            f"rng = np.random.default_rng({self.seed})\n"
            f"args = [rng.uniform(-1, 1, s).astype(np.float32) for s in {list(self.in_shapes)!r}]\n"
            f"got, want = f(*args), fn(*args)   # output shapes {list(self.out_shapes)}\n")


# ---------------------------------------------------------------------------------------------------------
# Program generation: shapes and ops are drawn together, so every program is valid TF.
# ---------------------------------------------------------------------------------------------------------

class _Builder:
  """Accumulates the lines of `fn` while tracking the current tensor's static shape and value bound."""

  def __init__(self, draw, shape):
    self.draw = draw
    self.inputs = [tuple(shape)]
    self.lines = []
    self.cur = "x0"
    self.shape = tuple(shape)
    self.bound = 1.0
    self.history = []   # (name, shape) of every intermediate
    self.bounds = {"x0": 1.0}   # value bound of every tensor so far
    self.last = None    # tag of the last op, e.g. ("unary", "exp")
    self.unary_run = None   # number of unary ops since the last reshape (None: something else came between)

  def new_input(self, shape):
    self.inputs.append(tuple(shape))
    name = f"x{len(self.inputs) - 1}"
    self.bounds[name] = 1.0
    return name

  def shape_of(self, name):
    if name.startswith("x"):
      return self.inputs[int(name[1:])]
    return dict(self.history)[name]

  def earlier(self, fits):
    """Earlier tensors (inputs and intermediates, not the current one) whose shape satisfies `fits`."""
    named = [(f"x{i}", s) for i, s in enumerate(self.inputs)] + self.history
    return [n for n, s in named if n != self.cur and fits(s)]

  def emit(self, expr, shape, bound, tag):
    name = f"t{len(self.lines)}"
    self.lines.append(f"  {name} = {expr}")
    self.cur, self.shape, self.bound = name, tuple(shape), float(bound)
    self.history.append((name, self.shape))
    self.bounds[name] = self.bound
    self.last = tag
    if tag[0] == "reshape":
      self.unary_run = 0
    elif tag[0] == "unary" and self.unary_run is not None:
      self.unary_run += 1
    else:
      self.unary_run = None

  @property
  def rank(self):
    return len(self.shape)

  @property
  def can_add_input(self):
    return len(self.inputs) < MAX_INPUTS


def _d(draw, choices):
  return draw(st.sampled_from(list(choices)))


def _broadcasts_into(small, big):
  """Whether `small` broadcasts to exactly `big`."""
  return len(small) <= len(big) and all(s in (1, n) for s, n in zip(reversed(small), reversed(big)))


def _fits(shape):
  return math.prod(shape) <= MAX_ELEMS and len(shape) <= MAX_RANK


_UNARY = {"exp": "tf.exp", "tanh": "tf.tanh", "relu": "tf.nn.relu", "neg": "tf.negative", "square": "tf.square"}


def _op_unary(b):
  choices = ["tanh", "relu", "neg"]
  if b.bound <= 2.5:
    choices.append("exp")
  if b.bound <= 7.0:
    choices.append("square")
  name = _d(b.draw, choices)
  bound = {"exp": math.exp(b.bound), "square": b.bound ** 2, "tanh": 1.0}.get(name, b.bound)
  b.emit(f"{_UNARY[name]}({b.cur})", b.shape, bound, ("unary", name))


_BINARY = {"add": ("tf.add", lambda p, q: p + q), "mul": ("tf.multiply", lambda p, q: p * q),
           "sub": ("tf.subtract", lambda p, q: p + q), "maximum": ("tf.maximum", max)}


def _op_binary(b):
  draw = b.draw
  op = _d(draw, _BINARY)
  fn, bound_of = _BINARY[op]
  kinds = ["scalar"]
  if b.can_add_input:
    kinds = ["same", "bcast_other", "bcast_self", "scalar"]
  reusable = b.earlier(lambda s: _broadcasts_into(s, b.shape))
  if reusable:
    kinds.append("reuse")
  kind = _d(draw, kinds)
  out_shape = b.shape
  if kind == "scalar" and op != "maximum" and "grappler_stale_shapes" in EXCLUDED and (
      b.last and b.last[0] == "binary" and b.last[1] != "maximum" and b.last[2].startswith("bcast")):
    # (a + b) + 0.5 with b broadcast: Grappler's constant push-down reuses the node names.
    op = "maximum"
    fn, bound_of = _BINARY[op]
  if kind == "scalar":
    other = repr(_d(draw, (0.5, -1.5, 2.0, -0.25)))
    other_bound = 2.0
  elif kind == "same":
    other, other_bound = b.new_input(b.shape), 1.0
  elif kind == "reuse":
    # An earlier tensor of the program (same or broadcastable shape): a diamond in the graph.
    other = _d(draw, reusable)
    other_bound = b.bounds[other]
    if b.shape_of(other) != b.shape:
      kind = "bcast_reuse"
  elif kind == "bcast_other":
    # The other operand broadcasts into this one: a suffix of the shape, some dims set to 1.
    keep = draw(st.integers(0, b.rank))
    shape = tuple(1 if draw(st.booleans()) else n for n in b.shape[b.rank - keep:])
    other, other_bound = b.new_input(shape), 1.0
  else:
    # This tensor broadcasts into the other operand: maybe a new leading dim, size-1 dims may grow.
    lead = (_d(draw, DIMS),) if b.rank < MAX_RANK and draw(st.booleans()) else ()
    shape = lead + tuple(_d(draw, DIMS) if n == 1 and draw(st.booleans()) else n for n in b.shape)
    if not _fits(shape):
      shape = b.shape
    other, other_bound = b.new_input(shape), 1.0
    out_shape = shape
  bound = bound_of(b.bound, other_bound)
  if bound > MAX_BOUND:
    return _op_unary(b)
  lhs, rhs = (b.cur, other) if draw(st.booleans()) else (other, b.cur)
  b.emit(f"{fn}({lhs}, {rhs})", out_shape, bound, ("binary", op, kind))


def _op_matmul(b):
  draw = b.draw
  shape = b.shape
  batch, (m, k) = shape[:-2], shape[-2:]
  left = draw(st.booleans())   # True: w @ t, else t @ w
  if not left:
    ta, tb = draw(st.booleans()), draw(st.booleans())
    if ta:
      m, k = k, m
    n = _d(draw, DIMS)
    if len(batch) == 2:
      # TF 2.21's oneDNN BatchMatMulV2 corrupts the heap (SIGSEGV/SIGABRT, or garbage) for a rank-4 lhs
      # whose batch has a size-1 dim times a broadcast rhs, e.g. plain eager tf.linalg.matmul(
      # [8, 1, 3, 1], [1, 3]); tensorflow/tensorflow#117700. The lhs's local shard can have a size-1 dim
      # whatever the global shape, so rank-4 lhs only get a rhs with the full batch here.
      wbatch = batch
    elif batch:
      wb = _d(draw, ("full", "none", "ones"))
      wbatch = {"full": batch, "none": (), "ones": tuple(1 if draw(st.booleans()) else d for d in batch)}[wb]
    else:
      wbatch = ()
    wshape = wbatch + ((n, k) if tb else (k, n))
    bound = b.bound * k
    if bound > MAX_BOUND or not _fits(batch + (m, n)):
      return _op_unary(b)
    w = b.new_input(wshape)
    flags = "".join([", transpose_a=True" if ta else "", ", transpose_b=True" if tb else ""])
    b.emit(f"tf.linalg.matmul({b.cur}, {w}{flags})", batch + (m, n), bound, ("matmul",))
  else:
    rows = _d(draw, DIMS)
    bound = b.bound * m
    if bound > MAX_BOUND or not _fits(batch + (rows, k)):
      return _op_unary(b)
    w = b.new_input((rows, m))
    b.emit(f"tf.linalg.matmul({w}, {b.cur})", batch + (rows, k), bound, ("matmul",))


_REDUCE = ("sum", "mean", "max", "min")


def _op_reduce(b):
  draw = b.draw
  ops = _REDUCE
  if "grappler_stale_shapes" in EXCLUDED and b.last in (("unary", "exp"), ("unary", "tanh"), ("unary", "relu"),
                                                        ("unary", "neg")):
    ops = ("sum", "mean")   # max/min of a monotonic op: Grappler swaps the two nodes, keeping their names
  op = _d(draw, ops)
  keepdims = draw(st.booleans())
  if draw(st.integers(0, 5)) == 0:
    axes = list(range(b.rank))
    axis_src = "None"
  else:
    axes = sorted(draw(st.sets(st.integers(0, b.rank - 1), min_size=1, max_size=b.rank)))
    neg = draw(st.booleans())
    shown = [a - b.rank if neg else a for a in axes]
    axis_src = str(shown[0]) if len(shown) == 1 else str(shown)
  n = math.prod(b.shape[a] for a in axes)
  bound = b.bound * n if op == "sum" else b.bound
  if bound > MAX_BOUND:
    op, bound = "mean", b.bound
  if keepdims:
    shape = tuple(1 if i in axes else d for i, d in enumerate(b.shape))
  else:
    shape = tuple(d for i, d in enumerate(b.shape) if i not in axes)
  b.emit(f"tf.reduce_{op}({b.cur}, axis={axis_src}, keepdims={keepdims})", shape, bound, ("reduce", op))


def _op_transpose(b):
  perm = list(b.draw(st.permutations(range(b.rank))))
  b.emit(f"tf.transpose({b.cur}, {perm})", tuple(b.shape[p] for p in perm), b.bound, ("transpose",))


def _factor_pairs(n):
  return [(a, n // a) for a in range(2, n) if n % a == 0]


def _op_reshape(b):
  draw = b.draw
  shape = list(b.shape)
  splittable = [i for i, n in enumerate(shape) if _factor_pairs(n)]
  kinds = []
  if splittable and b.rank < MAX_RANK:
    kinds.append("split")
  if b.rank >= 2:
    kinds.append("merge")
  if not kinds or ("grappler_stale_shapes" in EXCLUDED and b.unary_run):
    # reshape(unary(reshape(x))): Grappler reorders the unary op and the reshapes, keeping the names.
    return _op_unary(b)
  kind = _d(draw, kinds)
  if kind == "split":
    i = _d(draw, splittable)
    new = shape[:i] + list(_d(draw, _factor_pairs(shape[i]))) + shape[i + 1:]
  else:
    i = draw(st.integers(0, b.rank - 2))
    j = draw(st.integers(i + 2, min(b.rank, i + 3)))
    new = shape[:i] + [math.prod(shape[i:j])] + shape[j:]
  shown = list(new)
  if draw(st.integers(0, 3)) == 0:
    shown[draw(st.integers(0, len(new) - 1))] = -1
  b.emit(f"tf.reshape({b.cur}, {shown})", tuple(new), b.bound, ("reshape",))


def _op_expand_squeeze(b):
  draw = b.draw
  ones = [i for i, n in enumerate(b.shape) if n == 1]
  kinds = (["expand"] if b.rank < MAX_RANK else []) + (["squeeze"] if ones else [])
  if not kinds:
    return _op_unary(b)
  if _d(draw, kinds) == "expand":
    axis = draw(st.integers(-b.rank - 1, b.rank))
    pos = axis % (b.rank + 1)
    b.emit(f"tf.expand_dims({b.cur}, {axis})", b.shape[:pos] + (1,) + b.shape[pos:], b.bound, ("expand_dims",))
  elif "squeeze_all" in EXCLUDED or draw(st.booleans()):
    i = _d(draw, ones)
    b.emit(f"tf.squeeze({b.cur}, axis=[{i}])", b.shape[:i] + b.shape[i + 1:], b.bound, ("squeeze",))
  else:
    b.emit(f"tf.squeeze({b.cur})", tuple(n for n in b.shape if n != 1), b.bound, ("squeeze",))


def _op_concat(b):
  draw = b.draw
  axis = draw(st.integers(0, b.rank - 1))
  shown = axis - b.rank if draw(st.booleans()) else axis
  if b.can_add_input and draw(st.booleans()):
    size = _d(draw, DIMS)
    other = b.new_input(b.shape[:axis] + (size,) + b.shape[axis + 1:])
    parts = [b.cur, other] if draw(st.booleans()) else [other, b.cur]
    bound = max(b.bound, 1.0)
  else:
    size = b.shape[axis]
    parts, bound = [b.cur, b.cur], b.bound
  shape = b.shape[:axis] + (b.shape[axis] + size,) + b.shape[axis + 1:]
  if not _fits(shape):
    return _op_unary(b)
  b.emit(f"tf.concat([{', '.join(parts)}], axis={shown})", shape, bound, ("concat",))


def _slice_text(s):
  start = "" if s.start is None else str(s.start)
  stop = "" if s.stop is None else str(s.stop)
  return f"{start}:{stop}" + ("" if s.step in (None, 1) else f":{s.step}")


def _op_slice(b):
  draw = b.draw
  if draw(st.booleans()):
    # tf.slice(t, begin, size)
    begin, size = [], []
    for n in b.shape:
      lo = draw(st.integers(0, n - 1))
      begin.append(lo)
      size.append(-1 if draw(st.integers(0, 3)) == 0 else draw(st.integers(1, n - lo)))
    out = tuple(n - lo if s == -1 else s for n, lo, s in zip(b.shape, begin, size))
    b.emit(f"tf.slice({b.cur}, {begin}, {size})", out, b.bound, ("slice",))
    return
  # Python indexing (StridedSlice): per dim ':' , a range with a step, or one index (drops the dim).
  items, out = [], []
  shrunk = 0
  for n in b.shape:
    kind = _d(draw, ("full", "range", "index") if shrunk < 1 and b.rank > 1 else ("full", "range"))
    if kind == "full":
      items.append(":")
      out.append(n)
    elif kind == "index":
      i = draw(st.integers(-n, n - 1))
      items.append(str(i))
      shrunk += 1
    else:
      step = _d(draw, (1, 2, 3, -1))
      start = draw(st.one_of(st.none(), st.integers(-n, n - 1)))
      stop = draw(st.one_of(st.none(), st.integers(-n, n)))
      length = len(range(n)[slice(start, stop, step)])
      if length == 0:
        start, stop = None, None
        length = len(range(n)[slice(None, None, step)])
      items.append(_slice_text(slice(start, stop, step)))
      out.append(length)
  b.emit(f"{b.cur}[{', '.join(items)}]", tuple(out), b.bound, ("strided_slice",))


def _op_softmax(b):
  if b.draw(st.booleans()):
    b.emit(f"tf.nn.softmax({b.cur})", b.shape, 1.0, ("softmax",))
  else:
    bound = 2 * b.bound + math.log(b.shape[-1]) + 1
    if bound > MAX_BOUND:
      return _op_unary(b)
    b.emit(f"tf.nn.log_softmax({b.cur})", b.shape, bound, ("log_softmax",))


def _op_cumsum(b):
  draw = b.draw
  axis = draw(st.integers(-b.rank, b.rank - 1))
  bound = b.bound * b.shape[axis]
  if bound > MAX_BOUND:
    return _op_unary(b)
  exclusive, reverse = draw(st.booleans()), draw(st.booleans())
  b.emit(f"tf.math.cumsum({b.cur}, axis={axis}, exclusive={exclusive}, reverse={reverse})", b.shape, bound,
         ("cumsum",))


_OPS = {
    "unary": (_op_unary, 0), "binary": (_op_binary, 0), "matmul": (_op_matmul, 2), "reduce": (_op_reduce, 1),
    "transpose": (_op_transpose, 2), "reshape": (_op_reshape, 1), "expand_squeeze": (_op_expand_squeeze, 0),
    "concat": (_op_concat, 1), "slice": (_op_slice, 1), "softmax": (_op_softmax, 1), "cumsum": (_op_cumsum, 1),
}


@st.composite
def specs(draw, mesh, rank):
  """A random P for a tensor of `rank` over `mesh`: each mesh axis splits one dim or none, in a random
  order within a dim (multi-axis entries like P(("x", "y"))); trailing Nones are sometimes left off."""
  if rank == 0:
    return P()
  owner = [draw(st.sampled_from([None] + list(range(rank)))) for _ in mesh.axis_names]
  entries = []
  for d in range(rank):
    axes = [a for a, o in zip(mesh.axis_names, owner) if o == d]
    if len(axes) > 1:
      axes = list(draw(st.permutations(axes)))
    entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  if draw(st.booleans()):
    while entries and entries[-1] is None:
      entries.pop()
  return P(*entries)


@st.composite
def maybe_spec(draw, mesh, rank, none_weight):
  if draw(st.integers(0, none_weight - 1)) == 0:
    return None
  return draw(specs(mesh, rank))


@st.composite
def cases(draw, mesh_key):
  mesh = MESHES[mesh_key]
  rank = draw(st.integers(1, 4))
  shape = []
  for _ in range(rank):
    shape.append(_d(draw, [n for n in DIMS if math.prod(shape) * n <= MAX_INITIAL_ELEMS]))
  b = _Builder(draw, shape)
  for _ in range(_d(draw, (1, 2, 3, 4))):
    names = [k for k, (_, min_rank) in _OPS.items() if b.rank >= min_rank]
    _OPS[_d(draw, names)][0](b)
  outputs = [b.history[-1]]
  if draw(st.integers(0, 3)) == 3:   # (shrinks towards one output)
    # A second output: any tensor of the program, even an argument or the first output again (then both
    # leave in their own declared layouts).
    named = [(f"x{i}", s) for i, s in enumerate(b.inputs)] + b.history
    outputs.append(_d(draw, named[::-1]))
  args = ", ".join(f"x{i}" for i in range(len(b.inputs)))
  ret = ", ".join(name for name, _ in outputs)
  source = "\n".join([f"def fn({args}):"] + b.lines + [f"  return {ret}"])
  # Inputs: mostly sharded (the first always has a spec), sometimes left to completion (None).
  in_specs = tuple(draw(specs(mesh, len(s))) if i == 0 else draw(maybe_spec(mesh, len(s), 5))
                   for i, s in enumerate(b.inputs))
  out_specs = None
  if draw(st.booleans()):
    out_specs = tuple(draw(maybe_spec(mesh, len(s), 4)) for _, s in outputs)
  return Case(mesh_key, source, tuple(b.inputs), in_specs, out_specs, tuple(s for _, s in outputs), b.bound,
              draw(st.integers(0, 2**16)))


# ---------------------------------------------------------------------------------------------------------
# Checking one case
# ---------------------------------------------------------------------------------------------------------

def _valid_block(sharding, shape, position):
  """Slices of the global value held (unpadded) by the device at `position`, and its valid local extent."""
  local = sharding.shard_shape(shape)
  glob, loc = [], []
  for d, (n, c) in enumerate(zip(shape, local)):
    i = sharding.tile_index(position, d)
    lo, hi = min(i * c, n), min((i + 1) * c, n)
    glob.append(slice(lo, hi))
    loc.append(slice(0, hi - lo))
  return tuple(glob), tuple(loc)


def run_case(case):
  mesh = MESHES[case.mesh_key]
  namespace = {"tf": tf}
  exec(compile(case.source, "<generated fn>", "exec"), namespace)  # pylint: disable=exec-used
  fn = namespace["fn"]
  rng = np.random.default_rng(case.seed)
  args = [rng.uniform(-1, 1, s).astype(np.float32) for s in case.in_shapes]

  expected = fn(*[tf.constant(a) for a in args])
  expected = [np.asarray(e) for e in (expected if isinstance(expected, tuple) else (expected,))]
  assert [e.shape for e in expected] == list(case.out_shapes), "generator shape bookkeeping is off"

  f = gs.function(tf.function(fn, autograph=False), mesh=mesh, in_shardings=case.in_specs,
                  out_shardings=case.out_specs)
  got = f(*args)
  got = list(got) if isinstance(got, tuple) else [got]
  assert len(got) == len(expected)

  low = f.lower(*[tf.TensorSpec(s) for s in case.in_shapes])
  for k, (spec, shape) in enumerate(zip(case.in_specs, case.in_shapes)):
    if spec is not None:
      assert low.in_shardings[k].with_rank(len(shape)) == Sharding.from_spec(mesh, spec, len(shape)), (
          f"argument {k}: declared {spec}, lowered as {low.in_shardings[k]}")

  for k, (out, want) in enumerate(zip(got, expected)):
    assert isinstance(out, gs.ShardedTensor)
    shape = want.shape
    assert tuple(out.shape.as_list()) == shape, f"output {k}: shape {out.shape} != {shape}"
    np.testing.assert_allclose(out.numpy(), want, rtol=RTOL, atol=ATOL, err_msg=f"output {k} global value")
    sharding = out.sharding
    if case.out_specs is not None and case.out_specs[k] is not None:
      assert sharding.with_rank(len(shape)) == Sharding.from_spec(mesh, case.out_specs[k], len(shape)), (
          f"output {k}: declared {case.out_specs[k]}, got {sharding}")
    assert len(out.components) == mesh.size
    if sharding.is_maximal:
      assert tuple(out.components[sharding.maximal].shape) == shape
      continue
    sharding = sharding.with_rank(len(shape))
    local = sharding.shard_shape(shape)
    assert [tuple(c.shape) for c in out.components] == [local] * mesh.size, (
        f"output {k} ({sharding}): component shapes {[tuple(c.shape) for c in out.components]}, want {local}")
    for p, comp in enumerate(out.components):
      glob, loc = _valid_block(sharding, shape, p)
      np.testing.assert_allclose(comp.numpy()[loc], want[glob], rtol=RTOL, atol=ATOL,
                                 err_msg=f"output {k} ({sharding}), component on device {p}")


@SETTINGS
@given(case=cases("8"))
def test_differential_mesh_8(case):
  run_case(case)


@SETTINGS
@given(case=cases("2x4"))
def test_differential_mesh_2x4(case):
  run_case(case)


@SETTINGS
@given(case=cases("4x2"))
def test_differential_mesh_4x2(case):
  run_case(case)


@SETTINGS
@given(case=cases("2x2x2"))
def test_differential_mesh_2x2x2(case):
  run_case(case)


# ---------------------------------------------------------------------------------------------------------
# Minimal reproducers of the bugs this suite found (patterns in EXCLUDED are not generated above).
# ---------------------------------------------------------------------------------------------------------

def test_squeeze_without_axis_keeps_size_one_shards():
  """Regression: the local Squeeze names its dims, so a dim whose shard has size 1 is not dropped."""
  f = gs.function(lambda x: tf.squeeze(x), mesh=MESHES["8"], in_shardings=P("d"))
  x = np.arange(3, dtype=np.float32).reshape(3, 1)
  np.testing.assert_array_equal(f(x).numpy(), np.squeeze(x))


@pytest.mark.parametrize("fn,shapes", [
    (lambda x: tf.reduce_max(tf.nn.relu(x), axis=-1), [(4, 3)]),            # max/min of a monotonic op
    (lambda a, b: (a + b) + 0.5, [(7, 5), (5,)]),                            # constant push-down
    (lambda x: tf.reshape(tf.tanh(tf.reshape(x, [25])), [5, 5]), [(5, 5)]),  # reshape / unary / reshape
], ids=["max_of_relu", "add_broadcast_then_const", "reshape_unary_reshape"])
def test_grappler_rewrites_do_not_leave_stale_shapes(fn, shapes):
  """Regression: Grappler may reuse a node's name and op for a node of another shape."""
  f = gs.function(fn, mesh=MESHES["2x4"])   # no shardings at all: completion replicates everything
  args = [np.linspace(-1, 1, math.prod(s), dtype=np.float32).reshape(s) for s in shapes]
  np.testing.assert_allclose(f(*args).numpy(), fn(*args), rtol=RTOL, atol=ATOL)
