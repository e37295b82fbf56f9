"""Einsum: the equation is the factor rule (letters absent from the output are reduced).

A letter repeated in an operand ("ii->i", a diagonal) is split on one of its dims; each device slices its
diagonal block of the others locally (see factors._diagonal_blocks). A letter repeated in the output
("i->ii", which builds a diagonal) is whole everywhere: the result is built whole and sliced if wanted split.
"""

from tf_gspmd.ops.factors import Factors, FactorRule
from tf_gspmd.ops.registry import register


def parse_equation(equation, ranks):
  """Operand and output label tuples of an einsum equation; '...' expands to shared batch labels."""
  eq = equation.replace(" ", "")
  lhs, _, out = eq.partition("->")
  terms = lhs.split(",")
  n_ell = max((r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t), default=0)
  ell = tuple(f"_e{i}" for i in range(n_ell))

  def expand(term, rank=None):
    if "..." not in term:
      return tuple(term)
    a, b = term.split("...")
    k = (rank - len(a) - len(b)) if rank is not None else n_ell
    return tuple(a) + ell[n_ell - k:] + tuple(b)

  operands = tuple(expand(t, r) for t, r in zip(terms, ranks))
  if not out and "->" not in eq:  # implicit output: labels that appear once, sorted
    counts = {}
    for t in operands:
      for l in t:
        counts[l] = counts.get(l, 0) + 1
    out_labels = tuple(l for l in ell) + tuple(sorted(l for l, c in counts.items() if c == 1 and l not in ell))
  else:
    out_labels = expand(out)
  return operands, out_labels


@register("Einsum")
class Einsum(FactorRule):
  """Any einsum: shared letters pass their split through; summed letters give partial sums + all-reduce."""

  stacked = "einsum"

  prefer_larger_operand = True

  def factors(self, node):
    eq = node.attr("equation")
    eq = eq.decode() if isinstance(eq, bytes) else eq
    ranks = [len(node.input_shape(i)) for i in range(len(node.inputs))]
    operands, out = parse_equation(eq, ranks)
    # A size-1 broadcast dim carries no factor, nor does a letter the output repeats.
    whole = {l for l in out if out.count(l) > 1}
    fixed = []
    for i, labels in enumerate(operands):
      shape = node.input_shape(i)
      fixed.append(tuple(None if l in whole or (shape[d] == 1 and l in out and
                                                node.outputs[0].shape[out.index(l)] != 1) else l
                         for d, l in enumerate(labels)))
    return Factors(tuple(fixed), (tuple(None if l in whole else l for l in out),))
