"""The combine pass: independent collectives over the same devices become one (XLA's collective combiners).

Every collective costs a rendezvous of its group, which on CPUs and for small tensors costs more than the
bytes: a training step's gradient all-reduces, the all-gathers of weights stored split (ZeRO-style), the
exchanges of a step's reduce-scatters. Collectives that do not depend on each other, of one kind over the same
mesh axes (the same groups of devices; of a collective built in two levels across processes, the same level)
with the same dtype (and reduction), are concatenated into one op built by the collectives backend
(`Backend.combined`), then split back; every member's result is exactly what its own op returned:

  * all-reduce: the members' operands flattened side by side, summed (max, ...) at once, split;
  * all-gather: each device contributes its members' operands flattened side by side; the gathered [group,
    total] is split by columns, and each member's columns, reshaped to [group * rows, ...], are what its own
    gather returned (the op gathers dim 0; the member's own code then restores mesh order and moves the group
    into the dim it gathers, unchanged);
  * reduce-scatter: TF's CollectiveReduceScatterV2 has no CPU kernel, so the backend emits a reduce-scatter as
    an all-to-all of the chunks followed by a local reduction. What combines exactly is the all-to-all: the
    exchanges of independent reduce-scatters (and plain all-to-alls) over the same axes and of one dtype travel
    as one all-to-all of [group, total] (row k is every member's chunk for member k, flattened side by side);
    each member's local reduction stays its own. Collective-permutes are not combined.

Ops are combined as emitted, at the dtype they carry (where the backend packs or bitcasts a dtype that TF's op
does not take, the carrier's); the combined op sends the sum of its members' bytes, so the report's bytes per
device do not change.

Independence is data dependence: two collectives may share an op when neither depends on the other (no path
between them in the per-device program, through data or control edges), wherever they are in the program
(an all-reduce of the first layer's gradient with one of the last layer's). Merging must not create a cycle,
also not across combinations: with a1 -> b1 and b2 -> a2, {a1, a2} and {b1, b2} are each independent, yet
merging both pairs makes each merged op wait for the other. So collectives are binned greedily in a
topological order of the program. Each carries the bitset (a Python int) of the collectives it depends on.
When collective c is placed, its ancestors *in the program as merged so far* are that set closed under the
bins formed: a bin holding an ancestor is one op, so all its members and their ancestors are ancestors too.
c has no descendant placed yet, so putting it in bin B only adds edges from its ancestors' bins into B, and
that closes a cycle exactly when B holds one of those closed ancestors. c joins the first bin of its kind,
axes, dtype (and reduction) that holds none and stays within MAX_BYTES with it, else opens a bin; the merged
program is acyclic after every step. The merged op starts when its last operand is ready, so a member may run
later than it would alone; MAX_BYTES bounds the buffers a combination holds at once.

The report keeps the logical collectives, points each at the op that carries it (`with_combined`), and records
each combination (`report.combined`, `Combination`); the members are left without consumers for cleanup to
remove.
"""

import math

import tensorflow as tf

from tf_gspmd.rewriter.collectives.builders import Backend
from tf_gspmd.rewriter.graph.graph_view import GraphView, node_of, ref
from tf_gspmd.rewriter.graph.tables import HELPER_SCOPE, TABLES_SCOPE, table_constant, table_key
from tf_gspmd.rewriter.report import Combination

MAX_BYTES = 32 << 20
COMBINED = {"CollectiveReduceV2": "all-reduce", "CollectiveGatherV2": "all-gather",
            "CollectiveAllToAllV2": "all-to-all"}   # the op types combined, and their kinds


class _Bin:
  """Collectives to merge: their ops, the bitset of them, the bitset of what they depend on, their bytes."""

  def __init__(self, key):
    self.key, self.ops, self.mask, self.up, self.bytes = key, [], 0, 0, 0


def _ancestors(view, names):
  """(`names` in topological order, {name: bitset of the collectives among `names` it depends on, data or
  control, transitively}); bit k stands for the k-th name in that order."""
  names = set(names)
  below, out, order = {}, {}, []
  for nd in view.order():
    a = 0
    for i in nd.input:
      a |= below.get(node_of(i), 0)
    if nd.name in names:
      out[nd.name] = a
      a |= 1 << len(order)
      order.append(nd.name)
    if a:
      below[nd.name] = a
  return order, out


