"""A view over a GraphDef: tensor references, topological order, fan-outs, rewiring and pruning.

The one place where the rewriter reads and edits graphs as data, in the spirit of Grappler's
(Mutable)GraphView: every pass that orders, rewires or prunes NodeDefs does it through this module.
A tensor reference is "node:index"; a control input is "^node". Public sharding keys drop ":0" (the tensor
`h` is "h", its second output "h:1"), matching how users name tensors with tf.identity(..., name="h").
"""

import hashlib
import heapq

import numpy as np
import tensorflow as tf

from tf_gspmd._platform import compat as _compat


def ref(name, index=0):
  return f"{name}:{index}"


def split_ref(r):
  """("node", index) of a data reference "node:index" or "node" (index 0)."""
  name, _, idx = r.rpartition(":")
  if not name or not idx.isdigit():
    return r, 0
  return name, int(idx)


def is_control(inp):
  return inp.startswith("^")


def node_of(inp):
  """The name of the node an input string (data or control) refers to."""
  return split_ref(inp[1:] if is_control(inp) else inp)[0]


def normalize(inp):
  """A data input as "node:index" (a bare "node" means output 0); control inputs unchanged."""
  return inp if is_control(inp) else ref(*split_ref(inp))


def public_key(r):
  name, idx = split_ref(r)
  return name if idx == 0 else f"{name}:{idx}"


def node_def(name, op, inputs=(), attrs=None):
  """A NodeDef: `inputs` as reference strings, `attrs` as {key: tf.compat.v1.AttrValue} (see `write`)."""
  return write(tf.compat.v1.NodeDef(name=name), op, inputs, **(attrs or {}))


def write(node, op, inputs=(), **attrs):
  """NodeDef `node` (its name and device kept) made op `op` of `inputs`, with only `attrs` (see `set_attrs`)."""
  node.op = op
  node.ClearField("attr")
  del node.input[:]
  node.input.extend(inputs)
  set_attrs(node, **attrs)
  return node


def write_const(node, value):
  """NodeDef `node` (its name and device kept) made a Const holding `value`."""
  value = np.asarray(value)
  return write(node, "Const", dtype=tf.as_dtype(value.dtype), value=value)


def set_attrs(node, **attrs):
  """Attributes of NodeDef `node` (each replacing the one it had) from Python values: a tf.DType, a bool, an int, a
  str, a list of ints, a tf.TensorShape, a numpy array (a tensor) or an AttrValue."""
  for key, v in attrs.items():
    a = node.attr[key]
    a.Clear()
    if isinstance(v, tf.DType):
      a.type = v.as_datatype_enum
    elif isinstance(v, bool):
      a.b = v
    elif isinstance(v, int):
      a.i = v
    elif isinstance(v, str):
      a.s = v.encode()
    elif isinstance(v, (list, tuple)):
      a.list.i.extend(v)
    elif isinstance(v, tf.TensorShape):
      a.shape.CopyFrom(v.as_proto())
    elif isinstance(v, np.ndarray):
      a.tensor.CopyFrom(tf.make_tensor_proto(v))
    else:
      a.CopyFrom(v)


