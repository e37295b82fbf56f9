"""The partition pass: one per-device GraphDef from the global graph and its completed shardings.

Nodes are visited in topological order; each op's rule emits its local computation through
`PartitionContext`, which reshards operands on demand (cached per tensor and layout), reshards results to
their completed sharding, and checks every local shape against the sharding's shard shape. Emitted helper
ops are named under `<node>/gspmd/`; per-device constants (offsets, group keys) are tables indexed by the
partition id, so the program is identical on every device.
"""

import contextlib
import warnings

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd import ops as op_rules
from tf_gspmd._layout.mesh import axes_text
from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.errors import PartitionError, ShapeError, UnsupportedOpError
from tf_gspmd.rewriter.partition import accumulation, halo, sums
from tf_gspmd.rewriter.sharding import completion, reshard
from tf_gspmd.rewriter.graph import functions, loops
from tf_gspmd.rewriter.collectives.builders import Backend
from tf_gspmd.rewriter.graph.graph_view import public_key, ref, split_ref
from tf_gspmd.rewriter.graph.tables import HELPER_SCOPE, PARTITION_ID, table_constant
from tf_gspmd.rewriter.program import variable_shard_bytes
from tf_gspmd.rewriter.report import Loop, ReportBuilder, StateRecord

# Ops that only read a variable through its handle; any other consumer of the handle may write it.
READ_ONLY_VARIABLE_OPS = frozenset({"ReadVariableOp", "VariableShape", "ResourceGather", "ResourceGatherNd"})
# Ops that read only their operand's static shape (ops/generators.py builds them as constants): a deferred op they
# read stays deferred.
STATIC_READERS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
_warned_fallback = set()
_warned_unknown_rank = set()


