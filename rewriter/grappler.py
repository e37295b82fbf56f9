"""The Grappler pass: TF's own graph optimizer folds shape computations to constants and inlines calls.

Only folding optimizers run (function inlining, constant folding, shape, arithmetic); the function's
inputs, outputs and every annotated node are preserved, so names users query survive. Nodes that nothing
needs afterwards are pruned, so no dead computation reaches completion or the report.
"""

import threading

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2
from tensorflow.python.framework import convert_to_constants
from tensorflow.python.grappler import cluster as gcluster
from tensorflow.python.grappler import tf_optimizer

from tf_gspmd._annotations import SHARDING_ATTR, SPEC_ATTR
from tf_gspmd.rewriter.graph_view import prune, side_effect_nodes, split_ref

OPTIMIZERS = ("function", "constfold", "shape", "arithmetic")

_CLUSTER = []
_LOCK = threading.Lock()


def _cluster():
  """One Grappler cluster for the process: a new one per call starts a thread pool each time (thousands of
  lowerings would exhaust the process's threads)."""
  with _LOCK:
    if not _CLUSTER:
      _CLUSTER.append(gcluster.Cluster())
    return _CLUSTER[0]


def run(program):
  gd = program.graph_def
  keep = set(program.input_names) | set(program.variable_names) | {split_ref(r)[0] for r in program.output_refs}
  # Annotations, and Identity nodes: the names users give tensors (tf.identity(x, name="h")) must survive.
  keep |= {n.name for n in gd.node if SHARDING_ATTR in n.attr or SPEC_ATTR in n.attr or
           n.op in ("XlaSharding", "Identity")}
  meta = meta_graph_pb2.MetaGraphDef()
  # Keep While/If functional (completion and partitioning treat their bodies as functions); calls inline.
  meta.graph_def.CopyFrom(convert_to_constants.disable_lower_using_switch_merge(gd))
  meta.collection_def["train_op"].node_list.value.extend(sorted(keep))
  config = config_pb2.ConfigProto()
  rewrite = config.graph_options.rewrite_options
  rewrite.min_graph_nodes = -1
  rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
  rewrite.optimizers.extend(OPTIMIZERS)
  optimized = tf_optimizer.OptimizeGraph(config, meta, verbose=False, cluster=_cluster())
  missing = keep - {n.name for n in optimized.node}
  if missing:  # Grappler dropped a node we must keep: fall back to the unoptimized graph.
    optimized = tf.compat.v1.GraphDef()
    optimized.CopyFrom(gd)
  _restore_shape_hints(gd, optimized)
  # Drop what no output, annotation or side effect needs (Grappler leaves rewritten nodes behind).
  optimized = prune(optimized, sorted(keep) + side_effect_nodes(optimized))
  return program.replace(graph_def=optimized)


def _restore_shape_hints(traced_gd, optimized):
  """Grappler drops the traced static shapes (`_output_shapes`): put them back on the nodes it left unchanged.

  A node is unchanged when it has the same op, attributes and inputs as the traced node of its name. A
  rewrite may reuse a name for a node of another shape (e.g. an element-wise op hoisted above a transpose),
  so a node it changed keeps no hint: shape inference gives its shape.
  """
  traced = {n.name: n for n in traced_gd.node}

  def same(a, b):
    if a.op != b.op or list(a.input) != list(b.input) or set(a.attr) - {"_output_shapes"} != set(b.attr) - {
        "_output_shapes"}:
      return False
    return all(a.attr[k] == b.attr[k] for k in a.attr if k != "_output_shapes")

  for n in optimized.node:
    old = traced.get(n.name)
    if old is not None and "_output_shapes" in old.attr and "_output_shapes" not in n.attr and same(old, n):
      n.attr["_output_shapes"].CopyFrom(old.attr["_output_shapes"])
