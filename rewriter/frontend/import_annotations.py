"""The import_annotations pass: pinned shardings from the graph and from the function's boundary.

Sources: the `_XlaSharding` attribute (written by gs.mesh_split/shard/replicate and by TF's xla_sharding in
attribute form), the `XlaSharding` op (TF's use_sharding_op form, with its `unspecified_dims`), the layout in
which each argument arrives and the declared in/out shardings. When an argument arrives in a layout other than
the declared one, an annotated Identity is inserted after it, so the reshard happens inside the program at that
boundary.

An annotation may leave dims open (XLA's unspecified dims, `P.UNCONSTRAINED`): `program.open_dims` lists them
per annotated tensor; completion keeps the other dims as annotated and may split only those.
"""

import tensorflow as tf

from tf_gspmd._platform import compat as _compat
from tf_gspmd._layout.annotations import SHARDING_ATTR, SPEC_ATTR, decode_spec
from tf_gspmd._layout.sharding import Sharding, per_value, to_annotation
from tf_gspmd.errors import InputError, SpecError
from tf_gspmd.rewriter.graph.graph_ir import Graph
from tf_gspmd.rewriter.graph.graph_view import public_key, ref, split_ref

BOUNDARY_SUFFIX = "/gspmd_in"


def _read(node_def, mesh):
  """Per-output annotations on a NodeDef: {output index: (Sharding, open dims)}."""
  if SPEC_ATTR in node_def.attr:
    return {0: to_annotation(decode_spec(node_def.attr[SPEC_ATTR].s), mesh, what=node_def.name)}
  raw = None
  if SHARDING_ATTR in node_def.attr:
    raw = node_def.attr[SHARDING_ATTR].s
  elif node_def.op == "XlaSharding" and "sharding" in node_def.attr:
    raw = node_def.attr["sharding"].s
  if raw is None:
    return {}
  proto = _compat.xla_data_pb2().OpSharding()
  proto.ParseFromString(raw)
  if proto.type == _compat.xla_data_pb2().OpSharding.TUPLE:
    return {i: (Sharding.from_proto(p, mesh, what=f"{node_def.name}:{i}"), ())
            for i, p in enumerate(proto.tuple_shardings)}
  open_dims = ()
  if node_def.op == "XlaSharding" and "unspecified_dims" in node_def.attr:
    open_dims = tuple(int(d) for d in node_def.attr["unspecified_dims"].list.i)
  return {0: (Sharding.from_proto(proto, mesh, what=node_def.name), open_dims)}


