"""Every registered op type on tensors of unknown rank and of unknown dimensions: completion and partitioning
answer with a layout, a replicated run with a warning, or a typed error naming the node -- never an internal
exception (TypeError, IndexError, ...).

The cases are generated from each op's OpDef: a real TF graph in which the op reads values of unknown rank
(`tf.io.parse_tensor` of a serialized argument: TF knows nothing of its shape), or values of known rank and
unknown dimensions (`tf.ensure_shape(..., [None, None])` of one), with one operand of known shape split over the
mesh where TF accepts it. Ops the generic builder cannot make (functions, variables, lists) have hand-written
cases. A newly registered op type without a case fails `test_every_registered_op_type_has_a_case`.
"""

import itertools
import traceback
import warnings

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_def_library
from tensorflow.python.framework import op_def_registry

import tf_gspmd as gs
from tf_gspmd import P, ops
from tf_gspmd.errors import ShardingError

MESH = gs.Mesh((2, 4), ("data", "model"))
SHAPE = (8, 8)
_names = itertools.count()

# Attributes an OpDef requires without a default (type attributes the inputs fix are inferred).
ATTRS = {
    "AvgPool": dict(ksize=[1, 2, 2, 1], strides=[1, 1, 1, 1], padding="VALID"),
    "AvgPoolGrad": dict(ksize=[1, 2, 2, 1], strides=[1, 1, 1, 1], padding="VALID"),
    "MaxPool": dict(ksize=[1, 2, 2, 1], strides=[1, 1, 1, 1], padding="VALID"),
    "MaxPoolGrad": dict(ksize=[1, 2, 2, 1], strides=[1, 1, 1, 1], padding="VALID"),
    "MaxPoolGradGrad": dict(ksize=[1, 2, 2, 1], strides=[1, 1, 1, 1], padding="VALID"),
    "AvgPool3D": dict(ksize=[1, 2, 2, 2, 1], strides=[1, 1, 1, 1, 1], padding="VALID"),
    "AvgPool3DGrad": dict(ksize=[1, 2, 2, 2, 1], strides=[1, 1, 1, 1, 1], padding="VALID"),
    "MaxPool3D": dict(ksize=[1, 2, 2, 2, 1], strides=[1, 1, 1, 1, 1], padding="VALID"),
    "MaxPool3DGrad": dict(ksize=[1, 2, 2, 2, 1], strides=[1, 1, 1, 1, 1], padding="VALID"),
    "Conv2D": dict(strides=[1, 1, 1, 1], padding="VALID"),
    "Conv2DBackpropFilter": dict(strides=[1, 1, 1, 1], padding="VALID"),
    "Conv2DBackpropInput": dict(strides=[1, 1, 1, 1], padding="VALID"),
    "Conv3D": dict(strides=[1, 1, 1, 1, 1], padding="VALID"),
    "Conv3DBackpropFilterV2": dict(strides=[1, 1, 1, 1, 1], padding="VALID"),
    "Conv3DBackpropInputV2": dict(strides=[1, 1, 1, 1, 1], padding="VALID"),
    "BatchMatMulV3": dict(Tout=tf.float32),
    "Bitcast": dict(type=tf.int32),
    "Cast": dict(DstT=tf.int32),
    "CheckNumerics": dict(message="checked"),
    "Einsum": dict(equation="ij,jk->ik"),
    "Empty": dict(dtype=tf.float32),
    "EnsureShape": dict(shape=tf.TensorShape([None, None])),
    "MirrorPad": dict(mode="REFLECT"),
    "ReadVariableOp": dict(dtype=tf.float32),
    "ResourceGather": dict(dtype=tf.float32),
    "Split": dict(num_split=2),
    "SplitV": dict(num_split=2),
    "Unpack": dict(num=2),
    "EmptyTensorList": dict(element_dtype=tf.float32),
    "TensorListReserve": dict(element_dtype=tf.float32),
    "TensorListGather": dict(element_dtype=tf.float32),
    "TensorListGetItem": dict(element_dtype=tf.float32),
    "TensorListPopBack": dict(element_dtype=tf.float32),
    "TensorListStack": dict(element_dtype=tf.float32),
}

