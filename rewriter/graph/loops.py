"""Static trip counts of While loops, read from how TF encodes a loop.

A While (TF2's functional loop, which `tf.while_loop`, autograph's `for i in tf.range(n)` and `gs.pipeline`
build) carries its loop variables through a condition function and a body function. How many times its body
runs is known without running it when its condition is a conjunction (LogicalAnd, through Identity) of
comparisons (Less, LessEqual, Greater, GreaterEqual, NotEqual; either operand order) of a *counter* with a
*static* value:

  * a counter is a loop variable that the body advances by a static step (`v + s`, `s + v`, `v - s`) and whose
    initial value is static: the loop counter TF adds to every While (variable 0, from 0 by 1, compared with
    variable 1 where `maximum_iterations` is given), the iterate of autograph's `for i in tf.range(a, b, d)`
    (from a by d, compared with b), a hand-written `i + 1` (gs.pipeline's iteration counter);
  * a static value is a constant, integer arithmetic of static values (Add, Sub, Mul, FloorDiv, Maximum,
    Minimum, Cast), a loop variable that the body returns unchanged whose initial value is static, or the final
    value of a counter of another loop whose trip count is known: a loop's gradient loop (TF's While gradient)
    runs while its own counter is below the forward loop's counter, which ends at the forward trip count.

Each comparison gives the iteration at which it first fails; the loop stops at the first of them. A conjunct
of any other form (a test on data) makes the trip count unknown; the comparisons that were read still bound it
(`at_most`). Values of loop variables inside an enclosing body (a bound passed into a nested loop from outside
it) are not followed: such a loop's trip count is unknown.

It also finds a loop's *accumulators* (`accumulators`): loop variables that each iteration only adds to (a
gradient loop's sums of the weight gradients). Their sum may stay pending over mesh axes across iterations
and be reduced once after the loop (GSPMD keeps such loop-carried values partial).
"""

import operator

import numpy as np
import tensorflow as tf

from tf_gspmd.ops import registry
from tf_gspmd.rewriter.graph.graph_view import is_control, split_ref

WHILE_OPS = ("While", "StatelessWhile")
_ARITHMETIC = {"AddV2": operator.add, "Add": operator.add, "Sub": operator.sub, "Mul": operator.mul,
               "FloorDiv": operator.floordiv, "Maximum": max, "Minimum": min}
_SAME = ("Identity", "Snapshot", "StopGradient", "Cast")
# a comparison with the counter as its second operand, as one with it first
_FLIPPED = {"Less": "Greater", "LessEqual": "GreaterEqual", "Greater": "Less", "GreaterEqual": "LessEqual",
            "NotEqual": "NotEqual"}
_DEPTH = 64   # how deep a static value's computation is followed


def trip_count(ir, name):
  """(trips, at_most) of the While node `name` of graph `ir` (a graph_ir.Graph whose GraphDef holds the loop's
  functions): how many times its body runs, or None when that is not known statically, and then a static bound
  on it, or None."""
  return _Trips(ir).of(name)


def _scalar(value):
  """A numpy constant as a Python int (a bool as a bool), or None when it is not an integer scalar."""
  value = np.asarray(value)
  if value.ndim != 0 or not (np.issubdtype(value.dtype, np.integer) or value.dtype == np.bool_):
    return None
  return bool(value) if value.dtype == np.bool_ else int(value)


