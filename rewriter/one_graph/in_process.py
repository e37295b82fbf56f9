"""In-process pass: on CPU devices of one process, the per-device programs become one graph.

Every mesh device runs the same per-device program; TF's collective executor joins their collectives. On
logical CPUs of one process that costs more than the data it moves: a small all-reduce over 4 logical CPUs
takes ~400 us beyond its arithmetic (ring steps, callbacks, thread wake-ups), and a transformer step runs
dozens. The devices share the host's memory and cores, so this pass instead writes the per-device program of
every device into one GraphDef (node `d<p>/<name>`: device p's copy, the partition id a constant) with each
collective as its in-process meaning, the ordinary ops that compute its result from the members' tensors, which the
collectives vocabulary (rewriter/collectives/vocabulary.py) states beside each op; `Edges` is what the meanings
build with. Who takes part in each collective is read from its record in the report (`Emitted.groups`, its
instance key, a receive's send), as the collectives builder made it: nothing of the program is run or decoded.

Then:

  * placement: what touches a device's variables (their reads, writes and the handles) runs on that device;
    everything else on the first mesh device. A logical CPU is a label on the same cores, and one executor
    needs no send/receive pair for each edge between devices; XLA segments then compile once for the mesh
    (TF keeps an XLA cache per device);
  * stacking (rewriter/one_graph/stacking.py): the devices' copies of an op run as one op over a leading device
    dimension, collectives included. A small variable the program only reads and writes whole is stored stacked (one
    [devices, ...] tf.Variable on the first device, runtime/state.py): one read and one write serve every
    device, and a replicated one's row 0 stands for its value. Other variables' reads and writes run per device:
    a replicated variable is read once, on device 0; each device's reads of one shape reach the first device as
    one tensor, and the values written come back likewise;
  * one copy per class of equal values (`_copy_of`): devices holding the same tile of an argument, the members of
    a collective whose result is the same on each (the vocabulary's `depends_on`), and, through stateless ops,
    devices whose operands are equal compute equal values; a node is written once for each such class of
    devices, and their uses read that copy. What the devices compute alike -- a replicated weight's update, the
    layer norm of an all-reduced activation -- is written and runs once.

These are the semantics of TF's ops as the partitioner uses them; the per-device program, its report and the
bytes it counts are unchanged (`program.in_process` is another way to run them). The runtime calls the graph once
per step with every device's arguments; a result's per-device tensors may live in the first device's memory (the
host's, as for every logical CPU).

Across processes (CPUs of several processes, `gs.initialize`), each process builds the graph of its own devices
(`local_positions`; the partition ids are their mesh positions). A collective whose groups stay within each
process has its in-process meaning. One whose groups join one member of each of several processes -- a flat
collective over a mesh axis that spans them, or the across level of one built in two levels -- is one TF
collective of the stacked operand among the first devices of those processes (`crossing`), when every device of
the process is the member at its own local index: row i then meets row i of every peer process, as device i's
value meets its peers' (an all-to-all may have several members in each process: each process sends another its
devices' blocks for that one's members). A collective-permute's transfer between two processes is TF's broadcast
send or receive on its device. Those ops are chained in one order (rewriter/collectives/ordering.py), the same in every
process, and run under the step's deadline. The bytes that cross processes are those of the per-device ops, sent
once per process.

The pass leaves the program alone (`in_process` None: TF's collectives run on every device) on non-CPU devices,
when devices are not known (plan mode, a plan for other processes), when a collective sits inside a function body,
when a collective across processes joins members at different local indices or an operand of unknown shape, with
XLA segments across processes, or when the caller chose `exchange="collectives"`.
"""

import dataclasses
from typing import Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.rewriter.program import variable_shard
from tf_gspmd.rewriter.collectives.groups import group_key
from tf_gspmd.rewriter.graph import graph_view
from tf_gspmd.rewriter.collectives import ordering
from tf_gspmd.rewriter.one_graph import stacking
from tf_gspmd.rewriter.one_graph import stacking_rules
from tf_gspmd.rewriter.collectives import vocabulary


