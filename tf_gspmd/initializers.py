"""Initializers that create a sharded variable shard by shard, with values that do not depend on the mesh.

Every random initializer here defines the *global* tensor element by element: element i (its row-major index
in the global shape) is a hash of (seed, i) mapped to the distribution. A shard is computed on its own device
from its own indices, so creating a variable never needs its full value anywhere, and the same seed gives
the same values on every mesh, in every layout, and unsharded (`init(shape)`), which makes partitioned and
single-device runs start from identical weights.

The hash is murmur3's 32-bit finaliser over the index's two 32-bit words and the seed; uniform values are
its top 24 bits mapped into (0, 1), normal values their inverse normal CDF. The streams are statistically
sound for initialisation, not for cryptography, and differ from TF's and Keras's own random streams.

Keras initializers (`GlorotUniform`, `HeNormal`, `RandomNormal`, `Zeros`, ...) are converted with
`from_keras`, keeping their distribution and scale (computed from the global shape).
"""

import contextlib
import ctypes
import ctypes.util
import dataclasses
import math
import os
import threading

import numpy as np
import tensorflow as tf

from tf_gspmd.errors import InputError


def _fmix(h):
  h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 16))
  h = h * tf.constant(0x85EBCA6B, tf.uint32)
  h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 13))
  h = h * tf.constant(0xC2B2AE35, tf.uint32)
  return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 16))


def _global_index(shape, starts, lengths):
  """int64 row-major indices in `shape` of the block at `starts` with `lengths` (the block's own shape)."""
  index = tf.zeros(lengths, tf.int64)
  stride = 1
  for d in range(len(shape) - 1, -1, -1):
    axis = tf.range(starts[d], starts[d] + lengths[d], dtype=tf.int64) * stride
    index += tf.reshape(axis, [lengths[d] if k == d else 1 for k in range(len(shape))])
    stride *= shape[d]
  return index


def _uniform01(shape, starts, lengths, seed):
  """Uniform values in (0, 1) for the block, a function of (seed, global index) only."""
  i = _global_index(shape, starts, lengths)
  lo = tf.cast(tf.bitwise.bitwise_and(i, 0xFFFFFFFF), tf.uint32)
  hi = tf.cast(tf.bitwise.right_shift(i, 32), tf.uint32)
  s = tf.constant(seed & 0xFFFFFFFF, tf.uint32)
  h = _fmix(tf.bitwise.bitwise_xor(lo * tf.constant(0x9E3779B1, tf.uint32), s))
  h = _fmix(tf.bitwise.bitwise_xor(h, hi * tf.constant(0x85EBCA77, tf.uint32) + tf.constant(0x27D4EB2F, tf.uint32)))
  bits = tf.cast(tf.bitwise.right_shift(h, 8), tf.float64)
  return (bits + 0.5) / float(1 << 24)


# Elements generated at once by `Initializer.chunked`: a random block's temporaries (int64 indices, uint32 hash
# words, float64 values) are ~40 bytes per element, so 1M elements keep them near 40 MiB whatever the shard size.
CHUNK_ELEMENTS = 1 << 20


def _load_libc(name):
  try:
    return getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
  except (OSError, AttributeError, TypeError):   # not glibc: nothing to hand back
    return None


_MALLOC_TRIM = _load_libc("malloc_trim")
_MALLOPT = _load_libc("mallopt")
_M_MMAP_THRESHOLD = -3                         # mallopt's parameter number (malloc.h)
_MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * 8      # glibc's largest dynamic threshold on 64-bit hosts (32 MiB)


_unmapped_depth = [0]
_unmapped_lock = threading.Lock()


def _configured_mmap_threshold():
  """The threshold the process was started with (glibc's MALLOC_MMAP_THRESHOLD_), or None."""
  try:
    return int(os.environ["MALLOC_MMAP_THRESHOLD_"])
  except (KeyError, ValueError):
    return None