def _count(op, init, step, bound):
  """The iteration at which `counter op bound` first fails for a counter from `init` by `step`; None: never."""
  if op == "Less":
    return 0 if init >= bound else (-(-(bound - init) // step) if step > 0 else None)
  if op == "LessEqual":
    return 0 if init > bound else ((bound - init) // step + 1 if step > 0 else None)
  if op == "Greater":
    return 0 if init <= bound else (-(-(init - bound) // -step) if step < 0 else None)
  if op == "GreaterEqual":
    return 0 if init < bound else ((init - bound) // -step + 1 if step < 0 else None)
  if init == bound:   # NotEqual
    return 0
  if step and (bound - init) % step == 0 and (bound - init) // step > 0:
    return (bound - init) // step
  return None


class _Graph:
  """The graph a While sits in: tensors are "node:index"; it has no parameters whose values are known."""

  def __init__(self, ir):
    self.ir = ir

  def param(self, t):  # pylint: disable=unused-argument
    return None

  def node(self, t):
    name, index = split_ref(t)
    node = self.ir.by_name.get(name)
    return None if node is None else (node.node_def, list(node.inputs), index)


class _Function:
  """A loop's condition or body: tensors are "node:output:index", or a parameter's name."""

  def __init__(self, fdef):
    self.params = {a.name: k for k, a in enumerate(fdef.signature.input_arg)}
    self.nodes = {nd.name: nd for nd in fdef.node_def}
    self.results = [fdef.ret[a.name] for a in fdef.signature.output_arg]

  def param(self, t):
    return self.params.get(t)

  def node(self, t):
    parts = t.split(":")
    nd = self.nodes.get(parts[0])
    if nd is None:
      return None
    return nd, [i for i in nd.input if not is_control(i)], int(parts[2]) if len(parts) == 3 else 0


class _Trips:
  """Trip counts of the While nodes of one graph, each computed once."""

  def __init__(self, ir):
    self.graph = _Graph(ir)
    self.functions = {f.signature.name: f for f in ir.graph_def.library.function}
    self.memo = {}

  def of(self, name):
    if name not in self.memo:
      self.memo[name] = (None, None)   # a loop whose bound depends on itself: unknown
      try:
        self.memo[name] = _Loop(self, name).trips()
      except (KeyError, IndexError, ValueError, TypeError):   # a form not read here: unknown
        pass
    return self.memo[name]

  def value(self, scope, t, leaf, depth=0):
    """The static value of tensor `t` of `scope` (None when it is not static); `leaf(k)` gives parameter k's."""
    k = scope.param(t)
    if k is not None:
      return leaf(k)
    found = scope.node(t) if depth < _DEPTH else None
    if found is None:
      return None
    nd, inputs, index = found
    if nd.op == "Const":
      return _scalar(tf.make_ndarray(nd.attr["value"].tensor))
    if nd.op in _SAME:
      return self.value(scope, inputs[0], leaf, depth + 1)
    if nd.op in _ARITHMETIC and len(inputs) == 2:
      a, b = (self.value(scope, i, leaf, depth + 1) for i in inputs)
      if a is None or b is None or (nd.op == "FloorDiv" and not b):
        return None
      return _ARITHMETIC[nd.op](a, b)
    if nd.op in WHILE_OPS and scope is self.graph:
      return _Loop(self, nd.name).final(index)
    return None


class _Loop:
  """One While node of the graph: its initial values, condition and body."""

  def __init__(self, trips, name):
    self.owner, self.name = trips, name
    node = trips.graph.ir.node(name)
    self.inputs = node.inputs
    self.cond = _Function(trips.functions[node.attr("cond").name])
    self.body = _Function(trips.functions[node.attr("body").name])

  def initial(self, k):
    return self.owner.value(self.owner.graph, self.inputs[k], None)

  def _through(self, scope, t):
    """(NodeDef, data inputs) producing `t` past identities, or ("param", k) for a parameter."""
    for _ in range(_DEPTH):
      k = scope.param(t)
      if k is not None:
        return "param", k
      found = scope.node(t)
      if found is None:
        return None
      nd, inputs, _ = found
      if nd.op not in ("Identity", "Snapshot"):
        return nd, inputs
      t = inputs[0]
    return None

  def invariant(self, k):
    """Whether the body returns loop variable k unchanged."""
    return self._through(self.body, self.body.results[k]) == ("param", k)

  def static(self, scope, t):
    """The static value of tensor `t` of the condition or body (a parameter only when the body keeps it)."""
    return self.owner.value(scope, t, lambda k: self.initial(k) if self.invariant(k) else None)

  def counter(self, k):
    """(initial value, step) of loop variable k when it is a counter, else None."""
    found = self._through(self.body, self.body.results[k])
    if not found or found[0] == "param" or found[0].op not in ("AddV2", "Add", "Sub") or len(found[1]) != 2:
      return None
    nd, (a, b) = found
    for mine, other in ((a, b), (b, a)) if nd.op != "Sub" else ((a, b),):   # v + s, s + v, v - s
      if self._through(self.body, mine) == ("param", k):
        step = self.static(self.body, other)
        init = self.initial(k)
        if step is not None and init is not None:
          return init, (-step if nd.op == "Sub" else step)
    return None

  def final(self, k):
    """The static value of output k once the loop has run, or None."""
    if self.invariant(k):
      return self.initial(k)
    counter = self.counter(k)
    trips = self.owner.of(self.name)[0]
    return None if counter is None or trips is None else counter[0] + counter[1] * trips

  def conjuncts(self, t, depth=0):
    found = self._through(self.cond, t)
    if found and found[0] != "param" and found[0].op == "LogicalAnd" and depth < _DEPTH:
      return [c for i in found[1] for c in self.conjuncts(i, depth + 1)]
    return [t]

  def bound_of(self, t):
    """The iteration at which conjunct `t` first fails: an int, "never", or None (not read)."""
    value = self.static(self.cond, t)
    if value is not None:
      return "never" if value else 0
    found = self._through(self.cond, t)
    if not found or found[0] == "param" or found[0].op not in _FLIPPED or len(found[1]) != 2:
      return None
    nd, operands = found
    for side, op in ((0, nd.op), (1, _FLIPPED[nd.op])):
      var = self._through(self.cond, operands[side])
      if var and var[0] == "param":
        counter = self.counter(var[1])
        bound = self.static(self.cond, operands[1 - side])
        if counter is not None and bound is not None:
          n = _count(op, counter[0], counter[1], bound)
          return "never" if n is None else n
    return None

  def trips(self):
    bounds = [self.bound_of(t) for t in self.conjuncts(self.cond.results[0])]
    counts = [b for b in bounds if b is not None and b != "never"]
    least = min(counts) if counts else None
    if None in bounds and least != 0:
      return None, least
    return least, None


def linear_inputs(node):
  """The inputs of `node` its output is linear in (a tuple of indices; its rule's `linear`), so a sum pending over
  mesh axes in them stays pending in the output: what a gradient loop's accumulation is built from; or None."""
  if len(node.outputs) != 1:
    return None
  return registry.linear_inputs(node.op, len(node.inputs))


def sum_inputs(node):
  """The inputs of `node` that a pending sum passes through with its layout (a tuple of indices: every input),
  or None: `node` is linear in every input (adds, subtractions, negations, copies: XLA's all-reduce reassociation
  looks through the same) and they all have its output's static shape (no broadcasting, which would change the
  layout a term is held in), so each output element is a linear function of the same element of every operand."""
  which = linear_inputs(node)
  if not which or len(which) != len(node.inputs):
    return None
  shape = node.outputs[0].shape
  if shape is None or any(node.input_info(i).shape != shape for i in which):
    return None
  return which


def summed_by(ir):
  """{tensor: the name of the one node reading it} for the tensors of graph `ir` that only an element-wise linear
  op (`sum_inputs`) reads, and none of the graph's results: a sum pending in such a tensor may be added to the
  op's other terms before it is reduced, since nothing else needs its value."""
  found = {}
  results = set(ir.outputs)
  for r, readers in ir.consumers.items():
    if r in results or not readers or len({n.name for n, _ in readers}) != 1:
      continue
    which = sum_inputs(readers[0][0])
    if which and all(j in which for _, j in readers):
      found[r] = readers[0][0].name
  return found


def reads_parameter(fdef, k):
  """Whether FunctionDef `fdef` reads its parameter k (by a node or as a result)."""
  name = fdef.signature.input_arg[k].name
  uses = [i for nd in fdef.node_def for i in nd.input if not is_control(i)] + list(fdef.ret.values())
  return any(u == name or u.startswith(name + ":") for u in uses)


def accumulators(body, candidates):
  """{k: tensors of its accumulation} for the loop variables k (among `candidates`) that body `body` (a
  graph_ir.Graph of a While's body) only adds to: the body's result k is computed by linear ops (`linear_inputs`)
  from parameter k and other values, every consumer of a tensor of that computation (parameter k's included)
  being one of its linear ops (on a linear input). The tensors are the computation's, parameter k and result k
  included; its other inputs are whatever the body computes."""
  found = {}
  for k in candidates:
    param, result = f"{body.inputs[k]}:0", body.outputs[k]
    info = body.info(param)
    if not info.dtype.is_floating or info.shape is None or body.outputs.count(result) != 1 or \
        body.consumers.get(result):
      continue
    tree, changed = {result}, True
    while changed:   # grow backwards: a tensor joins once all its readers are linear ops of the tree
      changed = False
      for t in list(tree):
        if t == param:
          continue
        node = body.producer(t)
        for i in linear_inputs(node) or ():
          s = node.inputs[i]
          if s in tree or s in body.outputs:
            continue
          readers = body.consumers.get(s, ())
          if readers and all(r.ref(0) in tree and j in (linear_inputs(r) or ()) for r, j in readers):
            tree.add(s)
            changed = True
    if param in tree:
      found[k] = frozenset(tree)
  return found