@dataclasses.dataclass(frozen=True)
class InProcess:
  """The multi-device graph of one step: `inputs` and `outputs` are tensor names, argument-major (argument k of
  device p at k * devices + p; a stacked variable's one handle); `side_effects` op names of one NoOp per device
  that runs after that device's side effects."""
  graph_def: tf.compat.v1.GraphDef
  inputs: Tuple[str, ...]
  outputs: Tuple[str, ...]
  side_effects: Tuple[str, ...]
  stacked: Tuple[bool, ...] = ()   # per captured variable: its shards are rows of one variable (one input)


# A print's operands are replicated (ops/fallback.py), so every device's copy prints the same text: in one graph
# device 0's prints, once per call, as the tf.function would. (Through TF's collectives each device prints.)
PRINT_OPS = frozenset(("PrintV2",))

# A variable of at most this many elements per device that the program only reads and writes whole is stored as
# one [devices, ...] tf.Variable (runtime/state.py): one read and one write per step instead of one per device.
STACKED_VARIABLE_LIMIT = stacking.STACK_LIMIT


def runs_as_one_graph(program):
  """Whether the program takes the one-graph path (rewriter/pipeline.py): it runs on CPUs with exchange "auto", in
  one process or in the processes that drive its devices now (not a plan for other processes)."""
  if program.options.exchange != "auto" or not program.on_cpus:
    return False
  return program.processes is None or program.process is not None


def local_positions(program):
  """The mesh positions the process the program is lowered for drives (`program.process`), in mesh order (every one
  in one process): those of the runtime's `parallel.Local`, whose devices take the graph's arguments in this
  order."""
  return tuple(p for p in range(len(program.devices))
               if program.processes is None or program.processes[p] == program.process)


def applies(program, emitted):
  """`crossing(program, emitted)` (`emitted`: the report's records of the collectives) where the program can run as one graph per process (collectives within a process as
  in-process edges, those across processes as TF's), else None (see the module docstring)."""
  if program.jit == "whole":
    return None
  if program.processes is not None and program.jit:   # XLA segments run per device: nothing would be stacked
    return None
  gd = program.local_graph_def
  if any(n.op in vocabulary.TF_COLLECTIVE_OPS for f in gd.library.function for n in f.node_def):
    return None
  found = crossing(program, emitted)
  if found is None or not all(n.op in vocabulary.EMITTED and n.name in emitted and
                              (n.name in found[0] or vocabulary.EMITTED[n.op].runs_in_process(n))
                              for n in gd.node if n.op in vocabulary.TF_COLLECTIVE_OPS):
    return None
  return found


# The collectives that can cross processes in the one graph of a process: one op over the stacked operand; and
# the halves of a collective-permute's transfers, TF's op on the device whose peer is in another process.
ACROSS_KINDS = ("all-reduce", "all-gather", "all-to-all")
PERMUTE_KIND = "collective-permute"