class GraphView:
  """Nodes of a GraphDef by name, with their fan-outs; edits change the GraphDef in place.

  `consumers(r)` and `order()` are computed on demand and forgotten after an edit.
  """

  def __init__(self, graph_def):
    self.graph_def = graph_def
    self._by_name = None
    self._fanout = None

  # ---- reading --------------------------------------------------------------------------------------------
  @property
  def by_name(self):
    if self._by_name is None:
      self._by_name = {n.name: n for n in self.graph_def.node}
    return self._by_name

  def node(self, name):
    return self.by_name[name]

  def __contains__(self, name):
    return name in self.by_name

  @staticmethod
  def data_inputs(nd):
    return [normalize(i) for i in nd.input if not is_control(i)]

  @staticmethod
  def control_inputs(nd):
    return [i[1:] for i in nd.input if is_control(i)]

  def consumers(self, r):
    """[(NodeDef, input position)] reading tensor `r` ("node:index"), or "^node" as a control input."""
    if self._fanout is None:
      self._fanout = {}
      for n in self.graph_def.node:
        for k, i in enumerate(n.input):
          self._fanout.setdefault(normalize(i), []).append((n, k))
    return self._fanout.get(normalize(r), [])

  def order(self):
    """The NodeDefs in topological order (Kahn's algorithm, stable in GraphDef order: deterministic).

    Raises ValueError naming a node on a cycle.
    """
    nodes = list(self.graph_def.node)
    index = {n.name: k for k, n in enumerate(nodes)}
    deps = [set() for _ in nodes]
    users = [[] for _ in nodes]
    for k, n in enumerate(nodes):
      for i in n.input:
        src = index.get(node_of(i))
        if src is not None and src not in deps[k]:
          deps[k].add(src)
          users[src].append(k)
    remaining = [len(d) for d in deps]
    ready = [k for k in range(len(nodes)) if not remaining[k]]
    heapq.heapify(ready)
    out = []
    while ready:
      k = heapq.heappop(ready)
      out.append(nodes[k])
      for u in users[k]:
        remaining[u] -= 1
        if remaining[u] == 0:
          heapq.heappush(ready, u)
    if len(out) != len(nodes):
      stuck = next(n.name for k, n in enumerate(nodes) if remaining[k])
      raise ValueError(f"the graph has a cycle through node {stuck}")
    return out

  # ---- editing --------------------------------------------------------------------------------------------
  def add(self, nd):
    """Append a NodeDef (a copy); returns the stored one."""
    if nd.name in self.by_name:
      raise ValueError(f"the graph already has a node named {nd.name}")
    new = self.graph_def.node.add()
    new.CopyFrom(nd)
    self._changed()
    return new

  def rewire(self, old, new):
    """Every consumer of `old` reads `new` instead: data references ("n:i") or control inputs ("^n").

    A control input that becomes a duplicate is dropped.
    """
    old, new = normalize(old), normalize(new)
    users = []
    for nd, _ in self.consumers(old):
      if not any(u is nd for u in users):
        users.append(nd)
    # The fan-out index is updated in place for the nodes edited (rebuilding it per rewire makes a pass that
    # rewires every op quadratic in the graph's size).
    fanout = self._fanout
    for nd in users:
      for i in set(nd.input):
        key = normalize(i)
        fanout[key] = [(n, k) for n, k in fanout.get(key, ()) if n is not nd]
      inputs = [new if normalize(i) == old else i for i in nd.input]
      nd.ClearField("input")
      nd.input.extend(dedupe_controls(inputs))
      for k, i in enumerate(nd.input):
        fanout.setdefault(normalize(i), []).append((nd, k))

  def _changed(self):
    self._by_name = None
    self._fanout = None

  def pruned(self, roots):
    """A new GraphDef with only the nodes that the nodes named `roots` depend on, and the functions they use."""
    by_name = self.by_name
    live, stack = set(), list(roots)
    while stack:
      name = stack.pop()
      if name in live or name not in by_name:
        continue
      live.add(name)
      stack.extend(node_of(i) for i in by_name[name].input)
    gd = self.graph_def
    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(gd.versions)
    out.node.extend(n for n in gd.node if n.name in live)
    funcs = {f.signature.name: f for f in gd.library.function}
    used, stack = set(), [name for n in out.node for name in function_names(n)]
    while stack:
      name = stack.pop()
      if name in used or name not in funcs:
        continue
      used.add(name)
      stack.extend(x for nd in funcs[name].node_def for x in function_names(nd))
    out.library.function.extend(f for f in gd.library.function if f.signature.name in used)
    out.library.gradient.extend(g for g in gd.library.gradient if g.function_name in used)
    return out


def dedupe_controls(inputs):
  """Data inputs in order, then each control input once (TF wants controls after data inputs)."""
  data = [i for i in inputs if not is_control(i)]
  seen, ctrl = set(), []
  for i in inputs:
    if is_control(i) and i not in seen:
      seen.add(i)
      ctrl.append(i)
  return data + ctrl


def through_identities(nodes, inp):
  """The name of the node behind input string `inp` past any Identity ops (`nodes`: name -> NodeDef; a variable
  read's handle resolves to the handle's placeholder), or None where the chain leaves `nodes`."""
  x = nodes.get(node_of(inp))
  while x is not None and x.op == "Identity":
    x = nodes.get(node_of(x.input[0]))
  return None if x is None else x.name


