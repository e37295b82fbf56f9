"""Drawing the differential suite's cases: `make_case` draws one program of a family with its argument and
output shardings, `all_cases` the fixed list of cases the suite runs (seeded by index, so the same every run).
"""

import dataclasses

from differential.builder import _Builder
from differential.cases import CASES_PER_MESH, FAMILIES, MESHES, SEED, Case, Draw, _d, st
from differential.families import _FAMILY_FNS
from tf_gspmd import P
from tf_gspmd._layout.sharding import Sharding


# ---- shardings -------------------------------------------------------------------------------------------

def _spec(draw, mesh, shape):
  """A random P for `shape` over `mesh`: each mesh axis splits one dim or none, in a random order within a
  dim (multi-axis entries like P(("x", "y"))); trailing Nones are sometimes left off."""
  rank = len(shape)
  if rank == 0:
    return P()
  owner = [draw(st.sampled_from([None] + list(range(rank)))) for _ in mesh.axis_names]
  entries = []
  for d in range(rank):
    axes = [a for a, o in zip(mesh.axis_names, owner) if o == d]
    if len(axes) > 1:
      axes = draw(st.permutations(axes))
    entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  if draw(st.booleans()):
    while entries and entries[-1] is None:
      entries.pop()
  return P(*entries)


def _splitting_spec(draw, mesh, shape):
  """A spec that splits some dim of size >= 2 (None if `shape` has none)."""
  big = [d for d, n in enumerate(shape) if n >= 2]
  if not big:
    return None
  for _ in range(8):
    spec = _spec(draw, mesh, shape)
    s = Sharding.from_spec(mesh, spec, len(shape))
    if any(s.dims[d] for d in big):
      return spec
  entries = [None] * len(shape)
  entries[_d(draw, big)] = _d(draw, mesh.axis_names)
  return P(*entries)


def make_case(index, mesh_key, family, seed):
  draw = Draw(seed)
  mesh = MESHES[mesh_key]
  b = _Builder(draw)
  b.grad_outputs = None
  _FAMILY_FNS[family](b)
  if b.grad_outputs:
    outputs = b.grad_outputs
  else:
    outputs = [b.cur]
    if draw(st.integers(0, 4)) == 0:   # a second output: any tensor of the program, even an argument
      outputs.append(_d(draw, list(b.vals)[::-1]))
  ret = ", ".join(outputs)
  source = "\n".join([f"def fn({', '.join(f'x{i}' for i in range(len(b.args)))}):"] + b.lines + [
      f"  return ({ret},)"])
  # Arguments mostly sharded, sometimes left to completion (None); 1 case in 20 splits nothing on purpose.
  replicate_all = draw(st.integers(0, 19)) == 0
  in_specs = []
  for i, a in enumerate(b.args):
    if replicate_all:
      in_specs.append(_d(draw, (None, P())))
    elif draw(st.integers(0, 4)) == 0:
      in_specs.append(None)
    else:
      in_specs.append(_spec(draw, mesh, a.shape))
  in_specs = tuple(in_specs)
  case = Case(index, family, mesh_key, source, tuple(b.args), in_specs, None,
              tuple(b.out(n) for n in outputs), int(draw(st.integers(0, 2**16))))
  if not replicate_all and not case.splits:
    float_or_big = [i for i, a in enumerate(b.args) if any(n >= 2 for n in a.shape)]
    if float_or_big:
      i = _d(draw, float_or_big)
      in_specs = in_specs[:i] + (_splitting_spec(draw, mesh, b.args[i].shape),) + in_specs[i + 1:]
  out_specs = None
  if draw(st.booleans()):
    out_specs = tuple(None if draw(st.integers(0, 3)) == 0 else _spec(draw, mesh, o.shape) for o in case.outs)
  return dataclasses.replace(case, in_specs=in_specs, out_specs=out_specs)


def all_cases():
  """CASES_PER_MESH cases on each mesh, families in turn (so each batch mixes them), seeded by index."""
  cases = []
  for m, mesh_key in enumerate(MESHES):
    for k in range(CASES_PER_MESH):
      index = m * CASES_PER_MESH + k
      cases.append(make_case(index, mesh_key, FAMILIES[(k * 7 + m) % len(FAMILIES)], SEED * 100003 + index))
  return cases