class PartitionContext(halo.WindowedOperands, accumulation.PendingSums, sums.PartialSums):
  """What a rule's `partition` sees: the node's operands (resharded on demand) and where to put results."""

  def __init__(self, program, graph, devices, report, functions=None, processes=None):
    self.program = program
    self.ir = program.ir
    self.mesh = program.mesh
    self.graph = graph
    self.report = report
    self.values = {}            # ref -> (local tensor, sharding)
    self.ops = {}               # original node name -> local tf.Operation
    self._reshards = {}
    self._windows = {}
    self._deferred = {}         # ref -> (windows.Shift, emit, node): an op its readers' windows fold in
    self._waited_on = None      # names of the nodes some node has as a control input (found on first use)
    self._tables = {}
    self.pid = tf.compat.v1.placeholder(tf.int32, [], name=PARTITION_ID)
    self.backend = Backend(self.mesh, devices, self.pid, self.lookup, report, processes)
    self.node = None
    self.local_inputs = []
    self.local_variables = []
    self.functions = [] if functions is None else functions   # per-device FunctionDefs of partitioned bodies
    # A loop body's accumulators (rewriter/loops.accumulators): values of their accumulation trees may be held
    # with a sum still pending over mesh axes. `pending`: ref -> (partial or None, loop variables inside it);
    # partial None: nothing pending yet (only unreduced carried parameters); `carried`: k -> the partial
    # loop variable k is carried with (None: reduced); `passing`: while a tree node is partitioned, what its
    # output holds pending.
    self.deferrable = frozenset()
    self.tree_nodes = frozenset()
    self.pending = {}
    self.carried = {}
    self.passing = None
    self.held = {}              # ref -> sums.Held: a sum left pending for its one reader, an add (sums.py)

  # ---- helpers for rules ------------------------------------------------------------------------------------
  def planned_axes(self):
    """{factor label: mesh axes} automatic sharding priced for this node (rewriter/auto/), or None."""
    plan = self.program.auto_plan
    return None if plan is None or not plan.planned else plan.planned.get(self.node.name)

  def target(self, o):
    return self.program.shardings[self.node.ref(o)]

  def current(self, i):
    r = self.node.inputs[i]
    if r in self._deferred or r in self.held:   # the layout it has once emitted (or reduced)
      return self.program.shardings[r]
    return self.values[r][1] if r in self.values else None

  def input_shape(self, i):
    return self.node.input_shape(i)

  def input_dtype(self, i):
    return self.node.input_info(i).dtype

  def operand(self, i, sharding):
    """Local value of input i laid out as `sharding` (resharded and cached as needed)."""
    r = self.node.inputs[i]
    if r in self.pending and self.passing is not None and i in loops.linear_inputs(self.node):
      if self.values[r][1] != sharding.with_rank(len(self.ir.info(r).shape)):
        raise accumulation.NotAccumulated(r)
      return self.values[r][0]   # an accumulator's term: its sum stays pending
    return self._operand_of(r, sharding, f"operand {i} of {self.node.name} ({self.node.op})")

  def _operand_of(self, r, sharding, what):
    """Local value of tensor `r` laid out as `sharding`, for `what` (the node's operand it is)."""
    if r in self.pending:
      self._settle(r)
    if r in self.held:
      self.settle_sum(r)
    self._emit_deferred(r)
    value, have = self.values[r]
    info = self.ir.info(r)
    if info.is_list and sharding is not None:
      _check_list_layout(r, have, sharding, what)
    if not info.partitionable or have == sharding:
      return value
    sharding = sharding.with_rank(len(info.shape))
    if have.with_rank(len(info.shape)) == sharding:
      return value
    key = (r, sharding)
    if key not in self._reshards:
      # Asked for: the node's result is pinned to the layout its operand is brought to (e.g. out_shardings=P() on
      # an identity of a split value).
      pinned = self.program.annotations or {}
      requested = any(pinned.get(self.node.ref(o)) == sharding for o in range(len(self.node.outputs)))
      with tf.name_scope(self._scope()), self.report.resharding_of(public_key(r), have, sharding, requested):
        reason = f"{what} needs {sharding}, {public_key(r)} is {have}"
        self._reshards[key] = reshard.emit_reshard(self, value, info.shape, have, sharding, None, self.node.name,
                                                   reason)
    return self._reshards[key]

  def operand_cost(self, i, sharding):
    """Bytes per device that resharding input i to `sharding` would move."""
    return self._cost_of(self.node.inputs[i], sharding)

  def _cost_of(self, r, sharding):
    """Bytes per device that resharding tensor `r` to `sharding` would move (emitting it first if deferred)."""
    info = self.ir.info(r)
    extra = 0
    if r in self._deferred:
      shift, _, node = self._deferred[r]
      with self._as_node(node):
        extra = shift.cost()
      have = self.program.shardings[r]
    elif r in self.held:   # reduced to its completed sharding before it is read (the reduction is owed anyway)
      have = self.program.shardings[r]
    elif r in self.values:
      have = self.values[r][1]
    else:
      return 0
    if not info.partitionable:
      return extra
    return extra + reshard.plan_bytes(info.shape, info.dtype.size, have, sharding.with_rank(len(info.shape)))

  def defer(self, shift, emit, readers):
    """Leave output 0 of the node unemitted when every node reading it is of a type in `readers`, reading it as
    input 0, or reads only its shape (STATIC_READERS), and nothing else waits on the node: those readers'
    windows (`window_rows`) then read `shift.source` (a `windows.Shift`) directly, so the ops take one halo
    exchange (a convolution and its filter gradient share it). A reader that reads it otherwise emits it first
    (`emit()`, run as the node; later readers read what it emitted). Returns whether the output was deferred."""
    r = self.node.ref(0)
    reading = self.ir.consumers.get(r, [])
    if (len(self.node.outputs) != 1 or r in self.ir.outputs or not reading or shift.source in self._deferred or
        any(reader.op not in STATIC_READERS and (k != 0 or reader.op not in readers) for reader, k in reading)):
      return False
    if self._waited_on is None:
      self._waited_on = {c for n in self.ir.nodes for c in n.control}
    if self.node.name in self._waited_on:
      return False
    self._deferred[r] = (shift, emit, self.node)
    return True

  def _emit_deferred(self, r):
    """Emit the deferred op behind tensor `r` (as its own node), when it is deferred."""
    if r not in self._deferred:
      return
    _, emit, node = self._deferred.pop(r)
    # outside the reader's name scope and control dependencies, as if emitted in its place
    with self._as_node(node), self.graph.name_scope(None), self.graph.control_dependencies(None):
      emit()

  @contextlib.contextmanager
  def _as_node(self, node):
    """The context seen from `node` (a deferred op's, while its reader is being partitioned)."""
    reader = self.node
    self.node = node
    try:
      yield
    finally:
      self.node = reader

  def output_cost(self, o, natural, partial=None):
    """Bytes per device that bringing output o from `natural` (+ partial) to its completed sharding moves."""
    info = self.ir.info(self.node.ref(o))
    if not info.partitionable:
      return 0
    return reshard.plan_bytes(info.shape, info.dtype.size, natural, self.target(o), partial)

  def clone(self, node, inputs, op_type=None, attrs=None, extra_inputs=(), extra_dtypes=()):
    """The node's op on local inputs ({input index: tensor}; other inputs replicated). Returns its outputs."""
    args = []
    for i in range(len(node.inputs)):
      args.append(inputs[i] if i in inputs else self.operand(i, Sharding(self.mesh)))
    args += list(extra_inputs)
    node_attrs = {k: v for k, v in node.attrs.items() if not k.startswith("_")}
    node_attrs.update(attrs or {})
    try:
      with self.graph.control_dependencies(self._control_ops(node)):
        op = self.graph.create_op(
            op_type or node.op, args, dtypes=[o.dtype for o in node.outputs] + list(extra_dtypes), attrs=node_attrs,
            name=node.name)
    except (ValueError, tf.errors.OpError) as e:
      raise PartitionError(f"local op could not be built from inputs "
                           f"{[tuple(a.shape.as_list()) for a in args]}: {e}", node=node.name, op_type=node.op) from e
    self.ops[node.name] = op
    return list(op.outputs)

  def identity(self, x):
    op = tf.identity(x, name=self.node.name)
    self.record(op)
    return op

  # ---- ops a rule builds itself -----------------------------------------------------------------------------------
  def helper_scope(self):
    """Name scope for ops a rule builds itself: `<node>/gspmd/`, with the node's reshards and lookups."""
    return tf.name_scope(self._scope())

  def after_control_inputs(self):
    """Control-dependency scope: ops built in it run after the node's control inputs (for a side effect a rule
    builds itself; `clone` gives its op these dependencies)."""
    return self.graph.control_dependencies(self._control_ops(self.node))

  def record(self, op):
    """Make `op` (an operation or a tensor's producer) the node's local op: the one later nodes' control
    dependencies on the node point to (`clone` and `identity` record theirs). Returns `op`."""
    self.ops[self.node.name] = getattr(op, "op", op)
    return op

  def _control_ops(self, node):
    """The local ops of `node`'s control inputs (those that produced one)."""
    return [self.ops[c] for c in node.control if c in self.ops]

  def partition_function(self, fname, arg_shapes, param_shardings, out_shardings, return_pid=False, loop=None):
    """Partition function `fname` (a While/If body) for these layouts; returns the per-device function's name.

    The per-device function takes the partition id as its last parameter (and, for a loop body, also
    returns it as its last result, so it stays a loop variable). `loop`: "body" or "cond" when the function is
    that part of the node's While loop (its collectives run once per iteration; the report counts them by the
    loop's trip count).
    """
    return self._partition_function(fname, arg_shapes, param_shardings, out_shardings, return_pid, loop, {})[0]

  def partition_loop_body(self, fname, cond, arg_shapes, shardings):
    """Partition the body `fname` of the current While (condition `cond`) for loop-variable layouts `shardings`,
    keeping the sums of its accumulators (rewriter/loops.accumulators; the condition does not read them)
    pending across iterations. Returns (the per-device function's name, {k: partial}): loop variable k is carried
    with that sum pending (its initial value given as one term of it, `one_term`, and the loop's output k
    reduced after the loop)."""
    sub = completion.body_program(self.program, fname, arg_shapes, shardings, shardings)
    cond_def = next(f for f in self.ir.graph_def.library.function if f.signature.name == cond)
    trees = loops.accumulators(sub.ir, [k for k in range(len(shardings)) if not loops.reads_parameter(cond_def, k)])
    if trees:
      mark = self.report.mark(), len(self.functions)
      try:
        return self._partition_function(fname, arg_shapes, shardings, shardings, True, "body", trees)
      except accumulation.NotAccumulated:
        self.report.rewind(mark[0])
        del self.functions[mark[1]:]
    return self._partition_function(fname, arg_shapes, shardings, shardings, True, "body", {})

  def _partition_function(self, fname, arg_shapes, param_shardings, out_shardings, return_pid, loop, trees):
    sub = completion.body_program(self.program, fname, arg_shapes, param_shardings, out_shardings)
    where = None
    if loop is not None:
      trips, at_most = loops.trip_count(self.ir, self.node.name)
      where = Loop(self.node.name, trips, at_most, condition=loop == "cond")
    graph = tf.Graph()
    with graph.as_default(), self.report.inside(self.node.name, where):
      _import_library(sub)
      ctx = PartitionContext(sub, graph, self.backend.devices, self.report, self.functions, self.backend.processes)
      if trees:
        ctx.deferrable = frozenset().union(*trees.values())
        ctx.tree_nodes = frozenset(split_ref(r)[0] for r in ctx.deferrable) - set(sub.ir.inputs)
        ctx.pending = {f"{sub.ir.inputs[k]}:0": (None, frozenset([k])) for k in trees}
      _partition_nodes(ctx)
      carried = ctx.accumulated(trees)
      outs = [ctx.values[r][0] for r in sub.ir.outputs] + ([tf.identity(ctx.pid)] if return_pid else [])
      params = [graph.get_tensor_by_name(ctx.ops[name].name + ":0") for name in sub.ir.inputs]
    name = f"{fname}_gspmd_{len(self.functions)}"
    self.functions.append(functions.to_function_def(graph, name, params + [ctx.pid], outs))
    # the functions the body's own ops built (a loop a rule emits inside it), which the program's library lacks
    known = {f.signature.name for f in self.functions} | {f.signature.name for f in sub.ir.graph_def.library.function}
    self.functions.extend(f for f in graph.as_graph_def().library.function if f.signature.name not in known)
    return name, carried

  def used(self, r):
    """Whether tensor `r` of the global graph is read, by a node or as an output of the program."""
    return bool(self.ir.consumers.get(r)) or r in self.ir.outputs

  def warn(self, message):
    """A line in the report's warnings."""
    self.report.warn(message)

  def local_shape(self, i, sharding):
    """Per-device shape of input i under `sharding` (None for opaque values)."""
    info = self.node.input_info(i)
    return sharding.with_rank(len(info.shape)).shard_shape(info.shape) if info.partitionable else None

  def lookup(self, table, name):
    """Row `partition_id` of a per-device constant table (deduplicated per graph)."""
    const = table_constant(self._tables, table, name)
    with tf.name_scope(self._scope()):
      return tf.gather(const, self.pid)

  def parameter(self, node):
    if node.name in self.program.variable_names:   # a variable handle: one shard of the variable per device
      info = node.outputs[0]
      ph = tf.compat.v1.placeholder(tf.resource, [], name=node.name)
      _give_shard_shape(ph, info, self.program.shardings[node.ref(0)])
      self.ops[node.name] = ph.op
      self.local_variables.append(ph.op.name)
      self._store(node.ref(0), ph, self.program.shardings[node.ref(0)])
      return
    k = self.ir.inputs.index(node.name)
    arriving = self.program.param_shardings[k]
    info = node.outputs[0]
    local = arriving.shard_shape(info.shape) if info.partitionable else info.shape
    ph = tf.compat.v1.placeholder(info.dtype, local, name=node.name)
    if info.dtype == tf.resource:   # a variable handle passed into a loop or branch body
      _give_shard_shape(ph, info, arriving)
    self.ops[node.name] = ph.op
    self.local_inputs.append(ph.op.name)
    self._store(node.ref(0), ph, arriving)

  def set_output(self, o, value, natural, partial=None):
    """Record output o laid out as `natural` (+ pending partial reduction), resharded to its completed sharding."""
    r = self.node.ref(o)
    target = self.program.shardings[r]
    info = self.ir.info(r)
    kept, partial = self._hold(r, natural, partial)
    if kept:
      self._store(r, value, target)
      return
    if r not in self.deferrable and self.hold_sum(r, value, natural, partial):
      return
    if info.partitionable and (partial or natural != target.with_rank(len(info.shape))):
      requested = (self.program.annotations or {}).get(r) is not None   # the user pinned the result's layout
      with tf.name_scope(self._scope()), self.report.resharding_of(public_key(r), natural, target, requested):
        what = f"{self.node.name} ({self.node.op}) produces {natural}"
        if partial:
          what += f" as partial {partial[1]} over {axes_text(partial[0])}"
        value = reshard.emit_reshard(self, value, info.shape, natural, target, partial, self.node.name,
                                     f"{what}; {public_key(r)} is completed as {target}{self.summed_text()}")
    elif info.is_list:
      _check_list_layout(r, natural, target, f"output {o} of {self.node.name} ({self.node.op})")
    self._store(r, value, target)

  # ---- internals --------------------------------------------------------------------------------------------------
  def _scope(self):
    return (self.node.name if self.node else "gspmd") + HELPER_SCOPE

  def _store(self, r, value, sharding):
    info = self.ir.info(r)
    if info.partitionable:
      want = sharding.with_rank(len(info.shape)).shard_shape(info.shape)
      got = tuple(value.shape.as_list()) if value.shape.rank is not None else None
      if got != want:
        raise PartitionError(f"local shape of {public_key(r)} is {got} but {sharding} needs {want}",
                             node=split_ref(r)[0], op_type=self.ir.producer(r).op)
    self.values[r] = (value, sharding)


