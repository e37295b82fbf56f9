"""Every adapter of tf_gspmd/_compat.py against the installed TF and Keras: a change there fails here, loudly."""

import numpy as np
import tensorflow as tf

from tf_gspmd import _compat


def _square_fdef():
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
    y = tf.square(x, name="y")
  return _compat.graph_to_function_def(graph, graph.get_operations(), [x], [y], out_names=["out"]), graph


def test_graph_to_function_def_and_back():
  fdef, _ = _square_fdef()
  assert [a.name for a in fdef.signature.input_arg] == ["x"]
  assert [a.name for a in fdef.signature.output_arg] == ["out"]
  gd, names = _compat.function_def_to_graph_def(fdef, [tf.TensorShape([3])])
  assert {n.op for n in gd.node} >= {"Placeholder", "Square"}
  ret = names[fdef.ret["out"]]
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(gd, name="")
    assert graph.get_tensor_by_name(ret).shape.as_list() == [3]   # the parameter shape reached the body


def test_op_def():
  op = _compat.op_def("ResourceApplyAdam")
  assert op.is_stateful and "grad" in [a.name for a in op.input_arg]
  assert not _compat.op_def("Square").is_stateful
  assert _compat.op_def("NoSuchOpType") is None


def test_set_resource_shape_reaches_shape_inference():
  graph = tf.Graph()
  with graph.as_default():
    handle = tf.compat.v1.placeholder(tf.resource, [])
    _compat.set_resource_shape(handle, tf.TensorShape([4, 2]), tf.float32)
    read = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32)
  assert read.shape.as_list() == [4, 2]


def test_grappler_folds_a_shape_computation():
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
    y = tf.reshape(x, tf.stack([tf.shape(x)[1], tf.shape(x)[0]]), name="y")
  meta = tf.compat.v1.MetaGraphDef()
  meta.graph_def.CopyFrom(graph.as_graph_def())
  meta.collection_def["train_op"].node_list.value.append("y")
  config = tf.compat.v1.ConfigProto()
  config.graph_options.rewrite_options.optimizers.extend(["constfold", "shape"])
  config.graph_options.rewrite_options.min_graph_nodes = -1
  optimized = _compat.optimize_graph(config, meta, _compat.grappler_cluster())
  ops = {n.op for n in optimized.node}
  assert "Shape" not in ops and "Reshape" in ops
  shape_node = next(n for n in optimized.node if n.name == next(n for n in optimized.node if n.name == "y").input[1])
  assert shape_node.op == "Const"
  np.testing.assert_array_equal(tf.make_ndarray(shape_node.attr["value"].tensor), [3, 2])
