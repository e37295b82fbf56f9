"""Differential suite: generated TF programs, partitioned vs. unpartitioned.

A *case* is one small generated program (source text, argument shapes and dtypes, input shardings, sometimes
output shardings, a data seed) drawn from one op family: element-wise ops, matmul, einsum, reductions,
softmax, shape ops, concat/stack/split, slicing, pads, gather, scatter, convolutions, pooling, tf.while_loop,
tf.cond, gradients through tf.GradientTape, int32 and bool programs, and random chains of several of these.
Shapes include primes and sizes below the mesh axis sizes, so most splits are uneven.

Lowering and running a gs.function costs far more than a small case, so BATCH cases run side by side in one
gs.function: independent arguments and results, each case in its own name scope ("c<index>/"), its arguments
in its own layouts. Every case is still checked on its own against its own eager, unpartitioned run:

  * every output's global value, within the case's tolerance (`_tolerance`), exactly for int and bool;
  * every per-device component's shape against `sharding.shard_shape(global shape)` and its valid
    (unpadded) block against the matching block of the expected value, so replicas must agree too;
  * the declared input and output shardings are the ones the lowering uses.

A failure names the case with a ready-to-run reproducer (`Case.__repr__`). The suite asserts its own coverage
and prints it (`pytest -s`): the number of cases, the share that split at least one argument, the
collective kinds the partitioner emitted (all five must appear) and the families drawn. Generation is seeded
numpy (a small stand-in for Hypothesis' strategies), so every run checks the same cases.

The per-device programs run with TF's runtime graph optimizer (the meta optimizer) off: the suite checks the
program the partitioner wrote, not Grappler's rewrite of it, and instantiating large per-device functions
on 8 devices is then several times faster. The rewriter's own Grappler pass configures itself and still runs.
"""

import collections
import dataclasses
import math
import re
import time
from typing import Optional, Tuple

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd._sharding import Sharding

MESHES = {
    "8": gs.Mesh((8,), ("d",)),
    "2x4": gs.Mesh((2, 4), ("data", "model")),
    "4x2": gs.Mesh((4, 2), ("data", "model")),
    "2x2x2": gs.Mesh((2, 2, 2), ("x", "y", "z")),
}

SEED = 2024
CASES_PER_MESH = 500      # 4 meshes -> 2000 cases per run
BATCH = 40                # cases per gs.function

# Sizes of generated dims: multiples of every axis size, primes, sizes below an axis' size.
DIMS = (8, 12, 2, 3, 5, 7, 1)
MAX_RANK = 4
MAX_INITIAL_ELEMS = 400
MAX_ELEMS = 1024
MAX_INPUTS = 4
# Bound on |value| of every float intermediate (inputs are uniform in [-1, 1]); ops that would exceed it are
# not drawn, so exp/cumsum/matmul chains stay well inside float32.
MAX_BOUND = 200.0

EPS32 = float(np.finfo(np.float32).eps)
TOL_FACTOR = 8.0

FAMILIES = ("elementwise", "matmul", "einsum", "reduction", "softmax", "shape", "concat", "slice", "pad",
            "gather", "scatter", "conv", "pool", "while", "cond", "gradient", "int", "bool", "chain")
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


# ---------------------------------------------------------------------------------------------------------
# Deterministic drawing: strategies are functions of a numpy Generator, `draw` applies one.
# ---------------------------------------------------------------------------------------------------------

class st:  # pylint: disable=invalid-name
  """The few Hypothesis strategies the generator uses, drawn from a seeded numpy Generator."""

  @staticmethod
  def sampled_from(xs):
    xs = list(xs)
    return lambda g: xs[int(g.integers(len(xs)))]

  @staticmethod
  def integers(lo, hi):
    return lambda g: int(g.integers(lo, hi + 1))

  @staticmethod
  def booleans():
    return lambda g: bool(g.integers(2))

  @staticmethod
  def permutations(xs):
    xs = list(xs)
    return lambda g: [xs[int(i)] for i in g.permutation(len(xs))]

  @staticmethod
  def sets(elements, min_size, max_size):
    def draw(g):
      size, out = int(g.integers(min_size, max_size + 1)), set()
      while len(out) < size:
        out.add(elements(g))
      return out
    return draw

  @staticmethod
  def none():
    return lambda g: None

  @staticmethod
  def one_of(*strategies):
    return lambda g: strategies[int(g.integers(len(strategies)))](g)


class Draw:
  def __init__(self, seed):
    self.g = np.random.default_rng(seed)

  def __call__(self, strategy):
    return strategy(self.g)


def _d(draw, choices):
  return draw(st.sampled_from(choices))


# ---------------------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Arg:
  """One argument: its shape and data, "f" (float32 uniform in [lo, hi]), "i" (int32 in [lo, hi]) or "b"."""
  shape: Tuple[int, ...]
  kind: str = "f"
  lo: int = -1
  hi: int = 1

  def value(self, rng):
    if self.kind == "f":
      return rng.uniform(self.lo, self.hi, self.shape).astype(np.float32)
    if self.kind == "i":
      return rng.integers(self.lo, self.hi + 1, self.shape).astype(np.int32)
    return rng.integers(0, 2, self.shape).astype(bool)

  @property
  def dtype(self):
    return {"f": tf.float32, "i": tf.int32, "b": tf.bool}[self.kind]


@dataclasses.dataclass(frozen=True)
class Out:
  """One output: its shape, dtype kind ("f", "i", "b") and float32 error scale (`_tolerance`)."""
  shape: Tuple[int, ...]
  kind: str
  mag: float = 0.0
  err: float = 0.0


@dataclasses.dataclass(frozen=True)
class Case:
  """One generated program: the source of `fn`, its arguments, shardings, outputs and data seed."""

  index: int
  family: str
  mesh_key: str
  source: str
  args: Tuple[Arg, ...]
  in_specs: Tuple[Optional[P], ...]
  out_specs: Optional[Tuple[Optional[P], ...]]
  outs: Tuple[Out, ...]
  seed: int

  def __repr__(self):
    mesh = MESHES[self.mesh_key]
    out = "None" if self.out_specs is None else repr(self.out_specs)
    return (f"\n# --- case {self.index} ({self.family}); reproducer (after: import numpy as np, tensorflow as tf, "
            "tf_gspmd as gs; from tf_gspmd import P; gs.split_cpu_devices(8); and this file's Arg) ---\n"
            f"mesh = gs.Mesh({mesh.shape}, {mesh.axis_names})\n"
            f"{self.source}\n"
            f"f = gs.function(tf.function(fn, autograph=False), mesh=mesh, in_shardings={self.in_specs!r}, "
            f"out_shardings={out})\n"
            f"rng = np.random.default_rng({self.seed})\n"
            f"args = [a.value(rng) for a in {list(self.args)!r}]\n"
            f"got, want = f(*args), fn(*args)   # outputs {list(self.outs)}\n")

  @property
  def splits(self):
    """Whether some argument's declared layout splits a dim of size >= 2."""
    mesh = MESHES[self.mesh_key]
    for spec, a in zip(self.in_specs, self.args):
      if spec is None or not a.shape:
        continue
      s = Sharding.from_spec(mesh, spec, len(a.shape))
      if any(s.dims[d] and n >= 2 for d, n in enumerate(a.shape)):
        return True
    return False


# ---------------------------------------------------------------------------------------------------------
# Error bookkeeping. Every float tensor carries `mag`, a bound on |value|, and `err`, a bound (in units of
# float32 epsilon) on how far any float32 evaluation order may put it from the exact value:
#   - an exactly representable input: err 0;
#   - an op rounding its result: + its magnitude; a Lipschitz-L op on its inputs: L * their err;
#   - a sum of n terms of magnitude <= m (reductions, matmul and conv contractions, cumsum): the terms' errors
#     add (n * err) and rounding adds about sqrt(n) * eps * sum|terms| <= sqrt(n) * n * m: the partitioner
#     reorders such sums (partial sums per device, then an all-reduce), and rounding errors of a reordered sum
#     grow like a random walk (sqrt(n)) rather than the worst case (n).
# Two evaluations then differ by at most 2 * eps * err; `_tolerance` allows TOL_FACTOR (8) times eps * err.
# This scales with the program (1e-6 for a single rounding of values in [-1, 1], 1e-3 for a 100-term sum
# of sums) instead of one fixed tolerance, and stays far below what a wrong partition costs: a lost,
# duplicated or misplaced term moves a result by a term's magnitude.
# ---------------------------------------------------------------------------------------------------------