def _give_shard_shape(handle, info, sharding):
  """Reads of the variable handle `handle` get its shard's static shape (when its value's shape is known)."""
  if info.value_shape is not None:
    local = sharding.with_rank(len(info.value_shape)).shard_shape(info.value_shape)
    _compat.set_resource_shape(handle, tf.TensorShape(local), info.value_dtype)


def _check_list_layout(r, have, want, where):
  """A TensorList handle cannot be resharded (its elements live inside it): its layouts must agree."""
  rank = len(have.dims) if not have.is_maximal else None
  if have == want or (rank is not None and not want.is_maximal and have == want.with_rank(rank)):
    return
  raise PartitionError(f"{where} needs the TensorList {public_key(r)} with elements laid out as {want}, but its "
                       f"elements are {have}; a list cannot be resharded: annotate the tensors pushed into it (or "
                       "the loop variables that become it) with one layout", node=split_ref(r)[0])


def _partition_nodes(ctx):
  """Every node of the context's program through its rule (or the reported fallback)."""
  program, report = ctx.program, ctx.report
  for node in program.ir.nodes:
    ctx.node = node
    ctx.begin_node(node)
    if ctx.reassociate(node):   # terms of pending sums added before they are reduced (sums.py)
      continue
    rule = op_rules.lookup(node.op)
    if rule is None:
      if program.options.strict:
        raise UnsupportedOpError(f"no partitioning rule for op type {node.op}; strict=True forbids the replicated "
                                 "fallback (remove strict=True to run it replicated)", node=node.name, op_type=node.op)
      report.fallback(node.name, node.op)
      if node.op not in _warned_fallback:
        _warned_fallback.add(node.op)
        warnings.warn(f"tf_gspmd: op type {node.op} (first at {node.name}) has no partitioning rule; its operands "
                      "are replicated and it runs whole on every device", stacklevel=3)
      rule = op_rules.FALLBACK
    else:
      unknown = rule.unknown_rank(node)
      if unknown is not None:
        ctx.warn(f"{node.name} ({node.op}): {unknown} has unknown rank, so the op runs whole on every device "
                 "(its operands replicated); give the value a static shape to partition it")
        if node.op not in _warned_unknown_rank:
          _warned_unknown_rank.add(node.op)
          warnings.warn(f"tf_gspmd: {node.name} ({node.op}): {unknown} has unknown rank; the op runs replicated",
                        stacklevel=3)
        rule = op_rules.FALLBACK
    try:
      rule.partition(ctx, node)
    except PartitionError as e:
      # (the node that raised: this one, or the producer of a sum held for it and reduced as it is read)
      origins = _split_arguments_behind(program, program.ir.by_name[e.node]) if e.node in program.ir.by_name else []
      if not origins:
        raise
      raise PartitionError(f"{e.message}; it comes from {', '.join(origins)}: pass that argument replicated (P() in "
                           "in_shardings) or convert it to a dtype TF collectives carry (floats, ints up to int64, "
                           "bool; a complex tensor as tf.math.real and tf.math.imag)", node=e.node,
                           op_type=e.op_type) from e
  ctx.node = ctx.passing = None


