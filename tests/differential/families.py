"""The differential suite's op families: one `_fam_*` per name in FAMILIES, each writing one program.

A family starts the program (its first argument or arguments) and applies its ops through the builders of
`differential.builder`; `_FAMILY_FNS` maps each family name to its function.
"""

import math

import numpy as np

from differential.builder import (_axes, _chain, _fits, _op_binary, _op_concat, _op_cumsum, _op_expand_squeeze,
                                  _op_matmul, _op_pad, _op_reduce, _op_reshape, _op_select, _op_slice, _op_softmax,
                                  _op_tile, _op_transpose, _op_unary, _shape, _start)
from differential.cases import DIMS, FAMILIES, _d, _mm_err, _sum_err, st


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
