"""Pass: every device issues its collectives in one order.

NCCL (and any collective runtime that matches launches by their order) hangs when two devices launch the same
independent collectives in different orders; an executor runs ready ops in whatever order it likes, so the order
has to be in the program. The per-device program is one graph that every device runs: control edges that chain
its collectives into one sequence make every device launch them in that sequence.

The units of a graph (the top-level graph, and the body of every function that holds collectives) are its
collective ops -- a collective-permute's send and receive are one unit: they share an instance key and must run
side by side, since each device's send waits for its peer's receive -- and the ops that call a function holding
collectives (While, If, Case, function calls, XLA segments). The units are put in one order that respects the
graph's edges (among the units ready, the one with the lowest instance key first: the order the partitioner
emitted them), and each unit gets a control edge from the one before it. In a function body, every result also
waits for the body's last unit, and its first unit for the body's arguments: a loop's next iteration then starts
its collectives only after the last one of the iteration before has finished.
"""

import heapq

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.errors import PartitionError
from tf_gspmd.rewriter.graph import graph_view
from tf_gspmd.rewriter.collectives import vocabulary

_PAIRED = ("CollectiveBcastSendV2", "CollectiveBcastRecvV2", "CollectiveBcastSend", "CollectiveBcastRecv")


def run(program):
  """Pass: the per-device program's collectives chained in one order (the in-process graph has none)."""
  gd = program.local_graph_def
  if not holds_collectives(gd):
    return program
  return program.replace(local_graph_def=ordered(gd))


def holds_collectives(graph_def):
  return any(n.op in vocabulary.TF_COLLECTIVE_OPS for n in graph_def.node) or any(
      n.op in vocabulary.TF_COLLECTIVE_OPS for f in graph_def.library.function for n in f.node_def)


def ordered(graph_def, among=None):
  """A copy of `graph_def` whose collectives, in the graph and in every function body, are chained in one order;
  `among`: only these collectives of the top-level graph (names) are chained."""
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(graph_def)
  functions = {f.signature.name: f for f in out.library.function}
  holding = _functions_holding_collectives(functions)
  if among is None:
    for name in sorted(holding):
      fdef = functions[name]
      _chain(_Scope(fdef.node_def, _function_input), holding, fdef=fdef)
  _chain(_Scope(out.node, _graph_input), holding, among=among)
  return out


def sequence(graph_def):
  """The instance keys of the collectives the program launches, in the order its edges force, function bodies
  expanded where they are called (once per call op). Raises PartitionError when two units of a graph are not
  ordered by its edges (an executor could launch them in either order)."""
  functions = {f.signature.name: f for f in graph_def.library.function}
  holding = _functions_holding_collectives(functions)

  def of(scope, where):
    units, order = _units(scope, holding)
    keys = []
    ancestors = _unit_ancestors(scope, units)
    for a, b in zip(order, order[1:]):
      if not ancestors[b] >> a & 1:
        raise PartitionError(f"collectives {units[a].names} and {units[b].names} of {where} are not ordered by its "
                             "edges: devices may launch them in different orders", node=units[b].names[0])
    for u in order:
      for name in units[u].names:
        nd = scope.nodes[name]
        if nd.op in vocabulary.TF_COLLECTIVE_OPS:
          if nd.op in _PAIRED and name != units[u].names[0]:
            continue   # a permute's receive: the same instance as its send
          keys.append(_instance_key(scope, nd))
        else:
          for f in sorted(set(graph_view.function_names(nd)) & holding):
            keys.extend(of(_Scope(functions[f].node_def, _function_input), f"function {f}"))
    return keys

  return of(_Scope(graph_def.node, _graph_input), "the program")


def instance_key_of(graph_def, node):
  """The instance key of collective `node` of the top-level graph of `graph_def` (None when not a constant)."""
  return _instance_key(_Scope(graph_def.node, _graph_input), node)


# ---- graphs and function bodies as one kind of scope ------------------------------------------------------------

def _graph_input(inp):
  return graph_view.node_of(inp)


def _function_input(inp):
  """The node a function body's input names ("node:output:index", "^node"), or None for an argument."""
  inp = inp[1:] if inp.startswith("^") else inp
  return inp.split(":")[0] if ":" in inp else inp


class _Scope:
  """The nodes of a graph or of one function body, with the producers of each node within it."""

  def __init__(self, nodes, input_node):
    self.node_list = nodes
    self.nodes = {n.name: n for n in nodes}
    self.input_node = input_node

  def producers(self, nd):
    return [p for p in (self.input_node(i) for i in nd.input) if p in self.nodes]

  def topological(self):
    """Node names, every node after its producers (ties in the GraphDef's order)."""
    indegree, users = {}, {name: [] for name in self.nodes}
    position = {n.name: k for k, n in enumerate(self.node_list)}
    for n in self.node_list:
      ps = set(self.producers(n))
      indegree[n.name] = len(ps)
      for p in ps:
        users[p].append(n.name)
    ready = [(position[n], n) for n, d in indegree.items() if not d]
    heapq.heapify(ready)
    out = []
    while ready:
      _, n = heapq.heappop(ready)
      out.append(n)
      for u in users[n]:
        indegree[u] -= 1
        if not indegree[u]:
          heapq.heappush(ready, (position[u], u))
    if len(out) != len(self.nodes):
      raise PartitionError("the per-device program has a cycle of edges; its collectives cannot be ordered")
    return out