@contextlib.contextmanager
def large_blocks_unmapped(threshold=1 << 20):
  """Within: heap blocks of `threshold` bytes or more get their own mapping, returned to the OS when freed.

  glibc serves blocks under its dynamic mmap threshold (which rises to 32 MiB once such a block was freed) from
  per-thread arenas and keeps them there when freed; TF runs eager ops on several threads, so a loop of reads
  whose buffers are freed by one thread and allocated anew by another grows by one buffer per thread. On exit
  the threshold is the one the process was started with (MALLOC_MMAP_THRESHOLD_), else glibc's dynamic maximum,
  where a process that has freed a large block stands anyway. Nests; also usable as a decorator.
  """
  if _MALLOPT is None:
    yield
    return
  configured = _configured_mmap_threshold()
  with _unmapped_lock:
    _unmapped_depth[0] += 1
    _MALLOPT(_M_MMAP_THRESHOLD, int(min(threshold, configured) if configured is not None else threshold))
  try:
    yield
  finally:
    with _unmapped_lock:
      _unmapped_depth[0] -= 1
      if not _unmapped_depth[0]:
        _MALLOPT(_M_MMAP_THRESHOLD, configured if configured is not None else _MMAP_THRESHOLD_MAX)


def _release_freed():
  """Hands freed heap pages back to the OS (glibc keeps freed blocks under its mmap threshold, up to 32 MiB, in
  its arenas, so a chunked block's temporaries would otherwise stay resident after they are freed)."""
  if _MALLOC_TRIM is not None:
    _MALLOC_TRIM(0)


class Initializer:
  """Base: `init(shape, dtype)` gives the whole tensor; `block(shape, starts, lengths, dtype)` one block of it;
  `chunked(...)` the same block generated a piece at a time (temporaries of one piece, not of the block)."""

  def block(self, shape, starts, lengths, dtype):
    raise NotImplementedError

  def chunked(self, shape, starts, lengths, dtype, chunk_elements=CHUNK_ELEMENTS):
    """`block(...)` built from pieces of at most ~`chunk_elements` along its outer dims, then concatenated.

    Values depend only on the global index, so the pieces are exactly the block's; the peak is the block, its
    pieces and one piece's temporaries (a random block alone holds ~10x its size in temporaries)."""
    def at(k, r, n, st, ln):
      return st[:k] + (st[k] + r,) + st[k + 1:], ln[:k] + (n,) + ln[k + 1:]

    def build(k, st, ln):   # dims before k have length 1 here, or the block is small enough
      if math.prod(ln[k:]) <= chunk_elements or k == len(ln):
        return self.block(shape, st, ln, dtype)
      inner = math.prod(ln[k + 1:])
      if inner > chunk_elements:   # one index of dim k is itself too big: split the next dim too
        pieces = [build(k + 1, *at(k, r, 1, st, ln)) for r in range(ln[k])]
      else:
        step, pieces = max(1, chunk_elements // inner), []
        for r in range(0, ln[k], step):
          pieces.append(self.block(shape, *at(k, r, min(step, ln[k] - r), st, ln), dtype))
          _release_freed()
      return tf.concat(pieces, axis=k)

    return build(0, tuple(int(s) for s in starts), tuple(int(n) for n in lengths))

  def __call__(self, shape, dtype=tf.float32):
    shape = tuple(int(s) for s in shape)
    return self.block(shape, (0,) * len(shape), shape, tf.as_dtype(dtype))


@dataclasses.dataclass(frozen=True)
class Constant(Initializer):
  value: float = 0.0

  def block(self, shape, starts, lengths, dtype):
    return tf.fill(lengths, tf.cast(self.value, dtype))

  def chunked(self, shape, starts, lengths, dtype, chunk_elements=CHUNK_ELEMENTS):
    return self.block(shape, starts, lengths, dtype)   # no temporaries


def zeros():
  return Constant(0.0)


def ones():
  return Constant(1.0)


@dataclasses.dataclass(frozen=True)
class Uniform(Initializer):
  minval: float = -0.05
  maxval: float = 0.05
  seed: int = 0

  def block(self, shape, starts, lengths, dtype):
    u = _uniform01(shape, starts, lengths, self.seed)
    return tf.cast(self.minval + (self.maxval - self.minval) * u, dtype)


@dataclasses.dataclass(frozen=True)
class Normal(Initializer):
  """Normal(mean, stddev); `truncated` redraws nothing: values come from the normal restricted to ±2 stddev."""

  mean: float = 0.0
  stddev: float = 0.05
  seed: int = 0
  truncated: bool = False

  def block(self, shape, starts, lengths, dtype):
    u = _uniform01(shape, starts, lengths, self.seed)
    if self.truncated:
      lo = 0.5 * math.erfc(2.0 / math.sqrt(2.0))
      u = lo + (1.0 - 2.0 * lo) * u
    return tf.cast(self.mean + self.stddev * tf.math.ndtri(u), dtype)


@dataclasses.dataclass(frozen=True)
class VarianceScaling(Initializer):
  """Keras/TF variance scaling on the *global* shape (fans as Keras computes them)."""

  scale: float = 1.0
  mode: str = "fan_in"
  distribution: str = "truncated_normal"
  seed: int = 0

  def block(self, shape, starts, lengths, dtype):
    fan_in, fan_out = _fans(shape)
    n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2.0}[self.mode]
    var = self.scale / max(1.0, n)
    if self.distribution == "uniform":
      limit = math.sqrt(3.0 * var)
      return Uniform(-limit, limit, self.seed).block(shape, starts, lengths, dtype)
    if self.distribution in ("truncated_normal", "normal"):
      truncated = self.distribution == "truncated_normal"
      std = math.sqrt(var) / (0.87962566103423978 if truncated else 1.0)
      return Normal(0.0, std, self.seed, truncated).block(shape, starts, lengths, dtype)
    return Normal(0.0, math.sqrt(var), self.seed).block(shape, starts, lengths, dtype)