def _sum_err(n, mag, err):
  return n * err + (math.sqrt(n) + 1) * n * mag


def _mm_err(k, ma, ea, mb, eb):
  return k * (mb * ea + ma * eb) + (math.sqrt(k) + 1) * k * ma * mb


def _tolerance(out):
  """(atol, rtol) of a float output: TOL_FACTOR * eps32 times its error scale (above), and a few ulps."""
  return TOL_FACTOR * EPS32 * max(out.err, out.mag, 1.0), TOL_FACTOR * EPS32


# ---------------------------------------------------------------------------------------------------------
# Program builder: shapes and ops are drawn together, so every program is valid TF.
# ---------------------------------------------------------------------------------------------------------

class _Builder:
  """Accumulates the lines of `fn`, the arguments, and each tensor's shape, kind, magnitude and error."""

  def __init__(self, draw):
    self.draw = draw
    self.args = []
    self.lines = []
    self.vals = {}   # name -> [shape, kind, mag, err]
    self.order = []  # names of intermediates
    self.cur = None
    self.last = None

  def arg(self, shape, kind="f", lo=-1, hi=1):
    name = f"x{len(self.args)}"
    self.args.append(Arg(tuple(shape), kind, lo, hi))
    self.vals[name] = [tuple(shape), kind, float(max(abs(lo), abs(hi))) if kind != "b" else 1.0, 0.0]
    if self.cur is None:
      self.cur = name
    return name

  def emit(self, expr, shape, mag=1.0, err=None, kind="f", tag=None, n=1):
    """A new intermediate `expr`: `n` names if it returns a tuple. `err` defaults to one rounding."""
    names = [f"t{len(self.order) + k}" for k in range(n)]
    self.lines.append(f"  {', '.join(names)} = {expr}")
    for name in names:
      self.order.append(name)
      self.vals[name] = [tuple(shape), kind, float(mag), float(mag if err is None else err)]
    self.cur = names[-1]
    self.last = tag
    return names[0] if n == 1 else names

  def line(self, text):
    self.lines.append("  " + text)

  # the current tensor
  @property
  def shape(self):
    return self.vals[self.cur][0]

  @property
  def rank(self):
    return len(self.shape)

  @property
  def mag(self):
    return self.vals[self.cur][2]

  @property
  def err(self):
    return self.vals[self.cur][3]

  @property
  def kind(self):
    return self.vals[self.cur][1]

  @property
  def can_add_input(self):
    return len(self.args) < MAX_INPUTS

  def earlier(self, fits, kind="f"):
    """Earlier tensors of `kind` (arguments and intermediates, not the current one) whose shape fits."""
    return [n for n, v in self.vals.items() if n != self.cur and v[1] == kind and fits(v[0])]

  def out(self, name):
    shape, kind, mag, err = self.vals[name]
    return Out(shape, kind, mag, err)


def _broadcasts_into(small, big):
  return len(small) <= len(big) and all(s in (1, n) for s, n in zip(reversed(small), reversed(big)))


def _fits(shape):
  return math.prod(shape) <= MAX_ELEMS and len(shape) <= MAX_RANK


def _shape(draw, rank, max_elems=MAX_INITIAL_ELEMS, dims=DIMS):
  shape = []
  for _ in range(rank):
    shape.append(_d(draw, [n for n in dims if math.prod(shape) * n <= max_elems]))
  return tuple(shape)


# ---- element-wise ---------------------------------------------------------------------------------------

_UNARY = {"exp": "tf.exp", "tanh": "tf.tanh", "relu": "tf.nn.relu", "neg": "tf.negative", "square": "tf.square",
          "sigmoid": "tf.sigmoid", "abs": "tf.abs"}


def _op_unary(b):
  choices = ["tanh", "relu", "neg", "sigmoid", "abs"]
  if b.mag <= 2.5:
    choices.append("exp")
  if b.mag <= 7.0:
    choices.append("square")
  name = _d(b.draw, choices)
  m, e = b.mag, b.err
  mag, lip = {"exp": (math.exp(m), math.exp(m)), "square": (m * m, 2 * m), "tanh": (min(m, 1.0), 1.0),
              "sigmoid": (1.0, 0.25)}.get(name, (m, 1.0))
  b.emit(f"{_UNARY[name]}({b.cur})", b.shape, mag, lip * e + 2 * mag, tag=("unary", name))


_BINARY = {"add": "tf.add", "mul": "tf.multiply", "sub": "tf.subtract", "maximum": "tf.maximum",
           "minimum": "tf.minimum", "sqdiff": "tf.math.squared_difference"}


def _op_binary(b):
  draw = b.draw
  op = _d(draw, _BINARY)
  kinds = ["scalar"]
  if b.can_add_input:
    kinds = ["same", "bcast_other", "bcast_self", "scalar"]
  reusable = b.earlier(lambda s: _broadcasts_into(s, b.shape))
  if reusable:
    kinds.append("reuse")
  kind = _d(draw, kinds)
  out_shape = b.shape
  if kind == "scalar":
    other = repr(_d(draw, (0.5, -1.5, 2.0, -0.25)))
    om, oe = 2.0, 0.0
  elif kind == "same":
    other = b.arg(b.shape)
  elif kind == "reuse":
    other = _d(draw, reusable)   # an earlier tensor of the program: a diamond in the graph
  elif kind == "bcast_other":
    keep = draw(st.integers(0, b.rank))
    other = b.arg(tuple(1 if draw(st.booleans()) else n for n in b.shape[b.rank - keep:]))
  else:
    lead = (_d(draw, DIMS),) if b.rank < MAX_RANK and draw(st.booleans()) else ()
    shape = lead + tuple(_d(draw, DIMS) if n == 1 and draw(st.booleans()) else n for n in b.shape)
    if not _fits(shape):
      shape = b.shape
    other = b.arg(shape)
    out_shape = shape
  if kind != "scalar":
    om, oe = b.vals[other][2], b.vals[other][3]
  m, e = b.mag, b.err
  mag, err = {"add": (m + om, e + oe), "sub": (m + om, e + oe), "maximum": (max(m, om), e + oe),
              "minimum": (max(m, om), e + oe), "mul": (m * om, om * e + m * oe),
              "sqdiff": ((m + om) ** 2, 2 * (m + om) * (e + oe))}[op]
  if mag > MAX_BOUND:
    return _op_unary(b)
  lhs, rhs = (b.cur, other) if draw(st.booleans()) else (other, b.cur)
  b.emit(f"{_BINARY[op]}({lhs}, {rhs})", out_shape, mag, err + 2 * mag, tag=("binary", op, kind))


def _op_select(b):
  """tf.where of a comparison: a bool intermediate."""
  other = b.arg(b.shape) if b.can_add_input else f"tf.reverse({b.cur}, [0])"
  om = 1.0 if b.can_add_input else b.mag
  cmp = _d(b.draw, ("tf.greater", "tf.less_equal"))
  b.emit(f"tf.where({cmp}({b.cur}, {other}), {b.cur}, {other})", b.shape, max(b.mag, om),
         b.err + max(b.mag, om) * 2, tag=("select",))


# ---- matmul, reductions, views ---------------------------------------------------------------------------

