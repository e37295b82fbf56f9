"""Differential suite: generated TF programs, partitioned vs. unpartitioned.

A *case* is one small generated program (source text, argument shapes and dtypes, input shardings, sometimes
output shardings, a data seed) drawn from one op family: element-wise ops, matmul, einsum, reductions,
softmax, shape ops, concat/stack/split, slicing, pads, gather, scatter, convolutions, pooling, tf.while_loop,
tf.cond, gradients through tf.GradientTape, int32 and bool programs, and random chains of several of these.
Shapes include primes and sizes below the mesh axis sizes, so most splits are uneven.

Lowering and running a gs.function costs far more than a small case, so BATCH cases run side by side in one
gs.function: independent arguments and results, each case in its own name scope ("c<index>/"), its arguments
in its own layouts. Every case is still checked on its own against its own eager, unpartitioned run:

  * every output's global value, within the case's tolerance (`cases._tolerance`), exactly for int and bool;
  * every per-device component's shape against `sharding.shard_shape(global shape)` and its valid
    (unpadded) block against the matching block of the expected value, so replicas must agree too;
  * the declared input and output shardings are the ones the lowering uses.

A failure names the case with a ready-to-run reproducer (`cases.Case.__repr__`). The suite asserts its own coverage
and prints it (`pytest -s`): the number of cases, the share that split at least one argument, the
collective kinds the partitioner emitted (all five must appear) and the families drawn. Generation is seeded
numpy (a small stand-in for Hypothesis' strategies), so every run checks the same cases.

The per-device programs run with TF's runtime graph optimizer (the meta optimizer) off: the suite checks the
program the partitioner wrote, not Grappler's rewrite of it, and instantiating large per-device functions
on 8 devices is then several times faster. The rewriter's own Grappler pass configures itself and still runs.

The generator and the checks are modules of this directory, imported as the package `differential` (tests/ is
on sys.path: pytest puts tests/conftest.py's directory there, tests/bazel_pytest.py the runfiles' tests/):
cases.py (meshes, sizes, seeded drawing, Arg / Out / Case, tolerances), builder.py (the program builder and
its ops), families.py (one program writer per family), generator.py (`make_case`, `all_cases`) and check.py
(`run_batch`: one batch lowered, run and compared case by case).
"""

import collections
import math
import time

import numpy as np
import pytest
import tensorflow as tf

from differential.cases import BATCH, FAMILIES, KINDS, MESHES
from differential.check import _CASE_OF, _culprit, run_batch
from differential.generator import all_cases
import tf_gspmd as gs
from tf_gspmd import P


@pytest.fixture
def graph_optimizer_off():
  """TF's runtime graph optimizer off while the suite runs (see the module docstring), restored after."""
  before = tf.config.optimizer.get_experimental_options()
  tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
  yield
  tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": before.get("disable_meta_optimizer",
                                                                                       False)})


def test_differential_suite(graph_optimizer_off):  # pylint: disable=redefined-outer-name,unused-argument
  start = time.perf_counter()
  cases = all_cases()
  by_index = {c.index: c for c in cases}
  mismatches, errors = {}, []
  kinds, case_kinds = collections.Counter(), collections.defaultdict(set)
  batches = 0
  for mesh_key in MESHES:
    on_mesh = [c for c in cases if c.mesh_key == mesh_key]
    for i in range(0, len(on_mesh), BATCH):
      batch = on_mesh[i:i + BATCH]
      batches += 1
      try:
        problems, report = run_batch(batch)
      except Exception as e:  # pylint: disable=broad-except
        case, error = _culprit(batch)
        errors.append(f"{case!r}raised {type(error).__name__}: {error}" if case is not None else
                      f"batch of cases {batch[0].index}..{batch[-1].index} raised {type(e).__name__}: {e}")
        continue
      mismatches.update(problems)
      for rec in report.collectives:
        kinds[rec.kind] += 1
        m = _CASE_OF.search(rec.source)
        if m and int(m.group(1)) in by_index:
          case_kinds[int(m.group(1))].add(rec.kind)
  elapsed = time.perf_counter() - start

  n = len(cases)
  split = sum(c.splits for c in cases)
  uneven = sum(any(size % 2 for a in c.args for size in a.shape if size > 1) for c in cases)
  families = collections.Counter(c.family for c in cases)
  dtypes = collections.Counter(a.kind for c in cases for a in c.args)
  with_out = sum(c.out_specs is not None for c in cases)
  dropouts = sum("stateless_dropout" in c.source for c in cases)
  per_kind_cases = collections.Counter(k for ks in case_kinds.values() for k in ks)
  print(f"\ndifferential suite: {n} cases in {batches} lowerings, {elapsed:.1f} s")
  print(f"  split at least one argument: {split} ({100 * split / n:.1f}%); with an odd dim: {uneven}; "
        f"with output shardings: {with_out}; drawing random values: {dropouts}")
  print(f"  argument dtypes: {dict(dtypes)}")
  print(f"  collectives by kind: {dict(kinds)}")
  print(f"  cases emitting each kind: {dict(per_kind_cases)}; cases with any collective: {len(case_kinds)}")
  print(f"  families: {dict(families)}")
  print(f"  mismatches: {len(mismatches)}, errors: {len(errors)}")

  failures = [f"{by_index[i]!r}" + "\n".join(p) for i, p in sorted(mismatches.items())] + errors
  assert not failures, f"{len(failures)} failing case(s):\n" + "\n\n".join(failures[:10])
  assert n >= 2000
  assert dropouts >= 20, f"only {dropouts} cases draw random values"
  assert split / n >= 0.9, f"only {split}/{n} cases split an argument"
  assert set(kinds) == set(KINDS), f"collective kinds emitted: {dict(kinds)}"
  assert set(families) == set(FAMILIES)


# ---------------------------------------------------------------------------------------------------------
# Minimal reproducers of bugs this suite found
# ---------------------------------------------------------------------------------------------------------

def test_squeeze_without_axis_keeps_size_one_shards():
  """Regression: the local Squeeze names its dims, so a dim whose shard has size 1 is not dropped."""
  f = gs.function(lambda x: tf.squeeze(x), mesh=MESHES["8"], in_shardings=P("d"))
  x = np.arange(3, dtype=np.float32).reshape(3, 1)
  np.testing.assert_array_equal(f(x).numpy(), np.squeeze(x))


@pytest.mark.parametrize("fn,shapes", [
    (lambda x: tf.reduce_max(tf.nn.relu(x), axis=-1), [(4, 3)]),            # max/min of a monotonic op
    (lambda a, b: (a + b) + 0.5, [(7, 5), (5,)]),                            # constant push-down
    (lambda x: tf.reshape(tf.tanh(tf.reshape(x, [25])), [5, 5]), [(5, 5)]),  # reshape / unary / reshape
], ids=["max_of_relu", "add_broadcast_then_const", "reshape_unary_reshape"])
def test_grappler_rewrites_do_not_leave_stale_shapes(fn, shapes):
  """Regression: Grappler may reuse a node's name and op for a node of another shape."""
  f = gs.function(fn, mesh=MESHES["2x4"])   # no shardings at all: completion replicates everything
  args = [np.linspace(-1, 1, math.prod(s), dtype=np.float32).reshape(s) for s in shapes]
  np.testing.assert_allclose(f(*args).numpy(), fn(*args), rtol=1e-5, atol=1e-5)