def _fans(shape):
  if not shape:
    return 1.0, 1.0
  if len(shape) == 1:
    return float(shape[0]), float(shape[0])
  receptive = float(np.prod(shape[:-2])) if len(shape) > 2 else 1.0
  return shape[-2] * receptive, shape[-1] * receptive


def glorot_uniform(seed=0):
  return VarianceScaling(1.0, "fan_avg", "uniform", seed)


def glorot_normal(seed=0):
  return VarianceScaling(1.0, "fan_avg", "truncated_normal", seed)


def he_normal(seed=0):
  return VarianceScaling(2.0, "fan_in", "truncated_normal", seed)


def get(initializer, seed=0):
  """An `Initializer` from one of ours, a Keras initializer (object or name), a number, or None (zeros)."""
  if initializer is None:
    return zeros()
  if isinstance(initializer, Initializer):
    return initializer
  if isinstance(initializer, (int, float)):
    return Constant(float(initializer))
  return from_keras(initializer, seed)


def from_keras(initializer, seed=0):
  """The mesh-independent equivalent of a Keras initializer (same distribution and scale)."""
  import keras  # pylint: disable=g-import-not-at-top
  init = keras.initializers.get(initializer)
  config = init.get_config() if hasattr(init, "get_config") else {}
  s = config.get("seed")
  s = seed if s is None else int(s)
  name = type(init).__name__
  if name == "Zeros":
    return zeros()
  if name == "Ones":
    return ones()
  if name == "Constant":
    return Constant(float(config["value"]))
  if name == "RandomUniform":
    return Uniform(config["minval"], config["maxval"], s)
  if name in ("RandomNormal", "TruncatedNormal"):
    return Normal(config["mean"], config["stddev"], s, truncated=name == "TruncatedNormal")
  if isinstance(init, keras.initializers.VarianceScaling):   # and its named forms (Glorot, He, Lecun)
    return VarianceScaling(float(init.scale), init.mode, init.distribution, s)
  raise InputError(f"initializer {name} has no shard-by-shard equivalent; use tf_gspmd.initializers (Uniform, "
                   "Normal, VarianceScaling, Constant) or create the variable with its value")
