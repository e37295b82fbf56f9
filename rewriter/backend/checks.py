"""Pass: in a per-device program with collectives, a failed check is raised after every device has finished.

A check that fails (tf.debugging.check_numerics, tf.debugging.Assert and the asserts built on it) stops the
program of its device while the other devices wait for it in their collectives. TF's runtime then cancels those
collectives, and one cancelled at the wrong moment (while the cancellation runs, before TF counts the step as
cancelled) aborts every collective of the process for good: the next step fails on good input ("Restart your
program to reset"). So no check fails inside such a program:

  * each check op becomes a call that records its verdict in a scalar int32 resource of its device, the
    maximum over the step (a check in a loop body runs once per iteration): 0 passed; a numerics check's bits
    (`_FOUND`: 1 NaN, 2 Inf, or +Inf and 4 -Inf for CheckNumericsV2); a failed assert 1. The values an assert
    would print are not kept;
  * where the program writes variables, or its mesh spans processes, the devices then all-reduce whether any
    check failed anywhere (4 bytes), and the program writes its variables only when none did (TF runs no write
    after a failed check): an assign writes the value it holds already, an assign-add or -sub adds zero;
  * the program returns [each check's verdict..., whether one failed (on any device, where they agree)] as one
    more result (VERDICT); the runtime reads it (the first device's where the devices agree, else every local
    device's) and raises the check's InvalidArgumentError, as TF would have (tf_gspmd/runtime/checks.py).

A program whose writes cannot all wait for the verdict (a write op other than an assign, a write inside a function
body or an XLA segment, a write that a check depends on) keeps its checks as they are.
"""

import itertools

import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd.rewriter.collectives import ordering, vocabulary
from tf_gspmd.rewriter.collectives.builders import Backend
from tf_gspmd.rewriter.collectives.combine import table_lookup
from tf_gspmd.rewriter.frontend.trace import FAILING_CHECK_OPS
from tf_gspmd.rewriter.graph import graph_view
from tf_gspmd.rewriter.graph.graph_view import ref
from tf_gspmd.rewriter.partition.partition import READ_ONLY_VARIABLE_OPS
from tf_gspmd.rewriter.program import Check
from tf_gspmd.rewriter.report import ReportBuilder

VERDICT = "gspmd/checks/verdict"   # the per-device program's extra result
# The writes that can wait for the verdict: what each writes when a check failed ("same": the variable's own value).
_HELD = {"AssignVariableOp": "same", "AssignAddVariableOp": "zero", "AssignSubVariableOp": "zero"}
_programs = itertools.count()
# A numerics check's verdict: the sum of the bits of what its tensor holds, named in the order TF's message names
# them (the runtime reads the names from each Check).
_FOUND = {"CheckNumerics": ((2, "Inf"), (1, "NaN")), "CheckNumericsV2": ((4, "-Inf"), (2, "+Inf"), (1, "NaN"))}
_MASKS = {"NaN": tf.math.is_nan, "Inf": tf.math.is_inf, "+Inf": lambda x: tf.math.is_inf(x) & (x > 0),
          "-Inf": lambda x: tf.math.is_inf(x) & (x < 0)}


def _scopes(gd):
  """(FunctionDef or None for the graph itself, its nodes) of graph `gd` and of each of its library's functions."""
  return [(None, gd.node)] + [(f, f.node_def) for f in gd.library.function]


def run(program):
  """Pass: the checks of a per-device program with collectives recorded and raised after the step (see above)."""
  gd = program.local_graph_def
  if not ordering.holds_collectives(gd):
    return program
  if not any(n.op in FAILING_CHECK_OPS for _, nodes in _scopes(gd) for n in nodes):
    return program
  writes = [n for n in gd.node if _writes(n)]
  if any(_writes(n) for f in gd.library.function for n in f.node_def) or any(n.op not in _HELD for n in writes):
    return program
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(gd)
  serial = next(_programs)
  checks, helpers = [], []
  for fdef, nodes in _scopes(out):
    consts = {n.name: n for n in nodes if n.op == "Const"}
    for nd in nodes:
      if nd.op in FAILING_CHECK_OPS:
        check = Check(node=_where(fdef, nd), op=nd.op, message=_message(nd, consts),
                      resource=f"tf_gspmd_check_{serial}_{len(checks)}", found=_FOUND.get(nd.op, ()))
        helpers.append(_record_call(nd, check))
        checks.append(check)
  for h in helpers:
    out.library.function.add().CopyFrom(h)
  resources = {c.resource for c in checks}
  holding = graph_view.functions_holding({f.signature.name: f for f in out.library.function}, lambda n: (
      n.op == "VarHandleOp" and n.attr["shared_name"].s.decode() in resources))   # (a check's record)
  held = {n.name for n in out.node if set(graph_view.function_names(n)) & holding}
  if {n.name for n in graph_view.prune(out, sorted(held)).node} & {w.name for w in writes}:
    return program   # a check reads what a write wrote: the write cannot wait for it
  # The devices agree on the verdict where writes wait for it, or where other processes run devices of the mesh
  # (each must raise); else this process reads every device's own.
  agreed = bool(writes) or len(set(program.processes or (0,))) > 1
  gd, records = _verdict(program, out, checks, held, writes, agreed)
  return program.replace(local_graph_def=gd, deferred_checks=tuple(checks), verdict_agreed=agreed,
                         report=program.report.with_collectives_added(records))