def prune(graph_def, roots):
  """A copy of `graph_def` with only the nodes that `roots` (node names) depend on."""
  return GraphView(graph_def).pruned(roots)


def function_names(nd):
  """Names of the functions a NodeDef refers to (func attrs, lists of funcs, and function-call op types)."""
  names = [nd.op]
  for v in nd.attr.values():
    if v.HasField("func"):
      names.append(v.func.name)
    elif v.HasField("list"):
      names.extend(f.name for f in v.list.func)
  return names


def functions_holding(functions, holds):
  """Names of the functions of `functions` ({name: FunctionDef}) whose bodies, or the bodies of the functions they
  call, hold a node for which `holds(NodeDef)` is true."""
  holding = {name for name, f in functions.items() if any(holds(n) for n in f.node_def)}
  changed = True
  while changed:
    changed = False
    for name, f in functions.items():
      if name not in holding and any(set(function_names(n)) & holding for n in f.node_def):
        holding.add(name)
        changed = True
  return holding


def named_by_content(graph_def):
  """A copy of `graph_def` whose library functions are named by what they compute (each name suffixed with a hash
  of its body, the functions it calls renamed first), and every reference renamed: two programs imported into one
  process then never hold different bodies under one name (TF's function library keeps one body per name)."""
  functions = {f.signature.name: f for f in graph_def.library.function}
  renamed = {}

  def rename_refs(nodes):
    for nd in nodes:
      if nd.op in renamed:
        nd.op = renamed[nd.op]
      for v in nd.attr.values():
        if v.HasField("func") and v.func.name in renamed:
          v.func.name = renamed[v.func.name]
        elif v.HasField("list"):
          for f in v.list.func:
            f.name = renamed.get(f.name, f.name)

  def visit(name):
    if name in renamed:
      return
    renamed[name] = name   # (no function calls itself)
    fdef = functions[name]
    for nd in fdef.node_def:
      for callee in function_names(nd):
        if callee in functions:
          visit(callee)
    rename_refs(fdef.node_def)
    body = type(fdef)()
    body.CopyFrom(fdef)
    body.signature.name = ""
    digest = hashlib.sha1(body.SerializeToString(deterministic=True)).hexdigest()[:12]
    renamed[name] = f"{name}_{digest}"
    fdef.signature.name = renamed[name]

  out = type(graph_def)()
  out.CopyFrom(graph_def)
  functions = {f.signature.name: f for f in out.library.function}
  for name in list(functions):
    visit(name)
  rename_refs(out.node)
  for grad in out.library.gradient:
    grad.function_name = renamed.get(grad.function_name, grad.function_name)
    grad.gradient_func = renamed.get(grad.gradient_func, grad.gradient_func)
  return out


def is_stateful(op_type):
  op_def = _compat.op_def(op_type)
  return op_def is not None and op_def.is_stateful


def side_effect_nodes(graph_def):
  """Nodes run for their effect: stateful ops whose outputs nobody needs to see (e.g. variable writes)."""
  out = []
  for n in graph_def.node:
    op_def = _compat.op_def(n.op)
    if op_def is not None and op_def.is_stateful and not op_def.output_arg and n.op != "NoOp":
      out.append(n.name)
  return out


def drop_colocation(graph_def):
  """Remove colocation constraints (`_class: loc:@node`, from `tf.compat.v1.colocate_with`: `tf.nn.embedding_lookup`,
  `colocate_gradients_with_ops`) from every node and function argument of `graph_def`, in place.

  tf_gspmd places every op itself, so they mean nothing here; once a node they name is inlined or renamed they point
  nowhere (the graph no longer imports), and a node that lost one no longer matches its traced self (whose static
  shapes the grappler pass restores only on nodes it left unchanged).
  """
  attr_maps = [nd.attr for nd in graph_def.node]
  for f in graph_def.library.function:
    attr_maps += [nd.attr for nd in f.node_def] + [a.attr for a in f.arg_attr.values()]
  for attrs in attr_maps:
    if "_class" in attrs:
      kept = [c for c in attrs["_class"].list.s if not c.startswith(b"loc:@")]
      del attrs["_class"].list.s[:]
      attrs["_class"].list.s.extend(kept)
      if not kept:
        del attrs["_class"]