def _op_matmul(b):
  draw = b.draw
  batch, (m, k) = b.shape[:-2], b.shape[-2:]
  if not draw(st.booleans()):   # t @ w
    ta, tb = draw(st.booleans()), draw(st.booleans())
    if ta:
      m, k = k, m
    n = _d(draw, DIMS)
    if len(batch) == 2:
      # TF 2.21's oneDNN BatchMatMulV2 corrupts the heap for a rank-4 lhs whose batch has a size-1 dim times
      # a broadcast rhs (tensorflow/tensorflow#117700); a local shard may have such a dim, so rank-4 lhs get
      # a rhs with the full batch.
      wbatch = batch
    elif batch:
      wbatch = {"full": batch, "none": (),
                "ones": tuple(1 if draw(st.booleans()) else d for d in batch)}[_d(draw, ("full", "none", "ones"))]
    else:
      wbatch = ()
    if b.mag * k > MAX_BOUND or not _fits(batch + (m, n)) or not b.can_add_input:
      return _op_unary(b)
    w = b.arg(wbatch + ((n, k) if tb else (k, n)))
    flags = "".join([", transpose_a=True" if ta else "", ", transpose_b=True" if tb else ""])
    b.emit(f"tf.linalg.matmul({b.cur}, {w}{flags})", batch + (m, n), b.mag * k, _mm_err(k, b.mag, b.err, 1, 0),
           tag=("matmul",))
  else:
    rows = _d(draw, DIMS)
    if b.mag * m > MAX_BOUND or not _fits(batch + (rows, k)) or not b.can_add_input:
      return _op_unary(b)
    w = b.arg((rows, m))
    b.emit(f"tf.linalg.matmul({w}, {b.cur})", batch + (rows, k), b.mag * m, _mm_err(m, 1, 0, b.mag, b.err),
           tag=("matmul",))


def _axes(draw, rank):
  if draw(st.integers(0, 5)) == 0:
    return list(range(rank)), "None"
  axes = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank)))
  shown = [a - rank if draw(st.booleans()) else a for a in axes]
  return axes, str(shown[0]) if len(shown) == 1 else str(shown)


def _op_reduce(b):
  draw = b.draw
  op = _d(draw, ("sum", "mean", "max", "min"))
  keepdims = draw(st.booleans())
  axes, axis_src = _axes(draw, b.rank)
  n = math.prod(b.shape[a] for a in axes)
  if op == "sum" and b.mag * n > MAX_BOUND:
    op = "mean"
  mag, err = {"sum": (b.mag * n, _sum_err(n, b.mag, b.err)),
              "mean": (b.mag, _sum_err(n, b.mag, b.err) / n + b.mag)}.get(op, (b.mag, b.err))
  shape = tuple(1 if i in axes else d for i, d in enumerate(b.shape)) if keepdims else tuple(
      d for i, d in enumerate(b.shape) if i not in axes)
  b.emit(f"tf.reduce_{op}({b.cur}, axis={axis_src}, keepdims={keepdims})", shape, mag, err, tag=("reduce", op))


def _op_transpose(b):
  perm = b.draw(st.permutations(range(b.rank)))
  b.emit(f"tf.transpose({b.cur}, {perm})", tuple(b.shape[p] for p in perm), b.mag, b.err, kind=b.kind,
         tag=("transpose",))