def _writes(nd):
  """Whether NodeDef `nd` writes a resource (a stateful op that takes one, not a read, not a collective: those take
  ordering tokens)."""
  op_def = _compat.op_def(nd.op)
  if op_def is None or nd.op in READ_ONLY_VARIABLE_OPS or nd.op in vocabulary.TF_COLLECTIVE_OPS or (
      not op_def.is_stateful):
    return False
  return any(a.type == tf.resource.as_datatype_enum for a in op_def.input_arg)


def _where(fdef, nd):
  return nd.name if fdef is None else f"{nd.name} (in function {fdef.signature.name})"


def _message(nd, consts):
  """What the check says when it fails: a numerics check its message; an assert its string constants, in order."""
  if nd.op != "Assert":
    return nd.attr["message"].s.decode()
  parts = []
  for inp in nd.input[1:]:
    if inp.startswith("^"):
      continue
    src = consts.get(inp.split(":")[0])
    if src is not None and src.attr["dtype"].type == tf.string.as_datatype_enum:
      values = tf.make_ndarray(src.attr["value"].tensor).reshape(-1)
      parts.extend(f"[{v.decode()}]" for v in values)
    else:
      parts.append("[...]")
  return "assertion failed: " + " ".join(parts)


def _record_call(nd, check):
  """Turns check NodeDef `nd` into a call of a new function that records its verdict in `check.resource` (a
  numerics check passes its tensor through, as CheckNumerics does); returns that function's FunctionDef."""
  resource = check.resource

  def keep(bad):
    h = tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], shared_name=resource, container="")
    was = tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.int32)
    tf.raw_ops.AssignVariableOp(resource=h, value=tf.maximum(was, bad))

  controls = [i for i in nd.input if i.startswith("^")]
  if nd.op == "Assert":
    @tf.function(autograph=False)
    def record(condition):
      keep(1 - tf.cast(tf.reduce_all(condition), tf.int32))
    dtype, operand, outputs = tf.bool, nd.input[0], []
  else:
    dtype = tf.as_dtype(nd.attr["T"].type)

    @tf.function(autograph=False)
    def record(x):  # pylint: disable=function-redefined
      keep(tf.add_n([bit * tf.cast(tf.reduce_any(_MASKS[name](x)), tf.int32) for bit, name in check.found]))
      return tf.identity(x)
    operand, outputs = nd.input[0], [dtype.as_datatype_enum]
  fdef = record.get_concrete_function(tf.TensorSpec(None, dtype)).function_def
  name = f"{nd.name.replace('/', '_')}_record_{resource}"
  fdef.signature.name = name
  nd.op = "StatefulPartitionedCall"
  nd.attr.clear()
  del nd.input[:]
  nd.input.extend([operand] + controls)
  nd.attr["f"].func.name = name
  nd.attr["Tin"].list.type.append(dtype.as_datatype_enum)
  nd.attr["Tout"].list.type.extend(outputs)
  for key in ("config", "config_proto", "executor_type"):
    nd.attr[key].s = b""
  return fdef


def _verdict(program, gd, checks, held, writes, agreed):
  """(`gd` with the verdict result and the writes waiting for it, the records of the collective it adds: with
  `agreed`, the devices agree on whether a check failed anywhere)."""
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(gd, name="")
    pid = graph.get_tensor_by_name(ref(program.partition_id))
    report = ReportBuilder()
    backend = Backend(program.mesh, program.devices, pid, table_lookup(graph, pid), report, program.processes)
    with tf.name_scope("gspmd/checks/"):
      with tf.control_dependencies([graph.get_operation_by_name(n) for n in sorted(held)]):
        codes = tf.stack([tf.raw_ops.ReadVariableOp(
            resource=tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], shared_name=c.resource, container=""),
            dtype=tf.int32) for c in checks])
      failed = tf.cast(tf.reduce_max(codes, keepdims=True) > 0, tf.float32)
      if agreed:
        failed = backend.all_reduce(failed, tuple(program.mesh.axis_names), "Max", VERDICT,
                                    "whether a check failed on any device")
      tf.concat([codes, tf.cast(failed, tf.int32)], 0, name="verdict")
      passed = tf.equal(failed[0], 0.0)
      gated = {}
      for w in writes:
        op = graph.get_operation_by_name(w.name)
        handle, value = op.inputs[0], op.inputs[1]
        kept = (tf.raw_ops.ReadVariableOp(resource=handle, dtype=value.dtype) if _HELD[w.op] == "same"
                else tf.zeros_like(value))
        gated[w.name] = tf.where(passed, value, kept).name
  out = graph.as_graph_def()
  for nd in out.node:
    if nd.name in gated:
      nd.input[1] = gated[nd.name]
  return out, report.collectives