_PREFERRED = (tf.float32, tf.int32, tf.int64, tf.bool, tf.float64)


def _unknown_rank(x, dtype):
  """`x` as `dtype`, of unknown rank: TF's shape inference knows nothing of what ParseTensor returns."""
  return tf.io.parse_tensor(tf.io.serialize_tensor(tf.cast(x, dtype)), dtype)


def _unknown_dims(x, dtype, rank=2):
  """`x` as `dtype`, of rank `rank` and unknown dimensions."""
  return tf.ensure_shape(_unknown_rank(x, dtype), [None] * rank)


def _list_of_unknown_elements(x):
  return tf.raw_ops.TensorListFromTensor(tensor=_unknown_rank(x, tf.float32), element_shape=tf.constant(-1))


def _variable(shape):
  return tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=shape, shared_name=f"unknown_shapes_{next(_names)}")


def _dtype_of(op_def, arg):
  """A dtype the op takes for input `arg` (float32 where allowed)."""
  if arg.type:
    return tf.as_dtype(arg.type)
  attr = next(a for a in op_def.attr if a.name == (arg.type_attr or arg.type_list_attr))
  allowed = [tf.as_dtype(t) for t in attr.allowed_values.list.type]
  if not allowed:
    return tf.float32
  return next((d for d in _PREFERRED if d in allowed), allowed[0])


def _python_value(attr_value):
  """An attribute's default value as the op builder takes it."""
  kind = attr_value.WhichOneof("value")
  if kind == "list":
    lst = attr_value.list
    field = next((f for f in ("s", "i", "f", "b", "type", "shape") if getattr(lst, f)), "i")
    return list(getattr(lst, field))
  if kind == "shape":
    return tf.TensorShape(attr_value.shape)
  if kind == "type":
    return tf.as_dtype(attr_value.type)
  return getattr(attr_value, kind)


def _generic(op_type, value, variable_shape=None):
  """A function of the split argument that builds one `op_type` op, input k of dtype d being `value(k, d, x)`."""
  op_def = op_def_registry.get(op_type)

  def fn(x):
    kwargs, k = {}, 0
    for arg in op_def.input_arg:
      dtype = _dtype_of(op_def, arg)
      if dtype == tf.resource:
        kwargs[arg.name] = _variable(tf.TensorShape(variable_shape))
      elif dtype == tf.variant:
        kwargs[arg.name] = _list_of_unknown_elements(x)
      elif arg.number_attr or arg.type_list_attr:
        kwargs[arg.name] = [value(k, dtype, x), value(k + 1, dtype, x)]
        k += 2
        continue
      else:
        kwargs[arg.name] = value(k, dtype, x)
      k += 1
    inferred = {n for a in op_def.input_arg for n in (a.type_attr, a.type_list_attr, a.number_attr)}
    for attr in op_def.attr:
      if attr.HasField("default_value") and attr.name not in inferred:
        kwargs[attr.name] = _python_value(attr.default_value)
    kwargs.update(ATTRS.get(op_type, {}))
    _, _, op, _ = op_def_library._apply_op_helper(op_type, **kwargs)   # (OpDef argument names, as in C++)
    return _results(op.outputs if op.outputs else op)

  return fn


def _results(out):
  """The op's tensors worth returning (a write returns its Operation, read by the function's side effects)."""
  if isinstance(out, tf.Operation):
    return tf.constant(0.0)
  outs = [t for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor) and t.dtype not in (tf.variant, tf.resource)]
  return outs or tf.constant(0.0)


def _known(x, rank):
  """`x` (split over the mesh) reshaped to rank 1, 2, 4 or 5: a known operand the op accepts."""
  return tf.reshape(x, {1: [64], 2: [8, 8], 4: [2, 4, 2, 4], 5: [2, 2, 2, 2, 4]}[rank])


