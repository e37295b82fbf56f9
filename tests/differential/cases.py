"""The differential suite's cases: meshes and sizes, seeded drawing, Arg / Out / Case and the tolerances.

Generation is seeded numpy (`st` is a small stand-in for Hypothesis' strategies, `Draw` applies one), so every
run draws the same cases. A case's float outputs carry an error scale from which `_tolerance` derives the
allowed difference between the partitioned and the unpartitioned run (see "Error bookkeeping" below).
"""

import dataclasses
import math
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd._layout.sharding import Sharding

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
            "tf_gspmd as gs; from tf_gspmd import P; gs.split_cpu_devices(8); and tests/differential/cases.py's "
            "Arg) ---\n"
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