class _Unit:
  __slots__ = ("names", "rank")

  def __init__(self, names, rank):
    self.names, self.rank = names, rank


def _functions_holding_collectives(functions):
  """Names of the functions whose bodies (or the functions they call) hold a collective op."""
  return graph_view.functions_holding(functions, lambda n: n.op in vocabulary.TF_COLLECTIVE_OPS)


def _instance_key(scope, nd):
  """The instance key of collective node `nd`, a constant of the scope (read through Identity ops)."""
  args = [a.name for a in _compat.op_def(nd.op).input_arg]
  name = scope.input_node(nd.input[args.index("instance_key")])
  for _ in range(16):
    src = scope.nodes.get(name)
    if src is None:
      break
    if src.op == "Const":
      return int(np.asarray(tf.make_ndarray(src.attr["value"].tensor)).reshape(()))
    if src.op not in ("Identity", "Snapshot"):
      break
    name = scope.input_node(src.input[0])
  return None


def _units(scope, holding, among=None):
  """(units, their order): the scope's collectives (a send and the receive of its instance together) and the
  nodes calling functions in `holding` (`among`: only the collectives of these names); ordered along the edges,
  lowest instance key first among those ready."""
  by_key, units = {}, []
  for n in scope.node_list:
    if among is not None and n.name not in among:
      continue
    if n.op in vocabulary.TF_COLLECTIVE_OPS:
      key = _instance_key(scope, n)
      if key is None and n.op in _PAIRED:
        raise PartitionError("a collective-permute's instance key is not a constant of its graph: its send and "
                             "receive cannot be ordered together", node=n.name)
      if n.op in _PAIRED and ("pair", key) in by_key:
        unit = units[by_key[("pair", key)]]
        unit.names.append(n.name)
        if n.op.startswith("CollectiveBcastSend"):
          unit.names.insert(0, unit.names.pop())   # the send first
        continue
      if n.op in _PAIRED:
        by_key[("pair", key)] = len(units)
      units.append(_Unit([n.name], (key if key is not None else float("inf"), n.name)))
    elif set(graph_view.function_names(n)) & holding:
      units.append(_Unit([n.name], (float("inf"), n.name)))
  if not units:
    return units, []
  ancestors = _unit_ancestors(scope, units)
  order, placed = [], 0
  ready = [(u.rank, k) for k, u in enumerate(units) if not ancestors[k]]
  heapq.heapify(ready)
  waiting = {k for k in range(len(units)) if ancestors[k]}
  while ready:
    _, k = heapq.heappop(ready)
    order.append(k)
    placed |= 1 << k
    for j in sorted(waiting):
      if ancestors[j] & ~placed == 0:
        waiting.discard(j)
        heapq.heappush(ready, (units[j].rank, j))
  return units, order


def _unit_ancestors(scope, units):
  """Per unit, the bit set of the units it depends on (through any path of edges)."""
  unit_of = {name: k for k, u in enumerate(units) for name in u.names}
  below = {}
  for name in scope.topological():
    bits = 0
    for p in scope.producers(scope.nodes[name]):
      bits |= below[p]
      if p in unit_of:
        bits |= 1 << unit_of[p]
    below[name] = bits
  out = []
  for k, u in enumerate(units):
    bits = 0
    for name in u.names:
      bits |= below[name]
    out.append(bits & ~(1 << k))
  return out


def _add_control(nd, name):
  if f"^{name}" not in nd.input:
    nd.input.append(f"^{name}")


def _chain(scope, holding, fdef=None, among=None):
  """Control edges that put the units of `scope` in their order (a function body's `fdef`: its results wait for
  the last unit, its first unit for its arguments; `among`: see `ordered`)."""
  units, order = _units(scope, holding, among)
  if not units:
    return
  ancestors = _unit_ancestors(scope, units)
  for a, b in zip(order, order[1:]):
    if ancestors[b] >> a & 1:
      continue   # already after it
    for name in units[b].names:
      for before in units[a].names:
        _add_control(scope.nodes[name], before)
  if fdef is None:
    return
  first, last = units[order[0]], units[order[-1]]
  args = fdef.signature.input_arg
  if args and args[0].type:   # every argument waits as the results do: one of them is enough
    gate = _new_node(fdef, scope, f"{first.names[0]}/after_arguments", [args[0].name], args[0].type)
    for name in first.names:
      _add_control(scope.nodes[name], gate.name)
  for k, out in enumerate(fdef.signature.output_arg):
    if not out.type:
      raise PartitionError(f"result {out.name} of function {fdef.signature.name} has no fixed dtype: its "
                           "collectives cannot be ordered", node=fdef.signature.name)
    held = _new_node(fdef, scope, f"{last.names[0]}/before_result_{k}", [fdef.ret[out.name]], out.type)
    for before in last.names:
      _add_control(held, before)
    fdef.ret[out.name] = f"{held.name}:output:0"


def _new_node(fdef, scope, base, inputs, dtype):
  """An Identity of `dtype` appended to function body `fdef` (and to `scope`), named uniquely after `base`."""
  base = base.replace(":", "_")
  name, k = base, 0
  while name in scope.nodes:
    k += 1
    name = f"{base}_{k}"
  nd = fdef.node_def.add(name=name, op="Identity")
  nd.input.extend(inputs)
  nd.attr["T"].type = dtype
  scope.nodes[name] = nd
  return nd