def crossing(program, emitted):
  """({collective op name: (group key, process count, instance key, slots)} of the per-device program's collectives
  whose groups cross processes, each to run in this process's one graph as one op over the stacked operand among
  the first devices of the processes its groups join, {collective-permute op name: the local devices whose
  transfer crosses processes, each to run TF's op on its device}); None when some collective can run neither so
  nor in the graph.

  That takes groups whose members in each process they join are the same local indices (a position's index among
  its process's positions in mesh order), in every process, the same processes for every device of a process, and
  one member in each process but for an all-to-all (checked for every process, so that all decide alike): then
  row i of the stacked operand meets row i of every peer process, as device i's value meets its peers'. `slots[i]` (an
  all-to-all's): for each member of device i's group within a process, in rank order, the row of what it sends and
  device i's slot among them (row * members per process + slot). A collective whose groups stay within each process has
  its in-process meaning."""
  if program.processes is None:
    return {}, {}
  devices, processes = program.devices, program.processes
  mine = local_positions(program)
  index, seen = {}, {}
  for p, q in enumerate(processes):   # each position's local index within its process
    index[p] = seen[q] = seen.get(q, -1) + 1
  heads = {q: processes.index(q) for q in set(processes)}   # each process's first position
  me = processes[mine[0]]
  found, pairs = {}, {}
  for x in program.local_graph_def.node:
    if x.op not in vocabulary.TF_COLLECTIVE_OPS:
      continue
    if x.name not in emitted or emitted[x.name].groups is None:
      return None   # (a collective without its record)
    groups = emitted[x.name].groups
    if vocabulary.kind_of(x) == PERMUTE_KIND:   # a transfer of two devices: across processes, TF's op on its device
      remote = frozenset(i for i, p in enumerate(mine)
                         if any(processes[m] != program.process for m in groups.of_position(p)))
      if remote:
        pairs[x.name] = remote
      continue
    # Every process decides alike (each checks every process's devices): a collective runs one way in all.
    joins, slots = {}, []
    for p in range(len(devices)):
      members = groups.of_position(p)   # in rank order
      joined = tuple(dict.fromkeys(processes[m] for m in members))   # in rank order
      joins.setdefault(processes[p], set()).add(joined if len(joined) > 1 else None)
      if len(joined) == 1:
        continue   # within the process
      per = len(members) // len(joined)
      rows = {tuple(index[m] for m in members[k * per:(k + 1) * per]) for k in range(len(joined))}
      if len(members) % len(joined) or len(rows) != 1 or index[p] not in next(iter(rows)) or \
          tuple(processes[m] for m in members) != tuple(q for q in joined for _ in range(per)) or \
          (per > 1 and vocabulary.kind_of(x) != "all-to-all") or vocabulary.kind_of(x) not in ACROSS_KINDS:
        return None
      row, = rows
      if processes[p] == me:
        slots.append([r * per + row.index(index[p]) for r in row])
    if any(len(j) != 1 for j in joins.values()):
      return None
    joined, = joins[me]
    if joined is not None:
      members = [devices[heads[q]] for q in joined]
      found[x.name] = (group_key(members), len(members), emitted[x.name].instance_key,
                       np.array(slots, np.int32))
  return found, pairs


def run(program):
  """Pass: program.in_process, the per-device programs of this process's devices as one graph (see the module
  docstring)."""
  emitted = program.report.emitted()
  found = applies(program, emitted)
  if found is None:
    return program
  try:
    return program.replace(in_process=_build(program, emitted, found, grouped=True))
  except stacking_rules.CannotStack:   # a collective across processes the one graph cannot hold: TF's collectives run
    return program
  except ValueError as e:   # reads and writes joined into a cycle (rare): each crosses on its own
    if "cycle" not in str(e):
      raise
    return program.replace(in_process=_build(program, emitted, found, grouped=False))


class Edges:
  """What a collective's in-process meaning (vocabulary.Collective.in_process) builds with: the one graph of every
  device's program under construction, device p's copy of node n named `d<p>/<n>`."""

  def __init__(self, program, out, positions, emitted):
    self.out = out
    self.devices = [program.devices[p] for p in positions]   # this process's: p below is an index of these
    self._positions = tuple(positions)
    self._local = {m: p for p, m in enumerate(positions)}   # mesh position -> its index among this process's
    self._emitted = emitted   # the collectives' records (the report's): who takes part in each

  def ref(self, p, name):
    """Input string `name` of the per-device program, as device p's copy reads it."""
    return f"^d{p}/{name[1:]}" if name.startswith("^") else f"d{p}/{name}"

  def ranked(self, p, name):
    """The members of the group of device p's collective `name` (indices of this process's devices), in runtime
    rank order."""
    return [self._local[m] for m in self._emitted[name].groups.of_position(self._positions[p])]

  def sender(self, p, name):
    """(device index, op name) of what device p's receive `name` receives: its group's other member's send."""
    e = self._emitted[name]
    return self._local[e.groups.of_position(self._positions[p])[0]], e.partner

  def controls(self, p, x):
    """NodeDef `x`'s control inputs, as device p's copy reads them."""
    return [self.ref(p, i) for i in x.input if i.startswith("^")]

  def input(self, x, arg):
    """The input of NodeDef `x` that feeds its OpDef argument `arg`."""
    return x.input[[a.name for a in _compat.op_def(x.op).input_arg].index(arg)]

  def add(self, name, p):
    """A new node named `name` on device p's device."""
    node = self.out.node.add()
    node.name, node.device = name, self.devices[p]
    return node

  def const(self, name, value, p):
    graph_view.write_const(self.add(name, p), value)
    return name


