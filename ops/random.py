"""Stateless random ops (the V2 forms: shape, key, counter, alg; and the older ones of a seed): each device
generates only its own shard, with the values the unpartitioned op gives those elements.

How TF's kernels (CPU and GPU, Philox) lay out the output: the flat output is cut into groups of G elements and
group g is computed from the Philox counter advanced by g * K (the key is the same for all). One Philox call gives
four uint32; a distribution turns them into G outputs:

  op                                  dtype                                  G   K
  uniform, normal, uniform int/full   half, bfloat16, float, int32, uint32   4   1
  uniform, normal, uniform int/full   double, int64, uint64                  2   1
  truncated normal                    half, bfloat16, float                  4   256  (G * 256 samples / 4 a call)
  truncated normal                    double                                 2   128

(the truncated normal draws a variable number of samples per output, so the kernel reserves 256 per output and
restarts each group at its reserved place). The last group of the output is cut short. The counter is 128 bits,
two uint64 words (low, high), and advancing it is a 128-bit addition: low' = low + n (mod 2**64), high' = high +
(low' < n), what PhiloxRandom::Skip does on its four uint32 words. The older ops (StatelessRandomUniform, ... of
an int seed) are the V2 ones at the key and counter StatelessRandomGetKeyCounter makes of the seed, with Philox.

A shard is a set of runs of the flat output: with k the last split dim, one run per index of the shard's dims
before k, each c_k * (the product of the dims after k) elements long. Each device generates its runs one of
three ways:

  * up to MAX_RUNS runs: one op per run, the same op at the counter advanced past the groups before the run (the
    run [o, o + L) is elements [o % G, o % G + L) of the op of L + G - 1 elements, L when o % G is 0, at the
    counter advanced by (o // G) * K), their concatenation reshaped to the local shape (the kernel is one fused
    op: a 16M-element dropout mask on 8 CPU devices takes 0.12 s so, 0.34 s in integer ops);
  * more runs of a uniform, uniform int or full int: every group the runs touch at once, Philox and the
    distribution written in TF integer ops (ops/philox.py), bit for bit the kernel's (both are bit manipulations
    of the words), then each run's elements taken from its groups -- any layout, nothing of the global size;
  * more runs of a normal or truncated normal: the runs one after another in a loop (tf.map_fn), each by the
    kernel op at its own counter, as above: Box-Muller goes through the C library's logf and sincosf (CUDA's on
    GPUs), whose last bit TF's math ops do not reproduce (measured on CPU: TF's float32 log, sin and cos miss the
    kernel's float32 normal by an ulp or two in about a fifth of samples, even correctly rounded ones in 1.5%), so
    only the kernel gives its values. The loop holds one run (plus a group) at a time, the result the shard:
    nothing of the global size, for any layout and any number of runs.

Padding of uneven splits is set to 0, what slicing the whole tensor gives. The algorithm must be Philox: `alg` a
constant 1 (Philox) or 3 (auto select, Philox on CPUs and GPUs); another or an unknown one is generated whole and
sliced. StatelessRandomGetKeyCounter (a key and counter from a seed, a few words) is computed whole on every
device.
"""

import numpy as np
import tensorflow as tf

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.ops import philox
from tf_gspmd.ops.registry import Rule, register

PHILOX_WORDS = 4           # uint32 words one Philox call gives
RESERVED_PER_OUTPUT = 256  # uint32 samples the kernel reserves per output of a variable-sample distribution
PHILOX_ALGS = (1, 3)       # RNG_ALG_PHILOX, RNG_ALG_AUTO_SELECT (Philox on CPUs and GPUs)
MAX_RUNS = 16              # most kernel ops a device emits for one random op, one per contiguous run of its shard
_WIDE = (tf.float64, tf.int64, tf.uint64)
# The older ops of a seed (shape, seed[, minval, maxval]) -> their V2 form (shape, key, counter, alg[, ...]).
OLDER = {"StatelessRandomUniform": "StatelessRandomUniformV2", "StatelessRandomNormal": "StatelessRandomNormalV2",
         "StatelessTruncatedNormal": "StatelessTruncatedNormalV2",
         "StatelessRandomUniformInt": "StatelessRandomUniformIntV2",
         "StatelessRandomUniformFullInt": "StatelessRandomUniformFullIntV2"}
# The distributions ops/philox.py computes bit for bit (V2 names).
BIT_EXACT = frozenset(("StatelessRandomUniformV2", "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2"))


