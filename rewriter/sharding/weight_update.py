"""The weight-update sharding pass (the GSPMD paper's optimizer-state sharding for data parallelism).

Data parallelism replicates the weights over the data axis, and with them the optimizer state and the
update arithmetic. With `weight_update_sharding` on, this pass also splits over the data axis:

  * every *update-state* variable (a variable read only to compute variable updates: optimizer slots,
    step counters) is stored split over the data axis: its memory is divided by the axis size;
  * the new value of every *weight* (a variable also read by the rest of the program) is computed split
    over the data axis before it is written back.

Completion is then run again with these layouts pinned: the gradients, partial sums over the data axis,
arrive through a reduce-scatter instead of an all-reduce, the update runs on 1/N of each tensor, and the
weights are all-gathered when written — the same bytes on the wire as the all-reduce it replaces.

The role of every variable is recorded whether or not the option is on (the report shows state bytes).
"""

from tf_gspmd._layout.sharding import Sharding
from tf_gspmd.rewriter.sharding import completion
from tf_gspmd.rewriter.graph.graph_view import ref, split_ref

READS = ("ReadVariableOp", "VariableShape")
# Writes whose value input is the variable's new value (or its delta), and that input's index.
WRITES = {"AssignVariableOp": 1, "AssignAddVariableOp": 1, "AssignSubVariableOp": 1}


def _update_only(ir):
  """Names of nodes whose every result flows only into variable writes (never into a function output)."""
  outputs = {ref_name for ref_name in ir.outputs}
  only = set()
  for node in reversed(ir.nodes):
    if node.op in WRITES:
      only.add(node.name)
      continue
    if not node.outputs or any(node.ref(o) in outputs for o in range(len(node.outputs))):
      continue
    users = [c for o in range(len(node.outputs)) for c, _ in ir.consumers.get(node.ref(o), ())]
    if users and all(c.name in only for c in users):
      only.add(node.name)
  return only


def classify(program):
  """(update-state handles, weight handles): the written variables, by how the program reads them."""
  ir = program.ir
  only = _update_only(ir)
  state, weights = [], []
  for name in program.variable_names:
    users = [c for c, _ in ir.consumers.get(ref(name), ())]
    if not any(c.op in WRITES or c.op.startswith("ResourceApply") for c in users):
      continue
    reads = [c for c in users if c.op in READS]
    if all(c.name in only for c in reads) and not any(c.op.startswith("ResourceApply") for c in users):
      state.append(name)
    else:
      weights.append(name)
  return tuple(state), tuple(weights)


def _with_axis(sharding, shape, axis, size):
  """`sharding` with mesh axis `axis` added to the dim that splits most evenly, or None."""
  if sharding.is_maximal or axis in sharding.used_axes or not shape:
    return None
  best = None
  for d, n in enumerate(shape):
    tiles = sharding.tiles(d) * size
    if n < tiles:
      continue
    key = (n % tiles == 0, n // tiles)
    if best is None or key > best[0]:
      best = (key, d)
  if best is None:
    return None
  d = best[1]
  dims = list(sharding.dims)
  dims[d] = dims[d] + (axis,)
  return Sharding(sharding.mesh, tuple(dims))


def run(program):
  state, weights = classify(program)
  program = program.replace(update_state=state)
  axis = program.options.weight_update_sharding
  if not axis:
    return program
  mesh = program.mesh
  if axis is True:
    axis = "data" if "data" in mesh.axis_names else mesh.axis_names[0]
  size = mesh.axis_size(axis)
  ir = program.ir
  only = _update_only(ir)
  # Everything the forward computation and the function's results use keeps its layout; the update region
  # starts from its current layout and may only be refined.
  pins, seed = {}, {}
  for r, s in program.shardings.items():
    (seed if split_ref(r)[0] in only else pins)[r] = s
  pins.update(program.annotations)
  for name in state:
    info = ir.info(ref(name))
    split = _with_axis(program.shardings[ref(name)], info.value_shape, axis, size)
    if split is not None and ref(name) not in program.annotations:   # a user's or the stored layout stays
      pins[ref(name)] = split
      seed.pop(ref(name), None)
  for name in weights:
    info = ir.info(ref(name))
    split = _with_axis(program.shardings[ref(name)], info.value_shape, axis, size)
    if split is None:
      continue
    for user, _ in ir.consumers.get(ref(name), ()):
      value = user.inputs[WRITES[user.op]] if user.op in WRITES else None
      if value is not None and value not in program.annotations:
        pins[value] = split
        seed.pop(value, None)
  return completion.run(program.replace(annotations=pins), seed=seed)
