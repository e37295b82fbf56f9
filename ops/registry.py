"""The one registry of per-op sharding rules, keyed by TF op type.

A rule answers three questions about an op, so completion and partitioning cannot drift apart:
- `forward(ctx, node, operands)`: candidate shardings of the outputs from the operands' shardings;
- `backward(ctx, node, outputs, operands)`: candidate shardings of the operands from the outputs' shardings;
- `partition(ctx, node)`: emit the op's per-device computation through the partition context `ctx`;
and one question for automatic sharding: `strategies(node, mesh)`, the splits of its factors it may choose among.
A rule also states the op's one-graph form (`stacked_form(op_type)`, one of STACKED_FORMS): how the one graph of a
process's devices (rewriter/one_graph/) writes the op once over a leading device dimension.

`ctx` is the completion context (the program being completed; `ctx.complete_function` completes a function
body, for control flow), `partition`'s `ctx` the partition context. Candidates are lists (one per source)
that completion merges with its single merge function; rules never resolve conflicts themselves. `lookup`
is the only way to find a rule; an unregistered op gets `FALLBACK`.

A rule's `partition` builds the node's op with `ctx.clone` (or `ctx.identity`); ops it builds itself go
inside `ctx.helper_scope()` (and `ctx.after_control_inputs()` for a side effect), and `ctx.record(op)`
names the op that stands for the node when it is built by hand.
"""

import tensorflow as tf

_RULES = {}
# The one-graph forms an op may take, each written by the Stacker method `_stack_<form>`
# (rewriter/one_graph/stacking_rules.py): broadcasting ops (element-wise, batched matmuls) take a stacked operand of
# lower rank with unit dims after the device dim; "same_shape" ops take every operand at the result's shape;
# "scalar_or_same" ones each operand at the result's shape or a scalar; the others move their axes, perms, begins,
# paddings or shapes by one.
STACKED_FORMS = frozenset((
    "broadcasting", "same_shape", "scalar_or_same", "bias_add", "softmax", "reshape", "transpose", "reduction",
    "matmul", "concat", "split", "split_v", "pack", "unpack", "slice", "strided_slice", "tile", "pad",
    "broadcast_to", "expand_dims", "squeeze", "one_hot", "gather", "einsum"))
_HANDLES = (tf.resource, tf.variant, tf.string)   # (their shapes are not what a layout splits)


def unknown_rank(info):
  """Whether a tensor's rank is unknown (a value a loop gradient or a call leaves unshaped); handles are not."""
  return info.shape is None and info.dtype not in _HANDLES


class Rule:
  """Base class of op rules. Subclasses set `priority` (propagation round it joins, 0 = first)."""

  priority = 1
  name = "rule"
  forward_without_operands = False   # ask `forward` even when no operand has a sharding yet

  data = None   # indices of the inputs that carry data, when they are fixed (None: every input)

  rank_free = False   # True: the rule itself handles tensors of unknown rank (parameters, control flow, lists)

  stacked = None   # the one-graph form of every op of the rule (STACKED_FORMS), or None: it runs once per device
  # The inputs the output is a linear function of, jointly with the others fixed ("all", or a tuple of indices), or
  # None: a sum pending over mesh axes in them may pass to the output unreduced (rewriter/partition/sums.py, a
  # loop's gradient accumulators, rewriter/graph/loops.py) and a loss's sum over the batch stays one.
  linear = None
  elementwise = False   # every output element depends on the same element of each (broadcast) operand only

  def stacked_form(self, op_type):  # pylint: disable=unused-argument
    """The one-graph form of `op_type` (one of STACKED_FORMS), or None where the op runs once per device."""
    return self.stacked

  def linear_in(self, op_type):  # pylint: disable=unused-argument
    """`linear` for `op_type` (a rule of several op types may state it per type)."""
    return self.linear

  def unknown_rank(self, node):
    """The first input or output of the node whose rank is unknown ("input 0 (name)"), or None. Unless the rule is
    `rank_free`, completion does not ask it about such a node (its tensors keep what the rest of the graph gives
    them) and the partitioner runs the node replicated, with a warning: a value of unknown rank is whole on every
    device, and the op's known-rank operands are gathered to meet it."""
    if self.rank_free:
      return None
    free_in, free_out = self.rank_free_ports(node)
    for i, r in enumerate(node.inputs):
      if i not in free_in and unknown_rank(node.input_info(i)):
        return f"input {i} ({r})"
    for o, info in enumerate(node.outputs):
      if o not in free_out and unknown_rank(info):
        return f"output {o} ({node.ref(o)})"
    return None

  def rank_free_ports(self, node):  # pylint: disable=unused-argument
    """(input indices, output indices) the rule handles at unknown rank itself (e.g. a kernel's reserve space)."""
    return (), ()

  def data_inputs(self, node):
    """Indices of the inputs that carry data to be partitioned (others are read whole, e.g. axis constants):
    `data`, or every input. A rule whose data inputs depend on the node overrides this."""
    return list(range(len(node.inputs))) if self.data is None else list(self.data)

  def forward(self, ctx, node, operands):  # pylint: disable=unused-argument
    """One list of candidate shardings per output."""
    return [[] for _ in node.outputs]

  def backward(self, ctx, node, outputs, operands):  # pylint: disable=unused-argument
    """One list of candidate shardings per input."""
    return [[] for _ in node.inputs]

  def strategies(self, node, mesh):  # pylint: disable=unused-argument
    """The op's candidate splits: a list of {factor label: mesh axes}, one per assignment of the mesh's axes to
    the op's factors that the rule can partition, or None when the rule is not described by factors (then only
    `forward` and `backward` say how layouts pass through it). `FactorRule` enumerates them; automatic sharding
    prices each one and `partition` is handed the chosen one."""
    return None

  def partition(self, ctx, node):
    raise NotImplementedError


def register(*op_types):
  """Class decorator: registers one instance of the rule under each TF op type. Registering twice fails."""

  def deco(cls):
    rule = cls()
    rule.name = cls.__name__
    for t in op_types:
      if t in _RULES:
        raise ValueError(f"op type {t!r} already has the rule {_RULES[t].name}; cannot also register {cls.__name__}")
      _RULES[t] = rule
    return cls

  return deco


def lookup(op_type):
  """The rule for `op_type`, or None when the op has no rule (the caller then uses the fallback)."""
  return _RULES.get(op_type)


def stacked_form(op_type):
  """The one-graph form of `op_type` its rule states (one of STACKED_FORMS), or None (no rule, or it runs once per
  device)."""
  rule = _RULES.get(op_type)
  return rule.stacked_form(op_type) if rule is not None else None


def linear_inputs(op_type, n_inputs):
  """The indices of the inputs of an `op_type` op with `n_inputs` inputs its output is a linear function of (jointly,
  the others fixed; `Rule.linear`), or None."""
  rule = _RULES.get(op_type)
  which = rule.linear_in(op_type) if rule is not None else None
  if which is None:
    return None
  return tuple(range(n_inputs)) if which == "all" else tuple(i for i in which if i < n_inputs)


def is_elementwise(op_type):
  """Whether `op_type`'s rule states it element-wise (`Rule.elementwise`)."""
  rule = _RULES.get(op_type)
  return rule is not None and rule.elementwise


def registered_ops():
  return sorted(_RULES)
