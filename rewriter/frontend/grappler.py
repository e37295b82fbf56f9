"""The Grappler pass: TF's own graph optimizer folds shape computations to constants and inlines calls.

Only folding optimizers run (function inlining, constant folding, shape, arithmetic); the function's
inputs, outputs and every annotated node are preserved, so names users query survive. Nodes that nothing
needs afterwards are pruned, so no dead computation reaches completion or the report.

The optimize pass (`run_local`) runs TF's full graph optimizer once on the finished per-device program.
"""

import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd._layout.annotations import SHARDING_ATTR, SPEC_ATTR
from tf_gspmd.rewriter.graph import grappler_view
from tf_gspmd.rewriter.graph import graph_view
from tf_gspmd.rewriter.graph.graph_view import prune, side_effect_nodes, split_ref

OPTIMIZERS = ("function", "constfold", "shape", "arithmetic")
# What TF's runtime would run on the per-device program when it instantiates it on each device; run once here
# instead (TF then instantiates it without its optimizer: 8 devices meant 8 identical optimizations). Remapper
# fusions are CPU kernels, so they run only for CPU meshes; other meshes keep TF's runtime optimizer. Not
# "debug_stripper": TF's runtime does not strip assertions (Assert, CheckNumerics) or prints either, and a
# gs.function raises and prints when the tf.function would.
LOCAL_OPTIMIZERS = ("pruning", "function", "common_subgraph_elimination", "constfold", "shape", "arithmetic", "loop",
                    "dependency", "remapper")


def run(program):
  gd = program.graph_def
  keep = set(program.input_names) | set(program.variable_names) | {split_ref(r)[0] for r in program.output_refs}
  keep |= set(program.checks)   # assertions and prints run as in the tf.function
  # Annotations, and Identity nodes: the names users give tensors (tf.identity(x, name="h")) must survive.
  keep |= {n.name for n in gd.node if SHARDING_ATTR in n.attr or SPEC_ATTR in n.attr or
           n.op in ("XlaSharding", "Identity")}
  optimized = _optimized(_functional_control_flow(gd), keep, OPTIMIZERS)
  if optimized is None:  # Grappler dropped a node we must keep: fall back to the unoptimized graph.
    optimized = tf.compat.v1.GraphDef()
    optimized.CopyFrom(gd)
  graph_view.drop_colocation(optimized)   # (inlining colocates with nodes it then renames: they point nowhere)
  _restore_shape_hints(gd, optimized)
  # Drop what no output, annotation or side effect needs (Grappler leaves rewritten nodes behind).
  optimized = prune(optimized, sorted(keep) + side_effect_nodes(optimized))
  return program.replace(graph_def=optimized)


def run_local(program):
  """Pass: TF's graph optimizer on the per-device program, once at lowering (CPU meshes without XLA segments,
  not plan-only); the runtime then instantiates the program on every device without optimizing it again
  (`program.locally_optimized`)."""
  if program.jit is not None or not program.on_cpus:
    return program
  gd = program.local_graph_def
  keep = set(program.local_inputs) | set(program.local_variables) | set(program.local_outputs) | set(
      program.side_effects) | {program.partition_id} | set(program.report.emitted())
  optimized = _optimized(_functional_control_flow(gd), keep, LOCAL_OPTIMIZERS)   # (its loops stay While ops)
  if optimized is None:   # it dropped a node the program needs: leave the optimizing to TF's runtime
    return program
  return program.replace(local_graph_def=optimized, locally_optimized=True)


def _optimized(graph_def, keep, optimizers):
  """`graph_def` through Grappler's `optimizers` (one round), nodes in `keep` preserved; None if one was not.

  Grappler sees the graph as `grappler_view` shows it: no argument sizes, and no constant it would have to compute
  at more than `grappler_view.LIMIT_BYTES`; so optimizing costs memory and time by the graph's size alone."""
  meta = tf.compat.v1.MetaGraphDef()
  concealed = grappler_view.conceal(graph_def, meta.graph_def)
  meta.collection_def["train_op"].node_list.value.extend(sorted(keep))
  config = tf.compat.v1.ConfigProto()
  rewrite = config.graph_options.rewrite_options
  rewrite.min_graph_nodes = -1
  rewrite.meta_optimizer_iterations = rewrite.ONE
  rewrite.optimizers.extend(optimizers)
  optimized = grappler_view.reveal(_compat.optimize_graph(config, meta, _compat.grappler_cluster()), concealed)
  return None if keep - {n.name for n in optimized.node} else optimized


def _functional_control_flow(gd):
  """A copy of `gd` whose While/If/Case ops stay functional (completion and partitioning treat their bodies as
  functions) instead of being lowered to Switch/Merge; calls still inline."""
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(gd)
  for nd in list(out.node) + [nd for f in out.library.function for nd in f.node_def]:
    if nd.op in ("While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase"):
      nd.attr["_lower_using_switch_merge"].b = False
  return out


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