def _factor_pairs(n):
  return [(a, n // a) for a in range(2, n) if n % a == 0]


def _op_reshape(b):
  draw = b.draw
  shape = list(b.shape)
  splittable = [i for i, n in enumerate(shape) if _factor_pairs(n)]
  kinds = (["split"] if splittable and b.rank < MAX_RANK else []) + (["merge"] if b.rank >= 2 else [])
  if not kinds:
    return _op_expand_squeeze(b)
  if _d(draw, kinds) == "split":
    i = _d(draw, splittable)
    new = shape[:i] + list(_d(draw, _factor_pairs(shape[i]))) + shape[i + 1:]
  else:
    i = draw(st.integers(0, b.rank - 2))
    j = draw(st.integers(i + 2, min(b.rank, i + 3)))
    new = shape[:i] + [math.prod(shape[i:j])] + shape[j:]
  shown = list(new)
  if draw(st.integers(0, 3)) == 0:
    shown[draw(st.integers(0, len(new) - 1))] = -1
  b.emit(f"tf.reshape({b.cur}, {shown})", tuple(new), b.mag, b.err, kind=b.kind, tag=("reshape",))


def _op_expand_squeeze(b):
  draw = b.draw
  ones = [i for i, n in enumerate(b.shape) if n == 1]
  kinds = (["expand"] if b.rank < MAX_RANK else []) + (["squeeze"] if ones else [])
  if not kinds:
    return _op_transpose(b)
  if _d(draw, kinds) == "expand":
    axis = draw(st.integers(-b.rank - 1, b.rank))
    pos = axis % (b.rank + 1)
    b.emit(f"tf.expand_dims({b.cur}, {axis})", b.shape[:pos] + (1,) + b.shape[pos:], b.mag, b.err, kind=b.kind,
           tag=("expand_dims",))
  elif draw(st.booleans()):
    i = _d(draw, ones)
    b.emit(f"tf.squeeze({b.cur}, axis=[{i}])", b.shape[:i] + b.shape[i + 1:], b.mag, b.err, kind=b.kind,
           tag=("squeeze",))
  else:
    b.emit(f"tf.squeeze({b.cur})", tuple(n for n in b.shape if n != 1), b.mag, b.err, kind=b.kind,
           tag=("squeeze",))


def _op_tile(b):
  draw = b.draw
  if draw(st.booleans()):
    reps = [_d(draw, (1, 1, 2, 3)) for _ in b.shape]
    shape = tuple(n * r for n, r in zip(b.shape, reps))
    if not _fits(shape):
      return _op_transpose(b)
    b.emit(f"tf.tile({b.cur}, {reps})", shape, b.mag, b.err, kind=b.kind, tag=("tile",))
  else:
    shape = tuple(_d(draw, (2, 3, 5)) if n == 1 else n for n in b.shape)
    if b.rank < MAX_RANK and draw(st.booleans()):
      shape = (_d(draw, (2, 3, 4)),) + shape
    if not _fits(shape):
      return _op_transpose(b)
    b.emit(f"tf.broadcast_to({b.cur}, {list(shape)})", shape, b.mag, b.err, kind=b.kind, tag=("broadcast_to",))


def _op_concat(b):
  draw = b.draw
  axis = draw(st.integers(0, b.rank - 1))
  shown = axis - b.rank if draw(st.booleans()) else axis
  how = _d(draw, ("concat", "concat", "stack", "split"))
  if how == "split":
    n = b.shape[axis]
    if n < 2:
      how = "concat"
    else:
      cut = draw(st.integers(1, n - 1))
      first, second = b.emit(f"tf.split({b.cur}, [{cut}, {n - cut}], axis={shown})",
                             b.shape[:axis] + (cut,) + b.shape[axis + 1:], b.mag, b.err, kind=b.kind,
                             tag=("split",), n=2)
      b.vals[second][0] = b.shape[:axis] + (n - cut,) + b.shape[axis + 1:]
      b.cur = _d(draw, (first, second))
      return
  if how == "stack":
    if b.rank >= MAX_RANK or not b.can_add_input:
      how = "concat"
    else:
      other = b.arg(b.shape, b.kind, -1 if b.kind == "f" else -3, 1 if b.kind == "f" else 3)
      axis = draw(st.integers(0, b.rank))
      b.emit(f"tf.stack([{b.cur}, {other}], axis={axis})", b.shape[:axis] + (2,) + b.shape[axis:],
             max(b.mag, b.vals[other][2]), b.err, kind=b.kind, tag=("stack",))
      return
  if b.can_add_input and draw(st.booleans()):
    size = _d(draw, DIMS)
    other = b.arg(b.shape[:axis] + (size,) + b.shape[axis + 1:], b.kind, -1 if b.kind == "f" else -3,
                  1 if b.kind == "f" else 3)
    parts = [b.cur, other] if draw(st.booleans()) else [other, b.cur]
  else:
    size = b.shape[axis]
    parts = [b.cur, b.cur]
  shape = b.shape[:axis] + (b.shape[axis] + size,) + b.shape[axis + 1:]
  if not _fits(shape):
    return _op_transpose(b)
  b.emit(f"tf.concat([{', '.join(parts)}], axis={shown})", shape, max(b.mag, 3.0 if b.kind == "i" else 1.0),
         b.err, kind=b.kind, tag=("concat",))


def _slice_text(s):
  start = "" if s.start is None else str(s.start)
  stop = "" if s.stop is None else str(s.stop)
  return f"{start}:{stop}" + ("" if s.step in (None, 1) else f":{s.step}")


def _op_slice(b):
  draw = b.draw
  if draw(st.booleans()):
    begin, size = [], []
    for n in b.shape:
      lo = draw(st.integers(0, n - 1))
      begin.append(lo)
      size.append(-1 if draw(st.integers(0, 3)) == 0 else draw(st.integers(1, n - lo)))
    out = tuple(n - lo if s == -1 else s for n, lo, s in zip(b.shape, begin, size))
    b.emit(f"tf.slice({b.cur}, {begin}, {size})", out, b.mag, b.err, kind=b.kind, tag=("slice",))
    return
  # Python indexing (StridedSlice): per dim ':', a range with a step, or one index (drops the dim).
  items, out, shrunk = [], [], 0
  for n in b.shape:
    kind = _d(draw, ("full", "range", "index") if shrunk < 1 and b.rank > 1 else ("full", "range"))
    if kind == "full":
      items.append(":")
      out.append(n)
    elif kind == "index":
      items.append(str(draw(st.integers(-n, n - 1))))
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
  b.emit(f"{b.cur}[{', '.join(items)}]", tuple(out), b.mag, b.err, kind=b.kind, tag=("strided_slice",))


def _op_pad(b):
  draw = b.draw
  mode = _d(draw, ("CONSTANT", "CONSTANT", "REFLECT", "SYMMETRIC")) if b.kind == "f" else "CONSTANT"
  pads = []
  for n in b.shape:
    top = n - 1 if mode == "REFLECT" else n
    pads.append([min(draw(st.integers(0, 3)), top), min(draw(st.integers(0, 3)), top)]
                if draw(st.integers(0, 2)) else [0, 0])
  shape = tuple(n + lo + hi for n, (lo, hi) in zip(b.shape, pads))
  if not _fits(shape):
    return _op_slice(b)
  extra = ""
  if mode == "CONSTANT" and draw(st.booleans()):
    extra = ", constant_values=" + ("2" if b.kind == "i" else "0.5")
  elif mode != "CONSTANT":
    extra = f", mode={mode!r}"
  b.emit(f"tf.pad({b.cur}, {pads}{extra})", shape, max(b.mag, 2.0 if extra else 0.0), b.err, kind=b.kind,
         tag=("pad",))


def _op_softmax(b):
  n = b.shape[-1]
  choice = _d(b.draw, ("softmax", "log_softmax", "softmax_axis0") if b.rank > 1 else ("softmax", "log_softmax"))
  if choice == "softmax_axis0":
    n = b.shape[0]
    b.emit(f"tf.nn.softmax({b.cur}, axis=0)", b.shape, 1.0, 2 * b.mag * b.err + _sum_err(n, 1.0, 2.0),
           tag=("softmax",))
  elif choice == "softmax":
    b.emit(f"tf.nn.softmax({b.cur})", b.shape, 1.0, 2 * b.mag * b.err + _sum_err(n, 1.0, 2.0), tag=("softmax",))
  else:
    mag = 2 * b.mag + math.log(n) + 1
    if mag > MAX_BOUND:
      return _op_unary(b)
    b.emit(f"tf.nn.log_softmax({b.cur})", b.shape, mag, 2 * b.err + _sum_err(n, 1.0, 2.0) + 2 * mag,
           tag=("log_softmax",))


def _op_cumsum(b):
  draw = b.draw
  axis = draw(st.integers(-b.rank, b.rank - 1))
  n = b.shape[axis]
  if b.mag * n > MAX_BOUND:
    return _op_unary(b)
  exclusive, reverse = draw(st.booleans()), draw(st.booleans())
  b.emit(f"tf.math.cumsum({b.cur}, axis={axis}, exclusive={exclusive}, reverse={reverse})", b.shape, b.mag * n,
         _sum_err(n, b.mag, b.err), kind=b.kind, tag=("cumsum",))


_CHAIN_OPS = {
    "unary": (_op_unary, 0), "binary": (_op_binary, 0), "select": (_op_select, 1), "matmul": (_op_matmul, 2),
    "reduce": (_op_reduce, 1), "transpose": (_op_transpose, 2), "reshape": (_op_reshape, 1),
    "expand_squeeze": (_op_expand_squeeze, 0), "concat": (_op_concat, 1), "slice": (_op_slice, 1),
    "softmax": (_op_softmax, 1), "cumsum": (_op_cumsum, 1), "pad": (_op_pad, 1), "tile": (_op_tile, 1),
}


def _chain(b, steps):
  for _ in range(steps):
    names = [k for k, (_, min_rank) in _CHAIN_OPS.items() if b.rank >= min_rank]
    _CHAIN_OPS[_d(b.draw, names)][0](b)


def _start(b, rank=None, lo=1, hi=MAX_RANK):
  return b.arg(_shape(b.draw, rank if rank is not None else b.draw(st.integers(lo, hi))))


# ---- families --------------------------------------------------------------------------------------------

def _fam_elementwise(b):
  _start(b)
  _chain_of(b, (_op_unary, _op_binary, _op_select), b.draw(st.integers(1, 2)))


def _chain_of(b, ops, steps):
  for _ in range(steps):
    op = _d(b.draw, ops)
    if op in (_op_select, _op_matmul, _op_transpose) and b.rank < {_op_select: 1, _op_matmul: 2,
                                                                    _op_transpose: 2}[op]:
      op = _op_unary
    op(b)


def _fam_matmul(b):
  _start(b, lo=2, hi=4)
  _op_matmul(b)
  if b.draw(st.booleans()):
    _chain_of(b, (_op_unary, _op_reduce, _op_binary), 1)


def _fam_einsum(b):
  draw = b.draw
  eq = _d(draw, ("ij,jk->ik", "bij,bjk->bik", "ij,ij->i", "ijk,kl->ijl", "bhqd,bhkd->bhqk", "i,j->ij", "ij,kj->ik",
                 "abc,ca->b", "bij->bji", "ijk->ik"))
  ins, out = eq.split("->")
  ins = ins.split(",")
  sizes = {c: _d(draw, (8, 12, 2, 3, 5, 7, 1, 4, 6)) for c in sorted(set("".join(ins)))}
  while math.prod(sizes.values()) > 3000:
    c = max(sizes, key=sizes.get)
    sizes[c] = max(1, sizes[c] // 2)
  names = [b.arg(tuple(sizes[c] for c in op)) for op in ins]
  k = math.prod(sizes[c] for c in set("".join(ins)) - set(out))
  mag = float(k)
  err = _sum_err(k, 1.0, 0.0) if len(ins) == 1 else _mm_err(k, 1, 0, 1, 0)
  b.emit(f"tf.einsum({eq!r}, {', '.join(names)})", tuple(sizes[c] for c in out), mag, err, tag=("einsum",))


def _fam_reduction(b):
  draw = b.draw
  _start(b)
  kind = _d(draw, ("reduce", "reduce", "cumsum", "argmax", "top_k", "prod"))
  if kind == "reduce":
    _op_reduce(b)
  elif kind == "cumsum":
    _op_cumsum(b)
  elif kind == "prod":
    axis = draw(st.integers(0, b.rank - 1))
    n = b.shape[axis]
    b.emit(f"tf.reduce_prod({b.cur}, axis={axis})", b.shape[:axis] + b.shape[axis + 1:], 1.0, 2.0 * n,
           tag=("prod",))
  elif kind == "argmax":
    axis = draw(st.integers(0, b.rank - 1))
    op = _d(draw, ("argmax", "argmin"))
    b.emit(f"tf.cast(tf.math.{op}({b.cur}, axis={axis}), tf.int32)", b.shape[:axis] + b.shape[axis + 1:],
           kind="i", tag=("argmax",))
  else:
    k = draw(st.integers(1, min(3, b.shape[-1])))
    b.emit(f"tf.math.top_k({b.cur}, {k}).values", b.shape[:-1] + (k,), b.mag, b.err, tag=("top_k",))


def _fam_softmax(b):
  draw = b.draw
  _start(b, lo=1, hi=3)
  kind = _d(draw, ("softmax", "softmax", "sparse_xent", "xent"))
  if kind == "softmax" or b.rank != 2:
    _op_softmax(b)
    return
  n, c = b.shape
  if kind == "sparse_xent":
    labels = b.arg((n,), "i", 0, c - 1)
    b.emit(f"tf.nn.sparse_softmax_cross_entropy_with_logits(labels={labels}, logits={b.cur})", (n,),
           2 + math.log(c) + 1, _sum_err(c, 3.0, 2.0) + 10, tag=("xent",))
  else:
    labels = b.arg((n, c), "f", 0, 1)
    b.emit(f"tf.nn.softmax_cross_entropy_with_logits(labels={labels}, logits={b.cur})", (n,),
           c * (3 + math.log(c)), _sum_err(c, 3 + math.log(c), 10.0), tag=("xent",))


def _fam_shape(b):
  _start(b, lo=2)
  _chain_of(b, (_op_transpose, _op_reshape, _op_expand_squeeze, _op_tile), b.draw(st.integers(1, 2)))


def _fam_concat(b):
  _start(b)
  _op_concat(b)
  if b.draw(st.booleans()):
    _op_unary(b)


def _fam_slice(b):
  _start(b)
  _op_slice(b)
  if b.draw(st.booleans()):
    _chain_of(b, (_op_unary, _op_slice), 1)


def _fam_pad(b):
  _start(b)
  _op_pad(b)
  if b.draw(st.booleans()):
    _op_slice(b)


def _fam_gather(b):
  draw = b.draw
  kind = _d(draw, ("gather", "gather", "gather_batch", "gather_nd", "one_hot"))
  if kind == "one_hot":
    shape = _shape(draw, draw(st.integers(1, 2)), 64)
    depth = _d(draw, (3, 5, 8))
    ids = b.arg(shape, "i", -1, depth)   # out-of-range ids give zero rows
    axis = draw(st.integers(-1, len(shape)))
    pos = axis % (len(shape) + 1)
    b.emit(f"tf.one_hot({ids}, {depth}, axis={axis})", shape[:pos] + (depth,) + shape[pos:], 1.0, 0.0,
           tag=("one_hot",))
    return
  params = _start(b, lo=1, hi=3)
  shape = b.shape
  if kind == "gather_nd":
    depth = draw(st.integers(1, len(shape)))
    k = _d(draw, (1, 3, 5, 8))
    ids = [[draw(st.integers(0, n - 1)) for n in shape[:depth]] for _ in range(k)]
    src = ids if draw(st.booleans()) else b.arg((k, depth), "i", 0, min(shape[:depth]) - 1)
    b.emit(f"tf.gather_nd({params}, {src})", (k,) + shape[depth:], b.mag, b.err, tag=("gather_nd",))
    return
  batch = 1 if kind == "gather_batch" and len(shape) >= 2 else 0
  axis = draw(st.integers(batch, len(shape) - 1))
  n = shape[axis]
  ishape = shape[:batch] + _shape(draw, draw(st.integers(1, 2)), 24, (1, 2, 3, 5, 8))
  if draw(st.booleans()):
    ids = b.arg(ishape, "i", 0, n - 1)
  else:
    ids = np.random.default_rng(draw(st.integers(0, 999))).integers(0, n, ishape).tolist()
  out = shape[:axis] + ishape[batch:] + shape[axis + 1:]
  if not _fits(out):
    return _op_slice(b)
  b.emit(f"tf.gather({params}, {ids}, axis={axis}, batch_dims={batch})", out, b.mag, b.err, tag=("gather",))
  if draw(st.booleans()):
    _op_unary(b)


def _fam_scatter(b):
  draw = b.draw
  kind = _d(draw, ("add", "update", "scatter_nd", "segment_sum", "max"))
  shape = _shape(draw, draw(st.integers(1, 3)), 200)
  n = shape[0]
  k = draw(st.integers(1, min(n, 6) if kind == "update" else 8))
  if kind == "segment_sum":
    data = b.arg((k,) + shape[1:])
    seg = b.arg((k,), "i", -1, n - 1) if draw(st.booleans()) else np.random.default_rng(k).integers(
        0, n, k).tolist()
    b.emit(f"tf.math.unsorted_segment_sum({data}, {seg}, {n})", shape, k, _sum_err(k, 1.0, 0.0),
           tag=("segment_sum",))
    return
  rows = np.random.default_rng(draw(st.integers(0, 999)))
  ids = (rows.permutation(n)[:k] if kind == "update" else rows.integers(0, n, k)).reshape(k, 1).tolist()
  ids_src = ids if draw(st.booleans()) else b.arg((k, 1), "i", 0, n - 1) if kind != "update" else ids
  updates = b.arg((k,) + shape[1:])
  if kind == "scatter_nd":
    b.emit(f"tf.scatter_nd({ids_src}, {updates}, {list(shape)})", shape, k, _sum_err(k, 1.0, 0.0),
           tag=("scatter_nd",))
    return
  tensor = b.arg(shape)
  fn = {"add": "tf.tensor_scatter_nd_add", "update": "tf.tensor_scatter_nd_update",
        "max": "tf.tensor_scatter_nd_max"}[kind]
  b.emit(f"{fn}({tensor}, {ids_src}, {updates})", shape, k + 1.0, _sum_err(k + 1, 1.0, 0.0), tag=(kind,))
  if draw(st.booleans()):
    _op_reduce(b)


def _image(draw, b, channels=(1, 2, 3, 4)):
  shape = (_d(draw, (1, 2, 3, 4)), _d(draw, (4, 5, 6, 7, 8, 9)), _d(draw, (4, 5, 6, 7)), _d(draw, channels))
  return b.arg(shape)


def _conv_geometry(h, w, kh, kw, padding, stride):
  if padding == "SAME":
    return -(-h // stride), -(-w // stride)
  return (h - kh) // stride + 1, (w - kw) // stride + 1


def _fam_conv(b):
  draw = b.draw
  x = _image(draw, b)
  n, h, w, c = b.shape
  kh, kw, co = _d(draw, (1, 2, 3)), _d(draw, (1, 2, 3)), _d(draw, (1, 2, 3, 4))
  stride = _d(draw, (1, 1, 2))
  padding = _d(draw, ("SAME", "VALID"))
  kernel = b.arg((kh, kw, c, co))
  oh, ow = _conv_geometry(h, w, kh, kw, padding, stride)
  k = kh * kw * c
  b.cur = x
  b.emit(f"tf.nn.conv2d({x}, {kernel}, strides={stride}, padding={padding!r})", (n, oh, ow, co), k,
         _mm_err(k, 1, 0, 1, 0), tag=("conv",))
  if draw(st.booleans()):
    bias = b.arg((co,))
    b.emit(f"tf.nn.relu(tf.nn.bias_add({b.cur}, {bias}))", (n, oh, ow, co), k + 1, b.err + k + 1, tag=("bias",))


def _fam_pool(b):
  draw = b.draw
  x = _image(draw, b)
  n, h, w, c = b.shape
  k, stride = _d(draw, (2, 3)), _d(draw, (1, 2, 3))
  padding = _d(draw, ("SAME", "VALID"))
  oh, ow = _conv_geometry(h, w, k, k, padding, stride)
  op = _d(draw, ("max_pool2d", "avg_pool2d"))
  err = 0.0 if op == "max_pool2d" else _sum_err(k * k, 1.0, 0.0) / (k * k) + 1
  b.emit(f"tf.nn.{op}({x}, {k}, {stride}, {padding!r})", (n, oh, ow, c), 1.0, err, tag=("pool",))


def _fam_while(b):
  draw = b.draw
  x = _start(b, lo=1, hi=3)
  shape, trips = b.shape, draw(st.integers(1, 3))
  kind = _d(draw, ("tanh", "matmul", "reduce") if len(shape) >= 2 else ("tanh", "reduce"))
  y = b.arg(shape)
  if kind == "matmul":
    k = shape[-1]
    w = b.arg((k, k))
    body = f"tf.tanh(tf.linalg.matmul(a, {w}) * {1.0 / k!r} + {y})"
    err = 0.0
    for _ in range(trips):
      err = _mm_err(k, 1, err, 1, 0) / k + 4
  elif kind == "reduce":
    body = f"0.5 * a + tf.reduce_mean({y}, axis=0, keepdims=True) * tf.tanh(a)"
    err = 0.0
    for _ in range(trips):
      err = 1.5 * err + _sum_err(shape[0], 1, 0) / shape[0] + 4
  else:
    body = f"tf.tanh(a * {y} + a)"
    err = 4.0 * trips
  counter = _d(draw, ("while", "max_iter"))
  if counter == "while":
    b.line(f"_, {b.cur}_loop = tf.while_loop(lambda i, a: i < {trips}, lambda i, a: (i + 1, {body}), "
           f"(tf.constant(0), tf.tanh({x})))")
  else:
    b.line(f"{b.cur}_loop = tf.while_loop(lambda a: tf.reduce_sum(a) < 1e9, lambda a: ({body},), (tf.tanh({x}),), "
           f"maximum_iterations={trips})[0]")
  b.emit(f"{x}_loop", shape, 2.0, err + 2, tag=("while",))


def _fam_cond(b):
  draw = b.draw
  x = _start(b, lo=1, hi=3)
  shape = b.shape
  y = b.arg(shape)
  pred = _d(draw, (f"tf.reduce_sum({x}) > 0", f"tf.reduce_max({y}) > 0.5", f"tf.reshape({x}, [-1])[0] > 0"))
  options = [("tf.tanh({x}) * {y}", 2.0), ("{x} + {y}", 4.0), ("tf.nn.softmax({x} - {y})", 2 + _sum_err(
      shape[-1], 1.0, 2.0) * 2), ("tf.reverse({x}, [0]) * 2.0", 2.0)]
  if len(shape) >= 2 and b.can_add_input:
    k = shape[-1]
    w = b.arg((k, k))
    options.append((f"tf.linalg.matmul({{x}}, {w})", _mm_err(k, 1, 0, 1, 0)))
  (t, et), (f, ef) = _d(draw, options), _d(draw, options)
  b.emit(f"tf.cond({pred}, lambda: {t.format(x=x, y=y)}, lambda: {f.format(x=x, y=y)})", shape,
         float(shape[-1]) + 2, max(et, ef) + shape[-1], tag=("cond",))


def _fam_gradient(b):
  """y = op(x...); grads of sum(y * g) w.r.t. the float arguments, through tf.GradientTape."""
  draw = b.draw
  kind = _d(draw, ("tanh_mul", "matmul", "conv", "max_pool", "avg_pool", "gather", "softmax", "reduce", "pad",
                   "slice", "concat", "einsum"))
  if kind == "conv":
    x = _image(draw, b)
    n, h, w, c = b.shape
    kh, kw, co = _d(draw, (1, 2, 3)), _d(draw, (1, 2, 3)), _d(draw, (1, 2, 3))
    stride, padding = _d(draw, (1, 2)), _d(draw, ("SAME", "VALID"))
    kern = b.arg((kh, kw, c, co))
    oh, ow = _conv_geometry(h, w, kh, kw, padding, stride)
    watched, expr, yshape = [x, kern], f"tf.nn.conv2d({x}, {kern}, {stride}, {padding!r})", (n, oh, ow, co)
    fan, ylen = [kh * kw * co, n * oh * ow], kh * kw * c
  elif kind in ("max_pool", "avg_pool"):
    x = _image(draw, b)
    n, h, w, c = b.shape
    k, stride, padding = _d(draw, (2, 3)), _d(draw, (1, 2, 3)), _d(draw, ("SAME", "VALID"))
    oh, ow = _conv_geometry(h, w, k, k, padding, stride)
    watched, expr, yshape = [x], f"tf.nn.{kind}2d({x}, {k}, {stride}, {padding!r})", (n, oh, ow, c)
    fan, ylen = [k * k], k * k
  elif kind in ("matmul", "einsum"):
    m, k, n = _d(draw, DIMS), _d(draw, DIMS), _d(draw, DIMS)
    x, w = b.arg((m, k)), b.arg((k, n))
    expr = f"tf.linalg.matmul({x}, {w})" if kind == "matmul" else f"tf.einsum('ij,jk->ik', {x}, {w})"
    watched, yshape, fan, ylen = [x, w], (m, n), [n, m], k
  else:
    x = _start(b, lo=1, hi=3)
    shape = b.shape
    watched, fan, ylen = [x], [1], 1
    if kind == "tanh_mul":
      y = b.arg(shape)
      watched, expr, yshape, fan = [x, y], f"tf.tanh({x} * {y})", shape, [1, 1]
    elif kind == "gather":
      ids = np.random.default_rng(draw(st.integers(0, 999))).integers(0, shape[0], 5).tolist()
      expr, yshape, fan = f"tf.gather({x}, {ids})", (5,) + shape[1:], [5]
    elif kind == "softmax":
      expr, yshape, fan, ylen = f"tf.nn.softmax({x})", shape, [shape[-1]], shape[-1]
    elif kind == "reduce":
      axis = draw(st.integers(0, len(shape) - 1))
      expr, yshape = f"tf.reduce_sum(tf.tanh({x}), axis={axis})", shape[:axis] + shape[axis + 1:]
      ylen = shape[axis]
    elif kind == "pad":
      pads = [[draw(st.integers(0, 2)), draw(st.integers(0, 2))] for _ in shape]
      expr, yshape = f"tf.pad({x}, {pads})", tuple(n + p + q for n, (p, q) in zip(shape, pads))
    elif kind == "slice":
      b.cur = x
      _op_slice(b)
      expr, yshape = b.lines.pop().split(" = ", 1)[1], b.shape
      del b.vals[b.cur]
      b.order.pop()
      b.cur = x
    else:
      other = b.arg(shape)
      watched, expr = [x, other], f"tf.concat([{x}, {other}], axis=0)"
      yshape, fan = (2 * shape[0],) + shape[1:], [1, 1]
  g = b.arg(yshape)
  b.line("with tf.GradientTape() as tape:")
  b.line(f"  tape.watch([{', '.join(watched)}])")
  b.line(f"  y = {expr}")
  b.line(f"  loss = tf.reduce_sum(y * {g})")
  grads = [f"d{k}" for k in range(len(watched))]
  b.line(f"{', '.join(grads)}, = [tf.convert_to_tensor(d) for d in tape.gradient(loss, [{', '.join(watched)}])]")
  b.vals["y"] = [yshape, "f", float(ylen), _mm_err(ylen, 1, 0, 1, 0)]
  for name, wname, n in zip(grads, watched, fan):
    b.vals[name] = [b.vals[wname][0], "f", float(n), _sum_err(n, 1.0, 2.0) + 4 * n]
  b.cur = grads[0]
  b.grad_outputs = ["y"] + grads


def _fam_int(b):
  draw = b.draw
  b.arg(_shape(draw, draw(st.integers(1, 3))), "i", -4, 4)
  for _ in range(draw(st.integers(1, 3))):
    op = _d(draw, ("binary", "unary", "reduce", "cumsum", "matmul", "view", "gather", "concat", "pad"))
    if op == "binary":
      y = b.arg(b.shape, "i", -4, 4) if b.can_add_input else b.cur
      fn = _d(draw, ("tf.add", "tf.multiply", "tf.maximum", "tf.minimum", "tf.subtract"))
      b.emit(f"{fn}({b.cur}, {y})", b.shape, kind="i", tag=("int",))
    elif op == "unary":
      expr = _d(draw, ("tf.abs({})", "tf.math.floormod({}, 3)", "-{}", "{} * 3 + 1", "tf.math.floordiv({}, 2)"))
      b.emit(expr.format(b.cur), b.shape, kind="i", tag=("int",))
    elif op == "reduce" and b.rank:
      axes, axis_src = _axes(draw, b.rank)
      fn = _d(draw, ("sum", "max", "min"))
      keep = draw(st.booleans())
      shape = tuple(1 if i in axes else d for i, d in enumerate(b.shape)) if keep else tuple(
          d for i, d in enumerate(b.shape) if i not in axes)
      b.emit(f"tf.reduce_{fn}({b.cur}, axis={axis_src}, keepdims={keep})", shape, kind="i", tag=("int",))
    elif op == "cumsum" and b.rank:
      b.emit(f"tf.math.cumsum({b.cur}, axis={draw(st.integers(0, b.rank - 1))})", b.shape, kind="i", tag=("int",))
    elif op == "matmul" and b.rank == 2 and b.can_add_input:
      w = b.arg((b.shape[1], _d(draw, DIMS)), "i", -3, 3)
      b.emit(f"tf.linalg.matmul({b.cur}, {w})", (b.shape[0], b.vals[w][0][1]), kind="i", tag=("int",))
    elif op == "gather" and b.rank:
      ids = np.random.default_rng(b.rank).integers(0, b.shape[0], 4).tolist()
      b.emit(f"tf.gather({b.cur}, {ids})", (4,) + b.shape[1:], kind="i", tag=("int",))
    elif op == "concat" and b.rank:
      _op_concat(b)
    elif op == "pad" and b.rank:
      _op_pad(b)
    elif b.rank >= 2:
      _d(draw, (_op_transpose, _op_reshape, _op_slice))(b)
    elif b.rank:
      _op_slice(b)


def _fam_bool(b):
  draw = b.draw
  kind = _d(draw, ("compare", "logic", "reduce", "where", "cast"))
  if kind in ("logic", "reduce"):
    p = b.arg(_shape(draw, draw(st.integers(1, 3))), "b")
    q = b.arg(b.shape, "b")
    fn = _d(draw, ("tf.logical_and", "tf.logical_or", "tf.math.logical_xor"))
    b.emit(f"tf.logical_not({fn}({p}, {q}))", b.shape, kind="b", tag=("bool",))
    if kind == "reduce":
      axes, axis_src = _axes(draw, b.rank)
      fn = _d(draw, ("any", "all"))
      b.emit(f"tf.reduce_{fn}({b.cur}, axis={axis_src})", tuple(d for i, d in enumerate(b.shape) if i not in axes),
             kind="b", tag=("bool",))
    elif b.rank >= 2 and draw(st.booleans()):
      _op_transpose(b)
    return
  x = _start(b, lo=1, hi=3)
  y = b.arg(b.shape)
  cmp = _d(draw, ("tf.greater", "tf.less", "tf.greater_equal", "tf.not_equal"))
  mask = b.emit(f"{cmp}({x}, {y})", b.shape, kind="b", tag=("bool",))
  if kind == "where":
    b.emit(f"tf.where({mask}, {x}, tf.zeros_like({y}))", b.shape, 1.0, 0.0, tag=("bool",))
  elif kind == "cast":
    axes, axis_src = _axes(draw, b.rank)
    b.emit(f"tf.reduce_sum(tf.cast({mask}, tf.int32), axis={axis_src})",
           tuple(d for i, d in enumerate(b.shape) if i not in axes), kind="i", tag=("bool",))


def _fam_chain(b):
  _start(b)
  _chain(b, b.draw(st.integers(2, 4)))


_FAMILY_FNS = {
    "elementwise": _fam_elementwise, "matmul": _fam_matmul, "einsum": _fam_einsum, "reduction": _fam_reduction,
    "softmax": _fam_softmax, "shape": _fam_shape, "concat": _fam_concat, "slice": _fam_slice, "pad": _fam_pad,
    "gather": _fam_gather, "scatter": _fam_scatter, "conv": _fam_conv, "pool": _fam_pool, "while": _fam_while,
    "cond": _fam_cond, "gradient": _fam_gradient, "int": _fam_int, "bool": _fam_bool, "chain": _fam_chain,
}
assert tuple(_FAMILY_FNS) == FAMILIES


# ---- shardings -------------------------------------------------------------------------------------------

def _spec(draw, mesh, shape):
  """A random P for `shape` over `mesh`: each mesh axis splits one dim or none, in a random order within a
  dim (multi-axis entries like P(("x", "y"))); trailing Nones are sometimes left off."""
  rank = len(shape)
  if rank == 0:
    return P()
  owner = [draw(st.sampled_from([None] + list(range(rank)))) for _ in mesh.axis_names]
  entries = []
  for d in range(rank):
    axes = [a for a, o in zip(mesh.axis_names, owner) if o == d]
    if len(axes) > 1:
      axes = draw(st.permutations(axes))
    entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  if draw(st.booleans()):
    while entries and entries[-1] is None:
      entries.pop()
  return P(*entries)


def _splitting_spec(draw, mesh, shape):
  """A spec that splits some dim of size >= 2 (None if `shape` has none)."""
  big = [d for d, n in enumerate(shape) if n >= 2]
  if not big:
    return None
  for _ in range(8):
    spec = _spec(draw, mesh, shape)
    s = Sharding.from_spec(mesh, spec, len(shape))
    if any(s.dims[d] for d in big):
      return spec
  entries = [None] * len(shape)
  entries[_d(draw, big)] = _d(draw, mesh.axis_names)
  return P(*entries)


def make_case(index, mesh_key, family, seed):
  draw = Draw(seed)
  mesh = MESHES[mesh_key]
  b = _Builder(draw)
  b.grad_outputs = None
  _FAMILY_FNS[family](b)
  if b.grad_outputs:
    outputs = b.grad_outputs
  else:
    outputs = [b.cur]
    if draw(st.integers(0, 4)) == 0:   # a second output: any tensor of the program, even an argument
      outputs.append(_d(draw, list(b.vals)[::-1]))
  ret = ", ".join(outputs)
  source = "\n".join([f"def fn({', '.join(f'x{i}' for i in range(len(b.args)))}):"] + b.lines + [
      f"  return ({ret},)"])
  # Arguments mostly sharded, sometimes left to completion (None); 1 case in 20 splits nothing on purpose.
  replicate_all = draw(st.integers(0, 19)) == 0
  in_specs = []
  for i, a in enumerate(b.args):
    if replicate_all:
      in_specs.append(_d(draw, (None, P())))
    elif draw(st.integers(0, 4)) == 0:
      in_specs.append(None)
    else:
      in_specs.append(_spec(draw, mesh, a.shape))
  in_specs = tuple(in_specs)
  case = Case(index, family, mesh_key, source, tuple(b.args), in_specs, None,
              tuple(b.out(n) for n in outputs), int(draw(st.integers(0, 2**16))))
  if not replicate_all and not case.splits:
    float_or_big = [i for i, a in enumerate(b.args) if any(n >= 2 for n in a.shape)]
    if float_or_big:
      i = _d(draw, float_or_big)
      in_specs = in_specs[:i] + (_splitting_spec(draw, mesh, b.args[i].shape),) + in_specs[i + 1:]
  out_specs = None
  if draw(st.booleans()):
    out_specs = tuple(None if draw(st.integers(0, 3)) == 0 else _spec(draw, mesh, o.shape) for o in case.outs)
  return dataclasses.replace(case, in_specs=in_specs, out_specs=out_specs)


def all_cases():
  """CASES_PER_MESH cases on each mesh, families in turn (so each batch mixes them), seeded by index."""
  cases = []
  for m, mesh_key in enumerate(MESHES):
    for k in range(CASES_PER_MESH):
      index = m * CASES_PER_MESH + k
      cases.append(make_case(index, mesh_key, FAMILIES[(k * 7 + m) % len(FAMILIES)], SEED * 100003 + index))
  return cases


# ---------------------------------------------------------------------------------------------------------
# Checking
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


def _compare(got, want, out, what):
  """None if `got` matches `want` (exactly for int and bool, else within `_tolerance`), else why not."""
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape:
    return f"{what}: shape {got.shape} != {want.shape}"
  if out.kind != "f":
    bad = got != want
    return f"{what}: {int(bad.sum())} element(s) differ (exact dtype)" if bad.any() else None
  atol, rtol = _tolerance(out)
  diff = np.abs(got.astype(np.float64) - want)
  bad = ~(diff <= atol + rtol * np.abs(want))
  if bad.any():
    return (f"{what}: {int(bad.sum())} element(s) off, worst |diff| {float(np.nanmax(diff)):.3g} "
            f"(atol {atol:.3g}, rtol {rtol:.3g})")
  return None


def _compile(case):
  namespace = {"tf": tf}
  exec(compile(case.source, f"<case {case.index}>", "exec"), namespace)  # pylint: disable=exec-used
  return namespace["fn"]


def _check_case(case, fn, args, got, low, in_offset, out_offset):
  """Problems of one case within its batch's results: [] when it agrees with its unpartitioned run."""
  mesh = MESHES[case.mesh_key]
  problems = []
  expected = [np.asarray(e) for e in fn(*[tf.constant(a) for a in args])]
  assert [e.shape for e in expected] == [o.shape for o in case.outs], "generator shape bookkeeping is off"
  for k, (spec, a) in enumerate(zip(case.in_specs, case.args)):
    if spec is not None:
      lowered = low.in_shardings[in_offset + k].with_rank(len(a.shape))
      if lowered != Sharding.from_spec(mesh, spec, len(a.shape)):
        problems.append(f"argument {k}: declared {spec}, lowered as {lowered}")
  for k, (want, out) in enumerate(zip(expected, case.outs)):
    value = got[out_offset + k]
    shape = want.shape
    problem = _compare(value.numpy(), want, out, f"output {k} global value")
    if problem:
      problems.append(problem)
      continue
    sharding = value.sharding
    if case.out_specs is not None and case.out_specs[k] is not None:
      if sharding.with_rank(len(shape)) != Sharding.from_spec(mesh, case.out_specs[k], len(shape)):
        problems.append(f"output {k}: declared {case.out_specs[k]}, got {sharding}")
    if sharding.is_maximal:
      problem = _compare(value.components[sharding.maximal].numpy(), want, out, f"output {k} maximal component")
      if problem:
        problems.append(problem)
      continue
    sharding = sharding.with_rank(len(shape))
    local = sharding.shard_shape(shape)
    shapes = [tuple(c.shape) for c in value.components]
    if shapes != [local] * mesh.size:
      problems.append(f"output {k} ({sharding}): component shapes {shapes}, want {local}")
      continue
    for p, comp in enumerate(value.components):
      glob, loc = _valid_block(sharding, shape, p)
      problem = _compare(comp.numpy()[loc], want[glob], out, f"output {k} ({sharding}), component on device {p}")
      if problem:
        problems.append(problem)
        break
  return problems


_CASE_OF = re.compile(r"(?:^|/)c(\d+)/")


def run_batch(cases):
  """Runs `cases` (one mesh) side by side in one gs.function; returns ({case index: problems}, the report)."""
  mesh = MESHES[cases[0].mesh_key]
  fns = [_compile(c) for c in cases]

  def program(*flat):
    outs, offset = [], 0
    for c, fn in zip(cases, fns):
      with tf.name_scope(f"c{c.index}"):
        outs.extend(fn(*flat[offset:offset + len(c.args)]))
      offset += len(c.args)
    return tuple(outs)

  in_specs = tuple(s for c in cases for s in c.in_specs)
  out_specs = tuple(s for c in cases for s in (c.out_specs or (None,) * len(c.outs)))
  args = []
  for c in cases:
    rng = np.random.default_rng(c.seed)
    args.append([a.value(rng) for a in c.args])
  f = gs.function(tf.function(program, autograph=False), mesh=mesh, in_shardings=in_specs, out_shardings=out_specs)
  got = f(*[a for per_case in args for a in per_case])
  got = list(got) if isinstance(got, (tuple, list)) else [got]
  low = f.lower(*[tf.TensorSpec(a.shape, a.dtype) for c in cases for a in c.args])
  problems, in_offset, out_offset = {}, 0, 0
  for c, fn, a in zip(cases, fns, args):
    found = _check_case(c, fn, a, got, low, in_offset, out_offset)
    if found:
      problems[c.index] = found
    in_offset += len(c.args)
    out_offset += len(c.outs)
  return problems, low.report


def _culprit(cases):
  """The first case that fails on its own (a batch raised): (case, exception)."""
  for c in cases:
    try:
      run_batch([c])
    except Exception as e:  # pylint: disable=broad-except
      return c, e
  return None, None


@pytest.fixture
def graph_optimizer_off():
  """TF's runtime graph optimizer off while the suite runs (see the module docstring), restored after."""
  before = tf.config.optimizer.get_experimental_options()
  tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
  yield
  tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": before.get("disable_meta_optimizer",
                                                                                       False)})


def test_differential_suite(graph_optimizer_off):  # pylint: disable=redefined-outer-name,unused-argument
  start = time.perf_counter()
  cases = all_cases()
  by_index = {c.index: c for c in cases}
  mismatches, errors = {}, []
  kinds, case_kinds = collections.Counter(), collections.defaultdict(set)
  batches = 0
  for mesh_key in MESHES:
    on_mesh = [c for c in cases if c.mesh_key == mesh_key]
    for i in range(0, len(on_mesh), BATCH):
      batch = on_mesh[i:i + BATCH]
      batches += 1
      try:
        problems, report = run_batch(batch)
      except Exception as e:  # pylint: disable=broad-except
        case, error = _culprit(batch)
        errors.append(f"{case!r}raised {type(error).__name__}: {error}" if case is not None else
                      f"batch of cases {batch[0].index}..{batch[-1].index} raised {type(e).__name__}: {e}")
        continue
      mismatches.update(problems)
      for rec in report.collectives:
        kinds[rec.kind] += 1
        m = _CASE_OF.search(rec.source)
        if m and int(m.group(1)) in by_index:
          case_kinds[int(m.group(1))].add(rec.kind)
  elapsed = time.perf_counter() - start

  n = len(cases)
  split = sum(c.splits for c in cases)
  uneven = sum(any(size % 2 for a in c.args for size in a.shape if size > 1) for c in cases)
  families = collections.Counter(c.family for c in cases)
  dtypes = collections.Counter(a.kind for c in cases for a in c.args)
  with_out = sum(c.out_specs is not None for c in cases)
  per_kind_cases = collections.Counter(k for ks in case_kinds.values() for k in ks)
  print(f"\ndifferential suite: {n} cases in {batches} lowerings, {elapsed:.1f} s")
  print(f"  split at least one argument: {split} ({100 * split / n:.1f}%); with an odd dim: {uneven}; "
        f"with output shardings: {with_out}")
  print(f"  argument dtypes: {dict(dtypes)}")
  print(f"  collectives by kind: {dict(kinds)}")
  print(f"  cases emitting each kind: {dict(per_kind_cases)}; cases with any collective: {len(case_kinds)}")
  print(f"  families: {dict(families)}")
  print(f"  mismatches: {len(mismatches)}, errors: {len(errors)}")

  failures = [f"{by_index[i]!r}" + "\n".join(p) for i, p in sorted(mismatches.items())] + errors
  assert not failures, f"{len(failures)} failing case(s):\n" + "\n\n".join(failures[:10])
  assert n >= 2000
  assert split / n >= 0.9, f"only {split}/{n} cases split an argument"
  assert set(kinds) == set(KINDS), f"collective kinds emitted: {dict(kinds)}"
  assert set(families) == set(FAMILIES)


# ---------------------------------------------------------------------------------------------------------
# Minimal reproducers of bugs this suite found
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
  np.testing.assert_allclose(f(*args).numpy(), fn(*args), rtol=1e-5, atol=1e-5)