def plan(order, ancestors, key_of, nbytes_of, max_bytes=MAX_BYTES):
  """Bins of collectives to merge, [[name, ...], ...] (single members included), each in `order`.

  `order`: the collectives in a topological order of the program; `ancestors[name]`: the bitset (bit k: the
  k-th of `order`) of the collectives `name` depends on; `key_of(name)`: what must agree to merge (None: never
  merged); `nbytes_of(name)`: what it sends.
  """
  bins, merged = [], []   # merged: the bins of two or more (the only ones that add dependences)
  for k, name in enumerate(order):
    key, nbytes, reach = key_of(name), nbytes_of(name), ancestors[name]
    grown = True
    while grown:   # close under the bins formed: a bin holding an ancestor brings its members' ancestors
      grown = False
      for b in merged:
        if b.mask & reach and (b.mask | b.up) & ~reach:
          reach |= b.mask | b.up
          grown = True
    home = None
    if key is not None:
      home = next((b for b in bins if b.key == key and not b.mask & reach and b.bytes + nbytes <= max_bytes), None)
    if home is None:
      home = _Bin(key)
      bins.append(home)
    elif len(home.ops) == 1:
      merged.append(home)
    home.ops.append(name)
    home.mask |= 1 << k
    home.up |= ancestors[name]
    home.bytes += nbytes
  return [b.ops for b in bins]


def table_lookup(graph, pid):
  """Row `pid` of a per-device table, the table shared with partitioning's own (gspmd/tables/) when it holds the
  same values: a combined collective's group keys are the tables its members already read, not a copy per op."""
  tables = {}
  for op in graph.get_operations():
    if op.type == "Const" and op.name.startswith(TABLES_SCOPE):
      tables.setdefault(table_key(tf.make_ndarray(op.get_attr("value"))), op.outputs[0])
  return lambda table, name: tf.gather(table_constant(tables, table, name), pid)


def combine(program):
  """(new GraphDef, [Combination] per combined op, {member op name: Emitted of the combined op carrying it})."""
  emitted = program.report.emitted()
  view = GraphView(program.local_graph_def)
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(program.local_graph_def, name="")
  candidates = {}
  for name, e in emitted.items():
    if e.op in COMBINED and e.kind == COMBINED[e.op] and name in view:
      op = graph.get_operation_by_name(name)
      x = op.inputs[0]
      # the operand's shape: as built (the imported graph may not infer it, e.g. behind a per-device reshape)
      shape = [e.shape[0] // e.group_size] + list(e.shape[1:]) if e.kind == "all-gather" else list(e.shape)
      if x.shape.is_compatible_with(shape) and (e.kind != "all-to-all" or shape[0] == e.group_size):
        # its key, and the bytes of its result (an all-gather's: gathered), which the cap applies to
        key = (e.kind, e.axes, e.reduction, x.dtype, e.level)
        candidates[name] = (op, key, math.prod(e.shape) * x.dtype.size, shape)
  order, ancestors = _ancestors(view, candidates)
  bins = plan(order, ancestors, lambda n: candidates[n][1], lambda n: candidates[n][2])
  pid = graph.get_tensor_by_name(ref(program.partition_id))
  backend = Backend(program.mesh, program.devices, pid, table_lookup(graph, pid), None, program.processes)
  combined, rewires, carriers = [], [], {}
  for names in bins:
    if len(names) < 2:
      continue
    members = [candidates[n][0] for n in names]
    kind, axes, reduction, _, level = candidates[names[0]][1]
    e = _build(graph, backend, members, [candidates[n][3] for n in names], kind, axes, reduction, level,
               len(combined), rewires)
    carriers.update((n, e) for n in names)
    combined.append(Combination(kind, len(names), e.bytes, _logical_kinds(program.report, names)))
  out = GraphView(graph.as_graph_def())
  for old, new in rewires:
    out.rewire(old, new)
  return out.graph_def, combined, carriers


def _logical_kinds(report, names):
  """The kinds of the logical collectives the ops `names` carry (a reduce-scatter's exchange is an all-to-all)."""
  names = set(names)
  return tuple(sorted({c.kind for c in report.collectives if any(op.name in names for op in c.ops)}))


def _build(graph, backend, members, shapes, kind, axes, reduction, level, k, rewires):
  """The combined collective of the ops `members` (their operands of `shapes`) in `graph` (its Emitted); adds (old
  reference, new one) to `rewires` for each member's result and control edges."""
  with graph.as_default(), tf.name_scope(f"combined_{kind.replace('-', '_')}_{k}{HELPER_SCOPE}"):
    controls = {c for m in members for c in m.control_inputs}
    with tf.control_dependencies(sorted(controls, key=lambda o: o.name)):
      operands = [m.inputs[0] if m.inputs[0].shape.is_fully_defined() else tf.reshape(m.inputs[0], shape)
                  for m, shape in zip(members, shapes)]
      parts, e = backend.combined(kind, operands, axes, reduction, level)
    for m, part in zip(members, parts):
      rewires.append((m.outputs[0].name, part.name))
      rewires.append(("^" + m.name, "^" + e.name))
    return e


def run(program):
  """Pass: combine independent collectives of the per-device program (dropped ones are pruned by cleanup)."""
  gd, combined, carriers = combine(program)
  return program.replace(local_graph_def=gd, report=program.report.with_combined(combined, carriers))