def _build(program, emitted, found, grouped):
  gd = program.local_graph_def
  positions = local_positions(program)
  devices = [program.devices[p] for p in positions]
  n = len(devices)
  across, pairs = found   # (crossing)
  if across or pairs:   # the collectives across processes, issued in one order (a permute's with its transfers)
    permutes = {x.name for x in gd.node if vocabulary.kind_of(x) == PERMUTE_KIND} if pairs else set()
    gd = ordering.ordered(gd, among=set(across) | permutes)
  out = tf.compat.v1.GraphDef()
  out.versions.CopyFrom(gd.versions)
  out.library.CopyFrom(gd.library)
  edges = Edges(program, out, positions, emitted)
  handles, touching = _resources(program, gd)
  # XLA segments (jit_compile=True on CPU) are function calls that run per device: such a program is not stacked.
  stack = not program.jit
  uniform, read_once, stacked, shards = _read_once(program, gd, edges.ref, stack)
  replicated = program.replicated_variables()
  stacker = stacking.Stacker(gd, out, devices, program.partition_id,
                             touching if stack else {x.name for x in gd.node}, uniform if stack else {}, shards,
                             lambda x: [edges.ranked(p, x.name) for p in range(n)], grouped and stack,
                             stacked_variables={v: v in replicated for v in stacked},
                             positions=positions, across=across)
  copy = _copy_of(program, gd, edges, stacker, handles | touching | set(pairs))
  _copies(program, gd, edges, stacker, copy, (uniform, read_once, touching, pairs))
  return _assembled(program, out, edges.ref, stacker, copy, stacked)


def _resources(program, gd):
  """(resource handles -- the captured variables', those the program creates (a VarHandleOp: each device's copy
  is its own resource only on its own device) -- and identities of them; the nodes that touch one)."""
  handles = set(program.local_variables) | {x.name for x in gd.node if _creates_resource(x)}
  for x in graph_view.GraphView(gd).order():
    if x.op in ("Identity", "IdentityN") and any(graph_view.node_of(i) in handles for i in x.input):
      handles.add(x.name)
  touching = {x.name for x in gd.node if x.name in handles or any(graph_view.node_of(i) in handles for i in x.input)}
  return handles, touching


def _read_once(program, gd, ref, stack):
  """(uniform: {node: device 0's copy, which stands for every device's}, read_once: {read of a replicated variable
  stored per device: its variable}, the variables stored stacked, {variable: its shard (shape, dtype)})."""
  # Replicated arguments are one value on every device: device 0's copy stands for all (see _same_tiles).
  uniform = {name: ref(0, name) for name, sharding in zip(program.local_inputs, program.param_shardings)
             if sharding is not None and sharding.is_replicated}
  # So are the reads of a replicated variable (every device holds and writes the same value): device 0 reads it
  # for all, and each device's writes still go to its own copy.
  replicated = program.replicated_variables()
  nodes = {x.name: x for x in gd.node}
  read_once = {x.name: graph_view.through_identities(nodes, x.input[0]) for x in gd.node  # read -> its variable
               if stack and x.op == "ReadVariableOp"}
  shards = {name: variable_shard(program, name) for name in program.local_variables}
  stacked = _stackable(gd, shards, program.local_outputs) if stack else set()
  read_once = {r: v for r, v in read_once.items() if v in replicated and v not in stacked}
  uniform.update({name: ref(0, name) for name in read_once})
  return uniform, read_once, stacked, shards


def _copies(program, gd, edges, stacker, copy, shared):
  """The copies of the nodes the stacker leaves per device (into `edges.out`): device p's where it stands for its
  own (`copy`), a collective's as its in-process meaning."""
  uniform, read_once, touching, pairs = shared
  ref, devices, positions = edges.ref, edges.devices, local_positions(program)
  nodes = {x.name: x for x in gd.node}
  for p in range(len(devices)):
    for x in gd.node:
      if stacker.form[x.name] != stacking.PER_DEVICE and (x.name not in uniform or p and x.name in read_once):
        continue
      if x.name in copy and copy[x.name][p] != p and x.op != "Placeholder":   # (an argument is fed to every copy)
        continue
      node = edges.out.node.add()
      node.CopyFrom(x)
      # What touches a device's variables runs on that device, everything else on the first (see the docstring).
      node.name, node.device = f"d{p}/{x.name}", devices[p if x.name in touching or x.name in pairs else 0]
      del node.input[:]
      # Device p's copy of a replicated variable is not read (device 0's read stands for it): its writes need
      # not wait for device 0's read.
      node.input.extend(ref(p, i) for i in x.input
                        if not (p and x.name in touching and graph_view.is_control(i) and i[1:] in read_once and
                                read_once[i[1:]] == graph_view.through_identities(nodes, x.input[0])))
      value = stacker.write_value(x, p)
      if value is not None:   # one of a group of writes whose values reach the device together
        node.input[1] = value
      if x.name == program.partition_id:
        graph_view.write_const(node, np.int32(positions[p]))
      elif x.op in vocabulary.EMITTED and p not in pairs.get(x.name, ()):   # (none over a group of one)
        vocabulary.EMITTED[x.op].in_process(edges, x, node, p)


