"""The differential suite's program builder and op builders.

`_Builder` accumulates the source lines of one generated `fn`, its arguments and each tensor's shape, dtype
kind, magnitude and error bound; every `_op_*` appends one op to the current tensor, drawing its parameters and
the shapes together so that every program is valid TF. `_chain` applies a few random ops in a row.
"""

import math

from differential.cases import (DIMS, MAX_BOUND, MAX_ELEMS, MAX_INITIAL_ELEMS, MAX_INPUTS, MAX_RANK, Arg, Out,
                                _d, _mm_err, _sum_err, st)


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


def _op_dropout(b):
  """tf.nn.experimental.stateless_dropout: random bits of the current tensor's shape (each device must draw its
  shard's own, bit for bit), the kept values scaled by 1 / (1 - rate)."""
  if b.kind != "f":
    return _op_unary(b)
  rate = _d(b.draw, (0.25, 0.5))
  seed = b.draw(st.integers(0, 999))
  b.emit(f"tf.nn.experimental.stateless_dropout({b.cur}, rate={rate}, seed=[{seed}, 7])", b.shape,
         b.mag / (1 - rate), (b.err + 2 * b.mag) / (1 - rate), tag=("dropout",))


_CHAIN_OPS = {
    "unary": (_op_unary, 0), "binary": (_op_binary, 0), "select": (_op_select, 1), "matmul": (_op_matmul, 2),
    "reduce": (_op_reduce, 1), "transpose": (_op_transpose, 2), "reshape": (_op_reshape, 1),
    "expand_squeeze": (_op_expand_squeeze, 0), "concat": (_op_concat, 1), "slice": (_op_slice, 1),
    "softmax": (_op_softmax, 1), "cumsum": (_op_cumsum, 1), "pad": (_op_pad, 1), "tile": (_op_tile, 1),
    "dropout": (_op_dropout, 1),
}


def _chain(b, steps):
  for _ in range(steps):
    names = [k for k, (_, min_rank) in _CHAIN_OPS.items() if b.rank >= min_rank]
    _CHAIN_OPS[_d(b.draw, names)][0](b)


def _start(b, rank=None, lo=1, hi=MAX_RANK):
  return b.arg(_shape(b.draw, rank if rank is not None else b.draw(st.integers(lo, hi))))

