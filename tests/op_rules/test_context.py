"""The rule contract (ops/context.py): rules use only what its Protocols declare, and the rewriter implements all of it."""

import ast
import pathlib

import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.ops import context, registry

OPS = pathlib.Path(context.__file__).resolve().parent


def _members(protocol):
  """The names a Protocol declares (methods, properties and annotated attributes)."""
  names = set(getattr(protocol, "__annotations__", {}))
  for klass in protocol.__mro__:
    if klass.__module__ == context.__name__:
      names |= {n for n in vars(klass) if not n.startswith("_")}
  return names


def _uses(source):
  """[(function name, parameter, member, second-level member or None, line)] for every `ctx.x`, `ctx.x.y` and
  `node.x` in the functions of `source` that take a parameter named ctx or node."""
  out = []
  for fn in ast.walk(ast.parse(source)):
    if not isinstance(fn, (ast.FunctionDef, ast.Lambda)):
      continue
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} & {"ctx", "node"}
    for n in ast.walk(fn):
      if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in params:
        out.append((getattr(fn, "name", "<lambda>"), n.value.id, n.attr, n.lineno))
  return out


def _second_level(source, member):
  """The attributes read off `ctx.<member>` (e.g. the collectives a rule calls on ctx.backend)."""
  return {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute) and
          isinstance(n.value, ast.Attribute) and n.value.attr == member and isinstance(n.value.value, ast.Name) and
          n.value.value.id == "ctx"}


def test_rules_use_only_what_the_protocols_declare():
  completion = _members(context.CompletionContext)
  either = completion | _members(context.PartitionContext)
  node = _members(context.NodeView)
  backend = _members(context.Collectives)
  wrong = []
  for path in sorted(OPS.glob("*.py")):
    if path.name == "context.py":
      continue
    source = path.read_text()
    for fn, param, member, line in _uses(source):
      allowed = node if param == "node" else completion if fn in context.COMPLETION_METHODS else either
      if member not in allowed:
        wrong.append(f"ops/{path.name}:{line} {fn}() uses {param}.{member}")
    wrong += [f"ops/{path.name} uses ctx.backend.{m}" for m in _second_level(source, "backend") - backend]
  assert not wrong, "members ops/context.py does not declare (declare them there, or use a declared one):\n" + \
      "\n".join(wrong)


def test_the_checker_sees_an_undeclared_member():
  source = ("class R:\n  def forward(self, ctx, node, operands):\n    return ctx.operand(0, None), node.graph\n"
            "def helper(ctx):\n  return ctx.backend.broadcast(1), ctx.ir\n")
  uses = {(fn, p, m) for fn, p, m, _ in _uses(source)}
  assert {("forward", "ctx", "operand"), ("forward", "node", "graph"), ("helper", "ctx", "ir")} <= uses
  assert "operand" not in _members(context.CompletionContext) and "graph" not in _members(context.NodeView)
  assert _second_level(source, "backend") == {"broadcast"}


def test_the_rewriter_implements_the_protocols(monkeypatch):
  """The contexts, nodes and backend a real lowering hands to rules have every member the Protocols declare."""
  seen = {}
  rule = registry.lookup("MatMul")

  class Spy(type(rule)):
    def forward(self, ctx, node, operands):
      seen["completion"], seen["node"] = ctx, node
      return super().forward(ctx, node, operands)

    def partition(self, ctx, node):
      seen["partition"] = ctx
      return super().partition(ctx, node)

  monkeypatch.setitem(registry._RULES, "MatMul", Spy())  # pylint: disable=protected-access
  mesh = gs.Mesh((2, 4), ("data", "model"))
  f = gs.function(lambda x, w: x @ w, mesh=mesh, in_shardings=(P("data", None), P(None, "model")))
  f.lower(tf.TensorSpec([8, 16]), tf.TensorSpec([16, 8]))
  assert set(seen) == {"completion", "node", "partition"}
  for what, protocol in ((seen["completion"], context.CompletionContext), (seen["partition"], context.PartitionContext),
                         (seen["node"], context.NodeView), (seen["partition"].backend, context.Collectives),
                         (seen["node"].input_info(0), context.TensorInfo)):
    missing = sorted(m for m in _members(protocol) if not hasattr(what, m))
    assert not missing and isinstance(what, protocol), f"{type(what).__name__} lacks {missing} of {protocol.__name__}"
