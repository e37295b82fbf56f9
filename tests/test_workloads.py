"""The ten reference workloads: the partitioned program sends no more bytes per device than XLA's own choice.

Planned here (no run); the bytes are the ones the per-device program's collective ops send, checked against its
collective nodes. bench/workloads.py runs them and checks results against the unpartitioned program, and the
per-family tests run smaller versions of the same patterns.
"""

import os
import sys

import pytest
import tensorflow as tf

from conftest import assert_report_counts_program
import tf_gspmd as gs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import workloads  # noqa: E402  pylint: disable=g-import-not-at-top

CASES = list(workloads.workloads())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bytes_per_device_at_most_xla(case):
  name, fn, mesh, ins, outs, args, xla = case
  low = gs.function(fn, mesh=mesh, in_shardings=ins, out_shardings=outs).lower(
      *[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])
  assert low.report.fallbacks == ()
  assert_report_counts_program(low)
  assert low.report.bytes_per_device() <= xla, f"{name}: {low.report}"
  assert not any(c.kind == "all-gather" and c.bytes > 1 << 20 for c in low.report.collectives), str(low.report)