def _variants():
  """value(k, dtype, x) for input k of each variant: all of unknown rank; one known operand (of rank r), the others
  of unknown rank; all of rank r with unknown dims; the first of rank r with unknown dims, the others of unknown
  rank. Ranks the op does not take are refused by TF's shape inference and skipped."""
  out = {"unknown rank": lambda k, dtype, x: _unknown_rank(x, dtype)}
  for r in (1, 2, 4, 5):
    out[f"first operand known, rank {r}"] = \
        lambda k, dtype, x, r=r: tf.cast(_known(x, r), dtype) if k == 0 else _unknown_rank(x, dtype)
  for r in (2, 4):
    out[f"unknown dims, rank {r}"] = lambda k, dtype, x, r=r: _unknown_dims(x, dtype, r)
    out[f"first operand of unknown dims, rank {r}"] = \
        lambda k, dtype, x, r=r: _unknown_dims(x, dtype, r) if k == 0 else _unknown_rank(x, dtype)
  return out


VARIANTS = _variants()


# ---- hand-written cases (functions, stateful ops, ops without operands) ----------------------------------------

@tf.function(experimental_attributes={"_noinline": True})
def _kept_call(t):
  return t * 2.0


@tf.function(experimental_attributes={"_noinline": True})
def _kept_stateful_call(t):
  return t * tf.random.uniform([])


def _loop(stateful, value):
  def fn(x):
    def body(i, v):
      v = v * 2.0
      return i + 1, (v + tf.random.uniform([]) if stateful else v)
    return tf.while_loop(lambda i, v: i < 3, body, [0, value(x)])[1]
  return fn


def _branch(stateful, value):
  def fn(x):
    pred = tf.reduce_sum(x) > 0.0
    noise = (lambda: tf.random.uniform([])) if stateful else (lambda: 1.0)
    return tf.cond(pred, lambda: value(x) * noise(), lambda: value(x) + 1.0)
  return fn


def _call(stateful, value):
  return lambda x: (_kept_stateful_call if stateful else _kept_call)(value(x))


def _unknown_x(x):
  return _unknown_rank(x, tf.float32)


def _unknown_dims_x(x):
  return _unknown_dims(x, tf.float32)


def _variable_cases(op_type):
  """Variables of unknown shape, and of known shape written or read with values of unknown rank."""
  unknown = VARIANTS["unknown rank"]
  if op_type == "VarHandleOp":
    read = lambda shape: lambda x: tf.raw_ops.ReadVariableOp(resource=_variable(shape), dtype=tf.float32) + 1.0
    return {"unknown rank": read(tf.TensorShape(None)), "unknown dims": read(tf.TensorShape([None, None]))}
  return {"unknown rank": _generic(op_type, unknown),
          "known variable, operands of unknown rank": _generic(op_type, unknown, SHAPE),
          "unknown dims": _generic(op_type, VARIANTS["unknown dims, rank 2"], [None, None])}


def _lists(value):
  """Every TensorList op on a list of elements of unknown rank (or dims), pushed, read, set, gathered, stacked."""
  def fn(x):
    elem = value(x)
    shape = tf.constant(-1)
    handle = tf.raw_ops.EmptyTensorList(element_shape=shape, max_num_elements=-1, element_dtype=tf.float32)
    handle = tf.raw_ops.TensorListPushBack(input_handle=handle, tensor=elem)
    handle = tf.raw_ops.TensorListPushBack(input_handle=handle, tensor=elem * 2.0)
    handle, popped = tf.raw_ops.TensorListPopBack(input_handle=handle, element_shape=shape, element_dtype=tf.float32)
    reserved = tf.raw_ops.TensorListReserve(element_shape=shape, num_elements=2, element_dtype=tf.float32)
    reserved = tf.raw_ops.TensorListSetItem(input_handle=reserved, index=0, item=elem)
    item = tf.raw_ops.TensorListGetItem(input_handle=reserved, index=0, element_shape=shape, element_dtype=tf.float32)
    stacked = tf.raw_ops.TensorListStack(input_handle=handle, element_shape=shape, element_dtype=tf.float32)
    from_t = tf.raw_ops.TensorListFromTensor(tensor=stacked, element_shape=shape)
    gathered = tf.raw_ops.TensorListGather(input_handle=from_t, indices=[0], element_shape=shape,
                                           element_dtype=tf.float32)
    scattered = tf.raw_ops.TensorListScatterV2(tensor=gathered, indices=[0], element_shape=shape, num_elements=1)
    scattered = tf.raw_ops.TensorListScatterIntoExistingList(input_handle=scattered, tensor=gathered, indices=[0])
    length = tf.raw_ops.TensorListLength(input_handle=scattered)
    element_shape = tf.raw_ops.TensorListElementShape(input_handle=from_t, shape_type=tf.int32)
    return popped, item, stacked, gathered, length, element_shape
  return fn