def _copy_of(program, gd, edges, stacker, own):
  """{node the stacker leaves per device: per device p, the device whose copy stands for p's -- p itself, or one
  whose copy computes the same value}.

  Devices hold equal values where the per-device program does the same to equal operands: an argument's equal tiles
  (a replicated argument is the same everywhere, `_same_tiles`); a uniform operand (the stacker's); a collective's
  result, where the vocabulary says it depends on the group's operands only (all-reduce, all-gather: the group's
  first member computes it for all) or on them and the rank (all-to-all); and whatever a stateless op computes from
  equal operands. Stateful ops, the `own` nodes (variable handles and what touches them, transfers across
  processes), the partition id and a stacked operand's rows are each device's own. A print is device 0's (its
  operands are replicated: printed once per call, as the tf.function would). So what the devices compute alike -- a
  replicated weight's update, the layer norm of an all-reduced activation -- is written once, never copied to be
  merged later."""
  n = len(edges.devices)
  functions = {f.signature.name: f for f in gd.library.function}
  copy = _same_tiles(program, local_positions(program))

  def operand(i, p):
    control = graph_view.is_control(i)
    name, k = graph_view.split_ref(i[1:] if control else i)
    form = stacker.form[name]
    return (copy[name][p] if name in copy else None if form == stacking.UNIFORM else p, name, k, control)

  for x in graph_view.GraphView(gd).order():
    if stacker.form[x.name] != stacking.PER_DEVICE or x.name in copy:
      continue
    called = functions.get(x.op) or (functions.get(x.attr["f"].func.name) if "f" in x.attr else None)
    stateful = called.signature.is_stateful if called is not None else graph_view.is_stateful(x.op)
    collective = vocabulary.EMITTED.get(x.op)
    if x.op in PRINT_OPS:
      copy[x.name] = (0,) * n
    elif x.op == "Placeholder" or x.name in own or x.name == program.partition_id or (
        collective is None and stateful) or (collective is not None and collective.depends_on is None):
      copy[x.name] = tuple(range(n))
    else:
      copy[x.name] = _equal_copies(x, collective, edges, n, operand)
  return copy


def _equal_copies(x, collective, edges, n, operand):
  """Per device p, the first device whose copy of NodeDef `x` has the same operands (`operand(input, p)`); a
  collective whose members all get one result stands for its group by its first member (which computes it)."""
  controls = [i for i in x.input if graph_view.is_control(i)]
  keys, firsts = [], []
  for p in range(n):
    if collective is None:
      keys.append(tuple(operand(i, p) for i in x.input))
      firsts.append(p)
      continue
    ranked = edges.ranked(p, x.name)
    keys.append((tuple(operand(x.input[0], q) for q in ranked), tuple(operand(i, p) for i in controls)) +
                ((ranked.index(p),) if collective.depends_on == "rank" else ()))
    firsts.append(ranked[0] if collective.depends_on == "group" else p)
  first = {}
  # (a member whose controls differ from its group's first keeps its own copy, which reads the first's result)
  return tuple(first.setdefault(keys[p], firsts[p] if keys[firsts[p]] == keys[p] else p) for p in range(n))


