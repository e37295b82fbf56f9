"""The private TensorFlow and Keras APIs tf_gspmd uses, each behind one small adapter.

Only this module imports `tensorflow.python` or `keras.src` (tests/test_layering.py asserts it). Each adapter
says why there is no public route and which versions it was checked against; tests/test_compat.py exercises
every one, so an upgrade that changes them fails there, loudly, rather than somewhere inside a pass.
"""

import threading

# ---- graphs and functions as data (checked against TF 2.21) ------------------------------------------------
# TF has no public way to turn a FunctionDef into a GraphDef or a graph into a FunctionDef (tf.function builds
# them only from Python code), nor to read an op type's OpDef.


def function_def_to_graph_def(fdef, input_shapes):
  """(GraphDef of `fdef` with parameters shaped `input_shapes`, {FunctionDef tensor name: graph tensor name})."""
  from tensorflow.python.framework import function_def_to_graph  # pylint: disable=g-import-not-at-top
  return function_def_to_graph.function_def_to_graph_def(fdef, input_shapes=input_shapes)


def graph_to_function_def(graph, operations, inputs, outputs, out_names=None):
  """A FunctionDef computing `outputs` from the placeholders `inputs` with `operations` of `graph`."""
  from tensorflow.python.framework import graph_to_function_def as g2f  # pylint: disable=g-import-not-at-top
  return g2f.graph_to_function_def(graph, operations, inputs, outputs, out_names=out_names)


def op_def(op_type):
  """The registered OpDef of `op_type`, or None for an op type this TF does not know."""
  from tensorflow.python.framework import op_def_registry  # pylint: disable=g-import-not-at-top
  return op_def_registry.get(op_type)


def set_resource_shape(handle, shape, dtype):
  """Tell shape inference that the variable behind the resource tensor `handle` holds `dtype[shape]`.

  (What a captured variable's placeholder carries in a tf.function; no public setter.)
  """
  from tensorflow.core.framework import cpp_shape_inference_pb2  # pylint: disable=g-import-not-at-top
  from tensorflow.python.ops import handle_data_util  # pylint: disable=g-import-not-at-top
  data = cpp_shape_inference_pb2.CppShapeInferenceResult.HandleData(
      is_set=True, shape_and_type=[cpp_shape_inference_pb2.CppShapeInferenceResult.HandleShapeAndType(
          shape=shape.as_proto(), dtype=dtype.as_datatype_enum)])
  handle_data_util.set_handle_data(handle, data)


# ---- Grappler from Python (checked against TF 2.21) ------------------------------------------------------------
# tf.function runs Grappler only when it executes a graph; running it on a GraphDef we hold, and getting the
# optimized GraphDef back, is only possible through these modules.


_CLUSTER = []
_LOCK = threading.Lock()


def grappler_cluster():
  """The process's one Grappler cluster (TF provisions one at a time; a new one per call would also start a
  thread pool each time)."""
  from tensorflow.python.grappler import cluster  # pylint: disable=g-import-not-at-top
  with _LOCK:
    if not _CLUSTER:
      _CLUSTER.append(cluster.Cluster())
    return _CLUSTER[0]


def optimize_graph(config, metagraph, cluster):
  """Grappler's meta-optimizer on `metagraph` (a MetaGraphDef) with `config` (a ConfigProto): a GraphDef."""
  from tensorflow.python.grappler import tf_optimizer  # pylint: disable=g-import-not-at-top
  return tf_optimizer.OptimizeGraph(config, metagraph, verbose=False, cluster=cluster)