def _constant(x):
  return tf.reshape(_unknown_rank(x, tf.float32), tf.constant([-1])) * tf.constant(2.0)


def _no_op(x):
  with tf.control_dependencies([tf.raw_ops.NoOp()]):
    return _unknown_rank(x, tf.float32) + 1.0


def _random_on(value):
  def fn(x):
    seed = tf.cast(tf.reshape(value(x), [-1])[:2], tf.int64)
    key, counter, alg = tf.raw_ops.StatelessRandomGetKeyCounterAlg(seed=seed)
    shape = tf.cast(tf.shape(value(x)), tf.int32)
    return (tf.raw_ops.StatelessRandomUniformV2(shape=shape, key=key, counter=counter, alg=alg),
            tf.raw_ops.StatelessRandomGetAlg() + 0,
            tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)[0])
  return fn


def _printed(value):
  def fn(x):
    v = value(x)
    tf.print(tf.strings.format("v={}", v), output_stream="file:///dev/null")   # StringFormat, then PrintV2
    return v * 2.0
  return fn


def _special_cases():
  cases = {}
  for op_type, stateful in (("While", True), ("StatelessWhile", False)):
    cases[op_type] = {"unknown rank": _loop(stateful, _unknown_x), "unknown dims": _loop(stateful, _unknown_dims_x)}
  for op_type, stateful in (("If", True), ("StatelessIf", False)):
    cases[op_type] = {"unknown rank": _branch(stateful, _unknown_x),
                      "unknown dims": _branch(stateful, _unknown_dims_x)}
  for op_type, stateful in (("PartitionedCall", False), ("StatefulPartitionedCall", True)):
    cases[op_type] = {"unknown rank": _call(stateful, _unknown_x), "unknown dims": _call(stateful, _unknown_dims_x)}
  for op_type in ops.registered_ops():
    if op_type.startswith("TensorList") or op_type == "EmptyTensorList":
      cases[op_type] = {"unknown rank": _lists(_unknown_x), "unknown dims": _lists(_unknown_dims_x)}
    if op_type == "VarHandleOp" or "Variable" in op_type or op_type.startswith(("ResourceApply", "ResourceScatter")) \
        or op_type == "ResourceGather":
      cases[op_type] = _variable_cases(op_type)
  for op_type in ("Placeholder", "Const", "Identity"):
    cases[op_type] = {"unknown rank": _constant}
  cases["NoOp"] = {"unknown rank": _no_op}
  for op_type in ("StringFormat", "PrintV2"):
    cases[op_type] = {"unknown rank": _printed(_unknown_x), "unknown dims": _printed(_unknown_dims_x)}
  for op_type in ("StatelessRandomGetAlg", "StatelessRandomGetKeyCounter", "StatelessRandomUniformV2"):
    cases[op_type] = {"unknown rank": _random_on(_unknown_x), "unknown dims": _random_on(_unknown_dims_x)}
  return cases


SPECIAL = _special_cases()


def _cases(op_type):
  if op_type in SPECIAL:
    return SPECIAL[op_type]
  if op_def_registry.get(op_type) is None:
    return {}
  return {name: _generic(op_type, value) for name, value in VARIANTS.items()}


