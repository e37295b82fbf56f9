"""The dtypes collectives carry. Each tensor travels at its own width where TF's op takes its dtype. TF's
collective OpDefs take only a few dtypes (their CPU kernels take every one of them; measured on TF 2.21, see
`takes`), so data that only moves (all-gather, all-to-all, collective-permute) travels bit for bit in a dtype
the op takes: bitcast when the widths match (uint32 as int32), packed several to an element otherwise (int8,
uint8 and bool four to an int32, int16, uint16 and bfloat16 two). Data that is summed cannot be packed: an
all-reduce carries the small integer types as int32 and sums bfloat16 as float32; the report names each
carried form.
"""

import functools
import math

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.errors import PartitionError

# The dtypes collectives move; TF's own where an op takes them, else carried as below.
MOVABLE = frozenset({tf.float32, tf.float16, tf.float64, tf.int32, tf.int64, tf.bool, tf.int8, tf.uint8, tf.int16,
                     tf.uint16, tf.bfloat16, tf.uint32})
# Wider dtypes that hold every value exactly, for arithmetic on a dtype CollectiveReduceV2 cannot sum.
WIDER = {tf.bool: tf.int32, tf.int8: tf.int32, tf.uint8: tf.int32, tf.int16: tf.int32, tf.uint16: tf.int32,
         tf.bfloat16: tf.float32, tf.uint32: tf.int64}
EXACT_MERGES = ("Max", "Min")   # merges whose result needs no wider dtype


@functools.lru_cache(maxsize=None)
def takes(op_type):
  """The dtypes TF's collective op `op_type` takes (its OpDef's; the CPU kernels run all of them).

  Measured on TF 2.21 over 8 logical CPUs: CollectiveReduceV2 and CollectiveAllToAllV2 take float16/32/64,
  bfloat16, int32 and int64; CollectiveGatherV2 the same but bfloat16; CollectiveBcastSendV2/RecvV2 the same
  but bfloat16, and bool. No collective takes an 8- or 16-bit integer or an unsigned type.
  """
  (attr,) = [a for a in _compat.op_def(op_type).attr if a.name == "T"]
  return frozenset(tf.as_dtype(t) for t in attr.allowed_values.list.type)


def check(dtype, source):
  if dtype not in MOVABLE:
    raise PartitionError(f"TF collectives cannot carry {dtype.name} tensors; keep this tensor replicated",
                         node=source)


def moving(dtype, op_type, source):
  """(carrier dtype, elements per carrier element) that move `dtype` through `op_type` bit for bit."""
  check(dtype, source)
  if dtype in takes(op_type):
    return dtype, 1
  width = 1 if dtype == tf.bool else dtype.size   # bool moves as uint8
  carrier = tf.int32 if width <= 4 else tf.int64
  return carrier, carrier.size // width


def moving_note(dtype, carrier, per, op_type):
  if carrier == dtype:
    return ""
  how = f"bitcast to {carrier.name}" if per == 1 else f"packed {per} to an {carrier.name}"
  return f"{dtype.name} {how} ({op_type} takes no {dtype.name})"


def to_carrier(x, carrier, per, keep):
  """`x` as `carrier`: bitcast (same width), or flattened after its first `keep` dims and packed `per` to an
  element (the last one padded with zeros)."""
  if per == 1:
    return x if x.dtype == carrier else tf.bitcast(x, carrier)
  shape = x.shape.as_list()
  m = math.prod(shape[keep:])
  x = tf.reshape(tf.cast(x, tf.uint8) if x.dtype == tf.bool else x, shape[:keep] + [m])
  pad = -m % per
  if pad:
    x = tf.pad(x, [[0, 0]] * keep + [[0, pad]])
  return tf.bitcast(tf.reshape(x, shape[:keep] + [(m + pad) // per, per]), carrier)


def from_carrier(y, dtype, per, tail):
  """The inverse of `to_carrier`: `y` back to `dtype`, its dims after the leading ones laid out as `tail`."""
  if per == 1:
    return y if y.dtype == dtype else tf.bitcast(y, dtype)
  lead = y.shape.as_list()[:-1]
  y = tf.bitcast(y, tf.uint8 if dtype == tf.bool else dtype)   # [..., n, per]
  y = tf.slice(tf.reshape(y, lead + [-1]), [0] * (len(lead) + 1), lead + [math.prod(tail)])
  y = tf.reshape(y, lead + list(tail))
  return tf.cast(y, tf.bool) if dtype == tf.bool else y


def scalar(value, dtype):
  """`value` as a scalar constant of `dtype` (0 as False for bool)."""
  return tf.constant(np.asarray(value).astype(dtype.as_numpy_dtype), dtype)


def summing(dtype, merge, source):
  """(carrier dtype, how the value becomes it: "" own dtype, "bitcast" or "cast") for an all-reduce with `merge`."""
  check(dtype, source)
  if dtype in takes("CollectiveReduceV2") and (dtype != tf.bfloat16 or merge in EXACT_MERGES):
    return dtype, ""
  if dtype == tf.uint32 and merge in ("Add", "Mul"):   # sums and products modulo 2^32 agree bit for bit
    return tf.int32, "bitcast"
  return WIDER[dtype], "cast"


def summing_note(dtype, carrier, how):
  if not how:
    return ""
  if how == "bitcast":
    return f"{dtype.name} bitcast to {carrier.name} (sums wrap alike; CollectiveReduceV2 takes no {dtype.name})"
  if dtype == tf.bfloat16:
    return "bfloat16 summed as float32 (a bfloat16 sum would round at every step)"
  return f"{dtype.name} carried as {carrier.name} (CollectiveReduceV2 takes no {dtype.name})"