def _assembled(program, out, ref, stacker, copy, stacked):
  """The InProcess record of the one graph `out`: references renamed to the stacker's forms and to the copies that
  stand for each device's (`copy`)."""
  n = len(local_positions(program))
  existing = {x.name for x in out.node}

  def renamed(i):
    return _to_copy(stacker.rename(i, existing), copy)

  outputs = [renamed(ref(p, graph_view.normalize(t))) for t in program.local_outputs for p in range(n)]
  # A side effect that equals another device's (a check of the same tile) runs once, as that one.
  effects = dict.fromkeys(renamed("^" + ref(p, s))[1:] for s in program.side_effects for p in range(n))
  for x in out.node:
    inputs = [renamed(i) for i in x.input]
    del x.input[:]
    x.input.extend(graph_view.dedupe_controls(inputs))
  graph_view.GraphView(out).order()   # ValueError on a cycle (grouped reads and writes can close one: see run)
  inputs = [ref(p, graph_view.normalize(t)) for t in program.local_inputs for p in range(n)]
  for v in program.local_variables:
    inputs += [f"stk/{v}:0"] if v in stacked else [ref(p, graph_view.normalize(v)) for p in range(n)]
  return InProcess(out, tuple(inputs), tuple(outputs), _joined_per_device(out, effects),
                   tuple(v in stacked for v in program.local_variables))


def _stackable(gd, shards, outputs):
  """The captured variables' handle Placeholders (`shards`: each one's shard (shape, dtype), or None) whose
  variables can be stored stacked: only read and written whole (ReadVariableOp, Assign*VariableOp on the handle
  itself, nothing else takes it), not a result, and small enough (STACKED_VARIABLE_LIMIT)."""
  found = {v for v, shard in shards.items()
           if shard is not None and int(np.prod(shard[0], dtype=np.int64)) <= STACKED_VARIABLE_LIMIT}
  found -= {graph_view.node_of(t) for t in outputs}
  whole = ("ReadVariableOp",) + tuple(stacking.WRITES)
  for x in gd.node:
    for k, i in enumerate(x.input):
      if graph_view.node_of(i) in found and (k or graph_view.is_control(i) or x.op not in whole):
        found.discard(graph_view.node_of(i))
  return found


def _joined_per_device(graph, effects):
  """One NoOp per device that waits for that device's side effects (added to `graph`), for the call to wait on:
  each control edge from another device to the first is a send/receive pair in TF's executor."""
  devices = {x.name: x.device for x in graph.node}
  by_device = {}
  for name in effects:
    by_device.setdefault(devices[name], []).append(name)
  joined = []
  for k, (device, names) in enumerate(by_device.items()):
    node = graph.node.add()
    node.name, node.op, node.device = f"side_effects_on_{k}", "NoOp", device
    node.input.extend("^" + name for name in names)
    joined.append(node.name)
  return tuple(joined)


def _creates_resource(node):
  """Whether NodeDef `node` creates a resource (a stateful op with a resource output: VarHandleOp, a table)."""
  op_def = _compat.op_def(node.op)
  return op_def is not None and op_def.is_stateful and any(
      a.type == tf.resource.as_datatype_enum for a in op_def.output_arg)


def _to_copy(i, copy):
  """Input string `i` of the one graph, a reference to device p's copy of a per-device node (`d<p>/<name>`) read
  from the copy that stands for it (`copy`)."""
  control = graph_view.is_control(i)
  name, k = graph_view.split_ref(i[1:] if control else i)
  head, _, rest = name.partition("/")
  if rest not in copy or not (head[:1] == "d" and head[1:].isdigit()):
    return i
  name = f"d{copy[rest][int(head[1:])]}/{rest}"
  return f"^{name}" if control else (f"{name}:{k}" if ":" in i else name)


def _same_tiles(program, positions):
  """{argument Placeholder: per device p, the first device holding the same tile}: equal tiles hold equal values (a
  replicated argument is the same on every device), so the copies can read one (p indexes `positions`, the mesh
  positions of the graph's devices)."""
  same = {}
  for name, sharding, spec in zip(program.local_inputs, program.param_shardings, program.arg_specs):
    rank = spec.shape.rank
    if sharding is None or sharding.is_maximal or rank is None:
      continue
    s = sharding.with_rank(rank)
    first = {}
    same[graph_view.node_of(name)] = tuple(
        first.setdefault(tuple(s.tile_index(position, d) for d in range(rank)), p) for p, position in enumerate(positions))
  return same