def _ops_in(graph_def):
  found = {n.op for n in graph_def.node}
  for f in graph_def.library.function:
    found |= {n.op for n in f.node_def}
  return found


def _static(outs):
  """The function's results, each of static shape (a result of unknown shape is summed to a scalar: results need
  static shapes, which the partitioner checks before partitioning the nodes this test is about)."""
  def known(t):
    if t.shape.is_fully_defined() or t.dtype in (tf.variant, tf.resource, tf.string):
      return t
    return tf.ensure_shape(tf.reduce_sum(tf.cast(t, tf.float32)), [])
  return [known(t) for t in tf.nest.flatten(outs)]


def _outcome(op_type, case):
  """'traced out' when TF itself refuses the graph; else the lowering's outcome, failing on an internal error."""
  fn = lambda x: _static(case(x))
  try:
    traced = tf.function(fn).get_concrete_function(tf.TensorSpec(SHAPE)).graph.as_graph_def()
  except (ValueError, TypeError, tf.errors.OpError):
    return "traced out"
  assert op_type in _ops_in(traced), f"the case for {op_type} builds no {op_type} op"
  f = gs.function(fn, mesh=MESH, in_shardings=P("data", "model"))
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")   # (ops run replicated are warned about; the fallback's tests check that)
      f.lower(tf.TensorSpec(SHAPE))
  except ShardingError as e:
    cause = e.__cause__
    if cause is not None and not isinstance(cause, ShardingError):
      pytest.fail(f"{op_type}: internal {type(cause).__name__} behind {type(e).__name__}: {e}\n" +
                  "".join(traceback.format_exception(cause)))
    assert e.node, f"{op_type}: {type(e).__name__} names no node: {e}"
    return "typed error"
  except Exception as e:  # pylint: disable=broad-except
    pytest.fail(f"{op_type}: internal {type(e).__name__}: {e}\n" + "".join(traceback.format_exception(e)))
  return "lowered"


def test_every_registered_op_type_has_a_case():
  missing = [t for t in ops.registered_ops() if not _cases(t)]
  assert not missing, f"op types without an unknown-shape case (add one to {__name__}): {missing}"


@pytest.mark.parametrize("op_type", ops.registered_ops())
def test_unknown_rank_and_dims_never_raise_internal_errors(op_type):
  outcomes = {name: _outcome(op_type, fn) for name, fn in _cases(op_type).items()}
  assert outcomes.get("unknown rank", "traced out") != "traced out" or \
      any(o != "traced out" for o in outcomes.values()), f"{op_type}: TF refused every case: {outcomes}"


def test_op_reading_a_value_of_unknown_rank_runs_whole_with_a_warning(rng, monkeypatch):
  """x split, u = x of unknown rank: x + u runs whole on every device (x gathered), says so in the report and
  gives the unpartitioned result."""
  from tf_gspmd.rewriter.partition import partition  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(partition, "_warned_unknown_rank", set())   # (warned once per op type and process)
  def fn(x):
    return tf.ensure_shape(x + _unknown_rank(x, tf.float32), SHAPE)

  f = gs.function(fn, mesh=MESH, in_shardings=P("data", "model"))
  with pytest.warns(UserWarning, match="unknown rank"):
    low = f.lower(tf.TensorSpec(SHAPE))
  assert any("(AddV2): input 1" in w and "unknown rank" in w for w in low.report.warnings)
  x = rng.standard_normal(SHAPE).astype("float32")
  np.testing.assert_array_equal(f(x).numpy(), fn(tf.constant(x)).numpy())


def test_result_of_unknown_rank_is_a_typed_error():
  f = gs.function(lambda x: _unknown_rank(x, tf.float32) * 2.0, mesh=MESH, in_shardings=P("data", "model"))
  with pytest.raises(gs.ShapeError, match=r"result 0 .* has unknown rank"):
    f.lower(tf.TensorSpec(SHAPE))