def _uncarried(dtype):
  """Dtypes TF collectives carry neither natively nor through an exact cast (the backend refuses them)."""
  return dtype.is_complex or dtype.is_quantized or dtype in (tf.uint64, tf.string, tf.variant)


def _split_arguments_behind(program, node):
  """'argument k (name) <dtype> split as P(...)' for every split argument of a dtype collectives cannot carry
  that node's inputs derive from (so an error about such a value can name where it entered)."""
  ir = program.ir
  seen, stack, found = set(), list(node.inputs), []
  while stack:
    r = stack.pop()
    name = split_ref(r)[0]
    if name in seen:
      continue
    seen.add(name)
    if name in ir.inputs:
      k = ir.inputs.index(name)
      s, dtype = program.param_shardings[k], ir.info(r).dtype
      if _uncarried(dtype) and not s.is_maximal and not s.is_replicated:
        found.append((k, f"argument {k} ({name}), {dtype.name} split as {s}"))
      continue
    stack.extend(ir.node(name).inputs)
  return [text for _, text in sorted(found)]


def _import_library(program):
  if program.ir.graph_def.library.function:
    # With the graph's versions: a GraphDef of producer 0 would make [] mean "unknown shape" for placeholders.
    lib = tf.compat.v1.GraphDef(library=program.ir.graph_def.library, versions=program.ir.graph_def.versions)
    tf.graph_util.import_graph_def(lib, name="")


