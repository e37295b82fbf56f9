"""Philox-4x32-10 and TF's bit-exact distributions written in TF integer ops, for any set of output groups.

TF's stateless kernels (tsl/lib/random: philox_random.h, random_distributions.h) compute output group g of an op
from one Philox call at the op's 128-bit counter plus g (ops/random.py has the group sizes): a device can then
compute its shard's groups alone, at any index, with the values the whole op gives them. A Philox call maps a
counter of four uint32 words (c0 the least significant) and a key of two (k0, k1) to four uint32 words by ten
rounds of

  hi0:lo0 = 0xD2511F53 * c0,  hi1:lo1 = 0xCD9E8D57 * c2   (64-bit products)
  (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0),  then k0 += 0x9E3779B9, k1 += 0xBB67AE85

(the key raised after each round; the last raise unused). The 64-bit products are uint64 multiplications of
values below 2**32, exact; the rest is uint32 arithmetic, which TF's CPU and GPU kernels wrap as C does. The op's
uint64 key input is (k0, k1) as (low, high) words, its counter input (c0 | c1 << 32, c2 | c3 << 32).

Only the distributions that are bit manipulations of the words are here: uniform floats (a mantissa of random
bits, minus 1), bounded ints (a modulus) and full-range ints. The normal ones apply Box-Muller with the C
library's logf and sincosf (CUDA's on GPUs), whose last bit TF's math ops do not reproduce (ops/random.py).
"""

import tensorflow as tf

ROUNDS = 10
MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
_U32, _U64 = tf.uint32, tf.uint64


def _words64(x):
  """uint64 `x` as its (low, high) uint32 words."""
  low = tf.cast(tf.bitwise.bitwise_and(x, tf.constant(0xFFFFFFFF, _U64)), _U32)
  high = tf.cast(tf.bitwise.right_shift(x, tf.constant(32, _U64)), _U32)
  return low, high


def _join64(low, high):
  """uint32 words (low, high) as one uint64."""
  return tf.bitwise.bitwise_or(tf.cast(low, _U64), tf.bitwise.left_shift(tf.cast(high, _U64), tf.constant(32, _U64)))


def _mul_high_low(multiplier, x):
  """(high, low) uint32 words of the 64-bit product of a constant and uint32 `x`."""
  low, high = _words64(tf.cast(x, _U64) * tf.constant(multiplier, _U64))
  return high, low


def counters(counter, groups):
  """The Philox counters `counter` (the op's uint64 [2] input) + `groups` (uint64, any shape), as four uint32
  words: the 128-bit addition PhiloxRandom::Skip does, a carry out of the low uint64 into the high one."""
  low = counter[0] + groups
  high = counter[1] + tf.cast(low < groups, _U64)
  return _words64(low) + _words64(high)


def philox(key, words):
  """The four uint32 words Philox-4x32-10 gives for counter `words` (four uint32 tensors, least significant
  first) under `key` (the op's uint64 [1] input)."""
  k0, k1 = _words64(key[0])
  c0, c1, c2, c3 = words
  steps = (tf.constant(KEY_STEPS[0], _U32), tf.constant(KEY_STEPS[1], _U32))
  for r in range(ROUNDS):
    hi0, lo0 = _mul_high_low(MULTIPLIERS[0], c0)
    hi1, lo1 = _mul_high_low(MULTIPLIERS[1], c2)
    c0, c1, c2, c3 = (tf.bitwise.bitwise_xor(tf.bitwise.bitwise_xor(hi1, c1), k0), lo1,
                      tf.bitwise.bitwise_xor(tf.bitwise.bitwise_xor(hi0, c3), k1), lo0)
    if r + 1 < ROUNDS:
      k0, k1 = k0 + steps[0], k1 + steps[1]
  return c0, c1, c2, c3


def _unit_float(words, mantissa_bits, dtype):
  """Uint32ToFloat, Uint16ToHalf, Uint16ToGfloat16: the low `mantissa_bits` bits as a mantissa of 1.m, minus 1.
  Computed in float32 (exactly: m has at most 23 bits) and cast to `dtype`, which holds it exactly too."""
  mantissa = tf.bitwise.bitwise_and(words, tf.constant((1 << mantissa_bits) - 1, _U32))
  bits = tf.bitwise.bitwise_or(tf.bitwise.left_shift(mantissa, tf.constant(23 - mantissa_bits, _U32)),
                               tf.constant(127 << 23, _U32))
  return tf.cast(tf.bitcast(bits, tf.float32) - 1.0, dtype)


def _unit_double(high, low):
  """Uint64ToDouble: 20 bits of `high` and all of `low` as the mantissa of 1.m, minus 1."""
  bits = tf.bitwise.bitwise_or(
      tf.bitwise.bitwise_and(_join64(low, high), tf.constant((1 << 52) - 1, _U64)), tf.constant(1023 << 52, _U64))
  return tf.bitcast(bits, tf.float64) - 1.0


_MANTISSA_BITS = {tf.float32: 23, tf.float16: 10, tf.bfloat16: 7}


def uniform(words, dtype):
  """UniformDistribution of a float `dtype`: [..., G] outputs from the four words of each group (G = 4, or 2 for
  float64, whose outputs take two words each, the first the high one)."""
  if dtype == tf.float64:
    return tf.stack([_unit_double(words[0], words[1]), _unit_double(words[2], words[3])], -1)
  return tf.stack([_unit_float(w, _MANTISSA_BITS[dtype], dtype) for w in words], -1)


def _wide(words):
  """The two 64-bit samples of a group's words: word 2i the low half of sample i, word 2i + 1 the high."""
  return [_join64(words[0], words[1]), _join64(words[2], words[3])]


def uniform_int(words, dtype, minval, maxval):
  """UniformDistribution of int32 or int64: minval + sample % (maxval - minval), the range and the sum taken
  unsigned (wrapping as SignedAdd does), then read back as signed."""
  unsigned = _U64 if dtype == tf.int64 else _U32
  samples = _wide(words) if dtype == tf.int64 else list(words)
  lo = tf.bitcast(minval, unsigned)
  span = tf.bitcast(maxval, unsigned) - lo
  return tf.stack([tf.bitcast(lo + tf.math.floormod(s, span), dtype) for s in samples], -1)


def full_int(words, dtype):
  """UniformFullIntDistribution: the words themselves (32-bit types), or pairs of them (64-bit)."""
  if dtype in (tf.int64, tf.uint64):
    samples = _wide(words)
  else:
    samples = list(words)
  return tf.stack([s if s.dtype == dtype else tf.bitcast(s, dtype) for s in samples], -1)