def run(program):
  mesh = program.mesh
  gd = tf.compat.v1.GraphDef()
  gd.CopyFrom(program.graph_def)
  by_name = {n.name: n for n in gd.node}
  annotations, open_dims = {}, {}
  param = []
  for k, name in enumerate(program.input_names):
    node = by_name[name]
    declared = program.declared_in[k]
    open_k = program.open_in[k] if k < len(program.open_in) else ()
    if declared is None:
      declared, open_k = _read(node, mesh).get(0, (None, ()))
    arriving = program.arriving_in[k]
    if arriving is not None and declared is not None and _refines(arriving, declared, open_k):
      declared, open_k = arriving, ()   # the arriving layout keeps the pinned dims: taken as it is
    arriving = arriving or declared
    if program.fn is not None:   # (a loop body's TensorList parameter carries its elements' layout)
      _check_splittable_argument(k, node, arriving)
    param.append(arriving)
    if arriving is not None and declared is not None and declared != arriving:
      _insert_boundary(gd, name, declared)
      if open_k:
        open_dims[ref(name + BOUNDARY_SUFFIX)] = open_k
    elif open_k:
      open_dims[ref(name)] = open_k
  for node in gd.node:
    if node.name in program.input_names:
      continue
    for i, (s, o) in _read(node, mesh).items():
      annotations[ref(node.name, i)] = s
      if o:
        open_dims[ref(node.name, i)] = o
  outputs = list(program.output_refs)
  for r, (s, o) in zip(outputs, _declared_out(program.declared_out, len(outputs), mesh)):
    if s is not None:
      annotations[r] = s
      open_dims.pop(r, None)
      if o:
        open_dims[r] = o
  for name, s in zip(program.input_names, param):
    if s is not None:
      annotations[ref(name)] = s
  pins = tuple(program.variable_layout(v) if program.variable_layout and v is not None else None
               for v in program.variables)
  for name, s in zip(program.variable_names, pins):
    if s is not None:   # a variable already stored sharded keeps its layout; its reads are resharded if need be
      annotations[ref(name)] = s
      open_dims.pop(ref(name), None)
  ir = Graph(gd, program.input_names, outputs)
  pinned, opened = {}, {}
  for r, s in annotations.items():
    info = ir.info(r)
    if info.sharding_rank is None and info.dtype in (tf.variant, tf.resource) and program.fn is None:
      pinned[r] = s   # a loop body's TensorList or variable parameter it never opens: it just carries it along
      continue
    if info.sharding_rank is None and not s.is_maximal and not s.is_replicated:
      raise SpecError(f"{public_key(r)} is a {info.dtype.name} tensor, which cannot be split ({s}): TF collectives "
                      f"cannot carry {info.dtype.name} values, so it stays whole on every device; annotate it "
                      "replicated or drop the annotation", node=split_ref(r)[0])
    try:
      pinned[r] = s if s.is_maximal or info.sharding_rank is None else s.with_rank(info.sharding_rank, r)
    except SpecError as e:
      raise SpecError(f"annotation on {r} does not fit its shape {list(info.shape)}: {e}",
                      node=split_ref(r)[0]) from None
    o = open_dims.get(r, ())
    if o and not s.is_maximal and info.sharding_rank is not None:
      if min(o) < 0 or max(o) >= info.sharding_rank:
        raise SpecError(f"the annotation of {public_key(r)} leaves dims {list(o)} open, but it has rank "
                        f"{info.sharding_rank}; give dims 0..{info.sharding_rank - 1}", node=split_ref(r)[0])
      opened[r] = tuple(sorted(set(o)))
  return program.replace(graph_def=gd, ir=ir, annotations=pinned, open_dims=opened, variable_pins=pins)


def _refines(arriving, declared, open_dims):
  """Whether `arriving` keeps every pinned dim of `declared` (open dims may be split further)."""
  if not open_dims or arriving.is_maximal or declared.is_maximal:
    return False
  rank = max(arriving.rank, declared.rank)
  a, d = arriving.with_rank(rank), declared.with_rank(rank)
  return all(a.dims[i][:len(d.dims[i])] == d.dims[i] if i in open_dims else a.dims[i] == d.dims[i]
             for i in range(rank))


def _check_splittable_argument(k, node, sharding):
  """A string (or other opaque) argument cannot arrive split: nothing could move its pieces."""
  dtype = tf.as_dtype(node.attr["dtype"].type)
  if dtype not in (tf.string, tf.variant) or sharding is None or sharding.is_maximal or sharding.is_replicated:
    return
  raise InputError(f"argument {k} ({node.name}) is a {dtype.name} tensor laid out as {sharding}, but {dtype.name} "
                   f"tensors cannot be split (TF collectives cannot carry them): pass it replicated (P() or None "
                   "in in_shardings), or convert it to numbers first (e.g. tf.strings.to_hash_bucket_fast)",
                   node=node.name)


def _declared_out(raw, n, mesh):
  """out_shardings resolved against the n flattened outputs: (Sharding, open dims) per output."""
  return tuple(to_annotation(s, mesh, what=f"output {k}") for k, s in
               enumerate(per_value(raw, n, "out_shardings", "the function returns {n} tensors")))


def _insert_boundary(gd, name, sharding):
  """name -> name/gspmd_in (Identity annotated with `sharding`) -> former consumers of name."""
  new = name + BOUNDARY_SUFFIX
  for node in gd.node:
    for k, inp in enumerate(node.input):
      if inp in (name, name + ":0"):
        node.input[k] = new
  ident = gd.node.add()
  ident.name = new
  ident.op = "Identity"
  ident.input.append(name)
  dtype = next(n for n in gd.node if n.name == name).attr["dtype"]
  ident.attr["T"].CopyFrom(dtype)
  ident.attr[SHARDING_ATTR].s = sharding.to_proto().SerializeToString()