def group_size(dtype):
  """Outputs one Philox call gives (the kernel's group): 2 for 64-bit types, else 4."""
  return 2 if dtype in _WIDE else PHILOX_WORDS


def counter_skip(op, dtype):
  """How far the Philox counter advances from one output group to the next."""
  if OLDER.get(op, op) == "StatelessTruncatedNormalV2":
    return group_size(dtype) * RESERVED_PER_OUTPUT // PHILOX_WORDS
  return 1


def shard_geometry(shape, target, mesh_size):
  """Where each device's shard lies in the flat output: (k, c, strides, offsets) with k the last split dim, c the
  shard shape, `strides` the flat output's and `offsets` an int64 [mesh_size, k + 1] table of each device's first
  index along dims 0..k (past the end for a shard in padding)."""
  rank = len(shape)
  k = max(d for d in range(rank) if target.tiles(d) > 1)
  c = [-(-shape[d] // target.tiles(d)) for d in range(rank)]
  strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(rank)]
  offsets = np.array([[target.tile_index(p, d) * c[d] for d in range(k + 1)] for p in range(mesh_size)], np.int64)
  return k, c, strides, offsets


def run_count(geometry):
  """Runs of the flat output a shard is made of: one per index of its dims before the last split one."""
  k, c, _, _ = geometry
  return int(np.prod(c[:k], dtype=np.int64))


def shard_runs(shape, target, mesh_size):
  """The contiguous runs of the flat output each device's shard is made of.

  Returns (k, runs, length): k the last split dim, `length` each run's element count, `runs` an int64
  [mesh_size, R] table of each run's first flat element, in the shard's order (-1 for a run in padding)."""
  k, c, strides, offsets = shard_geometry(shape, target, mesh_size)
  length = c[k] * strides[k]
  lead = list(np.ndindex(*c[:k])) if k else [()]
  runs = np.full((mesh_size, len(lead)), -1, np.int64)
  for p in range(mesh_size):
    start = offsets[p]
    if start[k] >= shape[k]:
      continue
    for r, index in enumerate(lead):
      g = [start[d] + index[d] for d in range(k)]
      if all(g[d] < shape[d] for d in range(k)):
        runs[p, r] = sum(g[d] * strides[d] for d in range(k)) + start[k] * strides[k]
  return k, runs, length


def first_elements(geometry):
  """int64 [mesh_size]: each device's first element of the flat output (its shard's corner)."""
  k, _, strides, offsets = geometry
  return offsets @ np.asarray(strides[:k + 1], np.int64)


def aligned(geometry, g):
  """Whether every run of every device's shard starts a group of `g` outputs (its first element a multiple)."""
  k, c, strides, _ = geometry
  return all(strides[d] % g == 0 for d in range(k) if c[d] > 1) and not np.any(first_elements(geometry) % g)


def advance(counter, n):
  """`counter` (uint64 [2]: the low and high words of a 128-bit counter) plus `n` (uint64 [R]): uint64 [R, 2]."""
  low = counter[0] + n
  high = counter[1] + tf.cast(low < n, tf.uint64)
  return tf.stack([low, tf.broadcast_to(high, tf.shape(low))], axis=1)


def _index_grid(counts, strides, base):
  """int64: `base` (a scalar) + sum_d i_d * strides[d] over the grid of i_d < counts[d], flattened in row-major
  order (the flat indices of a block of the output, from its first)."""
  flat = tf.reshape(base, [1])
  for count, stride in zip(counts, strides):
    flat = tf.reshape(flat[:, None] + tf.range(count, dtype=tf.int64)[None, :] * stride, [-1])
  return flat


def run_starts(ctx, geometry):
  """int64 [R]: the first flat element of each run of this device's shard, in the shard's order."""
  k, c, strides, _ = geometry
  return _index_grid(c[:k], strides[:k], ctx.lookup(first_elements(geometry), "random_first_element"))


@register("StatelessRandomUniformV2", "StatelessRandomNormalV2", "StatelessTruncatedNormalV2",
          "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2", *OLDER)
class StatelessRandom(Rule):
  """shape, key, counter, alg (and minval, maxval for the bounded ints), or shape, seed (and the bounds) for the
  older ops: each device generates its shard's runs of the flat output (see the module docstring): one op per run
  at the counter advanced past the groups before it; past MAX_RUNS runs, Philox in integer ops at the shard's own
  groups (uniform and ints) or the kernel op run by run in a loop (normals); an algorithm other than Philox is
  generated whole and sliced."""

  priority = 0

  data = ()   # the shape, key, counter (or seed) and bounds are read whole

  def partition(self, ctx, node):
    target = ctx.target(0)
    out = node.outputs[0]
    shape = out.shape
    if (target.is_maximal or not out.partitionable or not shape or all(target.tiles(d) == 1 for d in range(len(shape)))
        or 0 in shape):
      return self._whole(ctx, node)
    if node.op not in OLDER:
      alg = node.const_input(3)
      if alg is None or int(np.asarray(alg).reshape(-1)[0]) not in PHILOX_ALGS:
        ctx.warn(f"{node.op} {node.name}: the RNG algorithm is not a constant Philox one; generated whole on every "
                 "device and sliced")
        return self._whole(ctx, node)
    geometry = shard_geometry(shape, target, ctx.mesh.size)
    key, counter = self._key_counter(ctx, node)
    local = target.shard_shape(shape)
    if run_count(geometry) <= MAX_RUNS:
      _, runs, length = shard_runs(shape, target, ctx.mesh.size)
      y = self._kernel_runs(ctx, node, runs, length, local, key, counter)
    elif OLDER.get(node.op, node.op) in BIT_EXACT:
      y = self._bit_exact(ctx, node, geometry, local, key, counter)
    else:
      y = self._looped(ctx, node, geometry, local, key, counter)
    for d in range(len(shape)):
      if target.tiles(d) > 1 and target.tiles(d) * local[d] != shape[d]:
        y = ctx.mask(y, shape, target, d, 0)
    ctx.set_output(0, y, target)

  def _key_counter(self, ctx, node):
    """The Philox key (uint64 [1]) and counter (uint64 [2]): the V2 op's inputs, or those of an older op's seed."""
    if node.op not in OLDER:
      return ctx.operand(1, Sharding(ctx.mesh)), ctx.operand(2, Sharding(ctx.mesh))
    seed = ctx.operand(1, Sharding(ctx.mesh))
    with ctx.helper_scope():
      key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    return key, counter

  def _bounds(self, ctx, node):
    """(minval, maxval) of a bounded int op, read whole."""
    first = 2 if node.op in OLDER else 4
    return ctx.operand(first, Sharding(ctx.mesh)), ctx.operand(first + 1, Sharding(ctx.mesh))

  def _kernel(self, ctx, node, dims, key, counter):
    """The op at local shape `dims` and `counter`: a clone of a V2 op, the V2 op built for an older one."""
    if node.op not in OLDER:
      (y,) = ctx.clone(node, {0: dims, 2: counter})
      return y
    kwargs = dict(zip(("minval", "maxval"), self._bounds(ctx, node))) if "Int" in node.op and "Full" not in node.op \
        else {"dtype": node.outputs[0].dtype}
    with ctx.helper_scope(), ctx.after_control_inputs():
      y = getattr(tf.raw_ops, OLDER[node.op])(shape=dims, key=key, counter=counter, alg=1, **kwargs)
    ctx.record(y)
    return y

  def _kernel_runs(self, ctx, node, runs, length, local, key, counter):
    """The runs (an int64 [mesh, R] table of their first elements, -1 in padding) of `length` elements each, one
    kernel op per run at the counter advanced past the groups before it, concatenated and reshaped to `local`."""
    dtype = node.outputs[0].dtype
    g, skip = group_size(dtype), counter_skip(node.op, dtype)
    runs = np.maximum(runs, 0)   # runs in padding: any values, masked after
    steps = (runs // g * skip).astype(np.uint64)
    pre = (runs % g).astype(np.int32)
    size = length if not pre.any() else length + g - 1
    tshape = node.input_info(0).dtype
    with ctx.helper_scope():
      counters = advance(counter, ctx.lookup(steps, f"random_steps_{g}_{skip}"))
      starts = ctx.lookup(pre, f"random_group_offset_{g}") if pre.any() else None
      whole_run = runs.shape[1] == 1 and starts is None   # one run, group-aligned: generated at `local`
      dims = tf.constant(local if whole_run else [size], tshape)
    pieces = []
    for r in range(runs.shape[1]):
      with ctx.helper_scope():
        counter_r = counters[r]
      y = self._kernel(ctx, node, dims, key, counter_r)
      with ctx.helper_scope():
        pieces.append(y if starts is None else tf.slice(y, starts[r:r + 1], [length]))
    if whole_run:
      return pieces[0]
    with ctx.helper_scope():
      return tf.reshape(pieces[0] if len(pieces) == 1 else tf.concat(pieces, 0), local)

  def _bit_exact(self, ctx, node, geometry, local, key, counter):
    """Every group of outputs the shard's runs touch, computed at once from its Philox counter in integer ops
    (ops/philox.py), then each run's elements taken from its groups (from its offset in its first group when a run
    may start inside one) and reshaped to `local`."""
    k, c, strides, _ = geometry
    op, dtype = OLDER.get(node.op, node.op), node.outputs[0].dtype
    g, length = group_size(dtype), c[k] * strides[k]
    exact = aligned(geometry, g)
    groups = -(-(length + (0 if exact else g - 1)) // g)   # groups each run touches, at most
    bounds = self._bounds(ctx, node) if op == "StatelessRandomUniformIntV2" else None
    with ctx.helper_scope(), ctx.after_control_inputs():
      starts = run_starts(ctx, geometry)
      first = tf.math.floordiv(starts, g)
      ids = tf.cast(first[:, None] + tf.range(groups, dtype=tf.int64)[None, :], tf.uint64)
      words = philox.philox(key, philox.counters(counter, ids))
      if op == "StatelessRandomUniformV2":
        values = philox.uniform(words, dtype)
      elif bounds is None:
        values = philox.full_int(words, dtype)
      else:
        values = philox.uniform_int(words, dtype, *bounds)
      values = tf.reshape(values, [-1, groups * g])
      if not exact:
        values = tf.gather(values, tf.math.floormod(starts, g)[:, None] + tf.range(length, dtype=tf.int64)[None, :],
                           batch_dims=1)
      elif groups * g != length:
        values = values[:, :length]
      y = tf.reshape(values, local)
      if bounds is not None:   # the kernel's check, which it makes before generating anything
        check = tf.raw_ops.Assert(condition=tf.less(bounds[0], bounds[1]),
                                  data=[tf.constant("Need minval < maxval:"), bounds[0], bounds[1]])
        with tf.control_dependencies([check]):
          y = tf.identity(y)
    ctx.record(y)
    return y

  def _looped(self, ctx, node, geometry, local, key, counter):
    """The shard's runs generated one after another in a loop, each by the kernel at its own counter (the run [o,
    o + L) is elements [o % G, o % G + L) of the kernel's L + G - 1 outputs at the counter advanced by (o // G) * K):
    a normal's values need the kernel itself (see the module docstring); the loop holds one run at a time and the
    result the shard, nothing of the global size."""
    k, c, strides, _ = geometry
    dtype = node.outputs[0].dtype
    g, skip = group_size(dtype), counter_skip(node.op, dtype)
    length = c[k] * strides[k]
    op = OLDER.get(node.op, node.op)
    alg = 1 if node.op in OLDER else int(np.asarray(node.const_input(3)).reshape(-1)[0])
    tshape = node.input_info(0).dtype
    with ctx.helper_scope(), ctx.after_control_inputs():
      starts = run_starts(ctx, geometry)
      counters = advance(counter, tf.cast(tf.math.floordiv(starts, g) * skip, tf.uint64))
      dims = tf.constant([length + g - 1], tshape)

      def run(args):
        counter_r, offset_r = args
        y = getattr(tf.raw_ops, op)(shape=dims, key=key, counter=counter_r, alg=alg, dtype=dtype)
        return tf.slice(y, tf.reshape(offset_r, [1]), [length])

      values = tf.map_fn(run, (counters, tf.math.floormod(starts, g)),
                         fn_output_signature=tf.TensorSpec([length], dtype))
      y = tf.reshape(values, local)
    ctx.record(y)
    return y

  def _whole(self, ctx, node):
    (y,) = ctx.clone(node, {})
    ctx.set_output(0, y, Sharding(ctx.mesh))


@register("StatelessRandomGetKeyCounter", "StatelessRandomGetAlg")
class RandomKeyCounter(Rule):
  """A seed's key and counter (a few words): computed whole on every device."""

  priority = 0

  def partition(self, ctx, node):
    outs = ctx.clone(node, {})
    for o, y in enumerate(outs):
      ctx.set_output(o, y, Sharding(ctx.mesh))
