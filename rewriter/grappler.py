"""The Grappler pass: TF's own graph optimizer folds shape computations to constants and inlines calls.

Only folding optimizers run (function inlining, constant folding, shape, arithmetic); the function's
inputs, outputs and every annotated node are preserved, so names users query survive. Nodes that nothing
needs afterwards are pruned, so no dead computation reaches completion or the report.
"""

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2
from tensorflow.python.grappler import tf_optimizer

from tf_gspmd._annotations import SHARDING_ATTR
from tf_gspmd.rewriter.graph_ir import prune, side_effect_nodes, split_ref

OPTIMIZERS = ("function", "constfold", "shape", "arithmetic")


def run(program):
  gd = program.graph_def
  keep = set(program.input_names) | {split_ref(r)[0] for r in program.output_refs}
  keep |= {n.name for n in gd.node if SHARDING_ATTR in n.attr or n.op == "XlaSharding"}
  meta = meta_graph_pb2.MetaGraphDef()
  meta.graph_def.CopyFrom(gd)
  meta.collection_def["train_op"].node_list.value.extend(sorted(keep))
  config = config_pb2.ConfigProto()
  rewrite = config.graph_options.rewrite_options
  rewrite.min_graph_nodes = -1
  rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
  rewrite.optimizers.extend(OPTIMIZERS)
  optimized = tf_optimizer.OptimizeGraph(config, meta, verbose=False)
  missing = keep - {n.name for n in optimized.node}
  if missing:  # Grappler dropped a node we must keep: fall back to the unoptimized graph.
    optimized = tf.compat.v1.GraphDef()
    optimized.CopyFrom(gd)
  # Drop what no output, annotation or side effect needs (Grappler leaves rewritten nodes behind).
  optimized = prune(optimized, sorted(keep) + side_effect_nodes(optimized))
  return program.replace(graph_def=optimized)