def _state_records(program):
  records = []
  for name, var in zip(program.variable_names, program.variables):
    local = variable_shard_bytes(program, name)
    if local is None:
      continue
    info = program.ir.info(ref(name))
    records.append(StateRecord(var.name if var is not None else name, info.value_shape,
                               str(program.shardings[ref(name)]), local,
                               int(np.prod(info.value_shape)) * info.value_dtype.size,
                               "update state" if name in program.update_state else "weight"))
  return records


def run(program):
  """Pass: build the per-device program (GraphDef), its input/output names and the collective report.

  Also records what the runtime needs without the IR: the partition-id input, per captured variable its
  stored layout and whether the program may write it (any use of its handle but a read), per output its
  sharding, global shape and dtype. Later passes keep these boundary nodes in place.
  """
  for k, r in enumerate(program.ir.outputs):
    info = program.ir.info(r)
    if info.shape is None and info.dtype not in (tf.resource, tf.variant):
      raise ShapeError(f"result {k} ({public_key(r)}, {info.dtype.name}) has unknown rank; a function's results need "
                       "static shapes: give it one (tf.ensure_shape or tf.reshape to a static shape) before returning "
                       "it", node=split_ref(r)[0])
  weights = {tuple(program.ir.info(ref(name)).value_shape): (var.name if var is not None else name)
             for name, var in zip(program.variable_names, program.variables)
             if not program.shardings[ref(name)].is_replicated}
  report = ReportBuilder(strict=program.options.strict, weight_shapes=weights)
  graph = tf.Graph()
  with graph.as_default():
    _import_library(program)
    ctx = PartitionContext(program, graph, program.devices, report, processes=program.processes)
    _partition_nodes(ctx)
    outputs = []
    for k, r in enumerate(program.ir.outputs):
      value, _ = ctx.values[r]
      outputs.append(tf.identity(value, name=f"gspmd/output_{k}").op.name)
  checks = set(program.checks)
  side_effects = [op.name for name, op in ctx.ops.items()
                  if (not program.ir.node(name).outputs and program.ir.node(name).op not in ("NoOp",)) or name in checks]
  graph_def = graph.as_graph_def()
  graph_def.library.function.extend(ctx.functions)
  ir = program.ir
  variable_shardings = tuple(program.shardings[ref(name)] for name in program.variable_names)
  written = tuple(any(c.op not in READ_ONLY_VARIABLE_OPS for c, _ in ir.consumers.get(ref(name), ()))
                  for name in program.variable_names)
  output_specs = tuple((program.shardings[r], tuple(ir.info(r).shape), ir.info(r).dtype) for r in ir.outputs)
  return program.replace(local_graph_def=graph_def, local_inputs=tuple(ctx.local_inputs),
                         local_variables=tuple(ctx.local_variables),
                         local_outputs=tuple(outputs), side_effects=tuple(side_effects),
                         report=report.build(program.completion_iterations, _state_records(program)),
                         partition_id=PARTITION_ID,
                         variable_shardings=variable_shardings, variables_written=written, output_specs=output_specs)
