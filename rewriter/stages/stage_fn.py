"""A planned stage as a callable: its ops cut out of the traced forward program at its boundary tensors.

`stage_function(plan, k)` builds, from the program the plan was made of, the graph of stage k's layers
(`layers.subprogram`: its ops, the constants they read, a Placeholder per tensor entering from an earlier stage
and the program arguments it reads) and wraps it as a function

    fn(arguments, activations) -> activations

where `arguments` maps the names the plan lists (`Stage.parameters`, and the program's data arguments among
`Stage.inputs`) to tensors, `activations` maps the tensors entering it from earlier stages (the other names of
`Stage.inputs`) to tensors, and the result maps `Stage.outputs`' names (what later stages read and what the
program returns) to tensors. Run stage by stage, feeding each the union of what earlier stages returned, the
stages compute what the whole forward computes. Captured variables the stage reads are read from their
tf.Variables.
"""

import tensorflow as tf

from tf_gspmd.errors import InputError
from tf_gspmd.rewriter.stages import layers as clustering
from tf_gspmd.rewriter.graph.graph_view import split_ref


def stage_function(plan, k):
  """Stage k of `plan` (a StagePlan) as a callable (see the module docstring)."""
  program = plan.program
  if program is None:
    raise InputError("this StagePlan does not keep its program; plan it with gs.plan_stages", node=f"stage {k}")
  n = len(plan.stages)
  if not hasattr(k, "__index__") or not -n <= k.__index__() < n:
    raise InputError(f"stage_function(k={k!r}): the plan has {n} stage(s); give k in 0..{n - 1} (plan.stages lists "
                     "them)", node="k")
  stage = plan.stages[k]
  first, last = stage.layers
  sub, renamed = clustering.subprogram(program, plan.layers, first, last, program.mesh, program.options)
  names = plan.names or {}
  ir = program.ir
  variables = dict(zip(program.variable_names, program.variables))
  placeholders, keys, specs, handles = [], [], [], {}
  for name in sub.input_names + sub.variable_names:
    if name in variables:
      handles[name] = variables[name]
      continue
    entering = [r for r, p in renamed.items() if p == name]
    if entering:
      keys.append(("activation", entering[0]))
      info = ir.info(entering[0])
    else:
      keys.append(("argument", names.get(name, name)))
      info = ir.info(f"{name}:0")
    placeholders.append(name)
    specs.append(tf.TensorSpec(info.shape, info.dtype))
  outputs = list(sub.output_refs)
  graph_def = sub.graph_def

  def body(*tensors):
    input_map = {f"{p}:0": t for p, t in zip(placeholders, tensors)}
    for name, v in handles.items():
      input_map[f"{name}:0"] = v.handle
    return tf.graph_util.import_graph_def(graph_def, input_map=input_map,
                                          return_elements=[f"{n}:{i}" for n, i in map(split_ref, outputs)],
                                          name="stage")

  wrapped = tf.compat.v1.wrap_function(body, specs)

  def fn(arguments, activations):
    flat = []
    for kind, key in keys:
      source = arguments if kind == "argument" else activations
      if key not in source:
        raise InputError(f"stage {k} needs the {kind} {key!r}; give it in its `{kind}s` mapping",
                         node=f"stage {k}")
      flat.append(source[key])
    return dict(zip(outputs, wrapped(*flat)))

  fn.inputs = tuple(key for _, key in keys)
  fn.outputs = tuple(outputs)
  return fn
