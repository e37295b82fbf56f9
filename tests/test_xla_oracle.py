"""XLA's own SPMD partitioner as the oracle (tools/xla_oracle.py): the same annotated programs, partitioned by XLA
on 8 host CPUs (the oracle's virtualenv, `make oracle-venv`) and by tf_gspmd on 8 logical CPUs.

Each case: XLA's partitioned results equal the unpartitioned program's, and tf_gspmd's bytes per device are at most
XLA's -- or the documented known difference (tools/oracle_programs.py KNOWN_DIFFERENCES), asserted exactly. Outside
`make test` (which creates the virtualenv and sets TF_GSPMD_REQUIRE_ORACLE) the cases skip when it is missing.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import oracle_programs  # noqa: E402  pylint: disable=g-import-not-at-top
import xla_oracle  # noqa: E402  pylint: disable=g-import-not-at-top

CASES = ("mlp_megatron", "moe_gshard", "conv_spatial", "uneven", "softmax_xent", "pipeline", "conv_halo", "pool_halo",
         "pad_shift", "pad_conv", "unet3d_block", "top_k_split", "scan_stacked", "argmax_split", "megatron_dropout",
         "einsum_two_contracted", "bert_tied_mlm", "moe_loss", "unet_loss")


@pytest.fixture(scope="module")
def comparisons():
  try:
    xla_oracle.oracle_python()
  except xla_oracle.OracleUnavailable as e:
    if os.environ.get("TF_GSPMD_REQUIRE_ORACLE"):
      raise
    pytest.skip(str(e))
  found = xla_oracle.compare_all([oracle_programs.PROGRAMS[name]() for name in CASES])
  return {c.name: c for c in found}


@pytest.mark.parametrize("name", [c for c in CASES if c not in oracle_programs.KNOWN_DIFFERENCES])
def test_xla_agrees_and_tf_gspmd_sends_no_more(comparisons, name):
  c = comparisons[name]
  assert c.failure is None, str(c)
  assert c.xla_ok and c.ours_ok, str(c)
  assert c.ours_bytes <= c.xla_bytes, str(c)


def test_reference_figures(comparisons):
  """XLA's figures for the reference workloads (shared/benchmarks/workloads.md), as the oracle reads them."""
  assert comparisons["mlp_megatron"].xla_counts() == {"all-reduce": 1}
  assert comparisons["mlp_megatron"].xla_bytes == 131072
  assert comparisons["moe_gshard"].xla_counts() == {"all-to-all": 2}
  assert comparisons["conv_spatial"].xla_counts() == {"collective-permute": 4}
  assert comparisons["conv_spatial"].xla_bytes == 393216
  assert comparisons["uneven"].xla_bytes == 532


def test_pad_then_slice_is_xla_s_one_collective_permute(comparisons):
  """The pad-by-7 shift: XLA and tf_gspmd each send the 7 rows before a device's own once (28,672 B)."""
  c = comparisons["pad_shift"]
  assert c.xla_counts() == {"collective-permute": 1} and c.xla_bytes == 28672, str(c)
  assert c.ours.counts() == {"collective-permute": 1} and c.ours_bytes == 28672, str(c)


def test_pipeline_loops_count_per_iteration(comparisons):
  """The pipeline's loops run 11 times (M + S - 1): XLA's collectives inside them count 11 times, as tf_gspmd's."""
  c = comparisons["pipeline"]
  assert not c.unknown_loops
  assert {x["times"] for x in c.xla_collectives} == {1, 11}
  assert {x.times for x in c.ours.collectives} == {1, 11}


def test_rows_and_columns_split_exchange_halos_along_both_dims(comparisons):
  """Rows and columns both split: tf_gspmd exchanges halos along both dims (the second exchange carries the
  first's, corners included) and all-reduces the kernel gradients, as XLA does, in fewer bytes."""
  c = comparisons["conv_halo"]
  assert c.xla_ok and c.ours_ok, str(c)
  assert set(c.ours.counts()) == {"collective-permute", "all-reduce"} and c.ours_bytes <= c.xla_bytes, str(c)
  assert c.xla_counts() == {"collective-permute": 20, "all-reduce": 2} and c.xla_bytes == 40960


def test_known_difference_pool_halo(comparisons):
  """XLA's MaxPoolGrad partition is wrong (the input gradient); its pooled output, and all of tf_gspmd's, right."""
  c = comparisons["pool_halo"]
  assert c.ours_ok, str(c)
  assert c.xla_errors[0] <= 1.0 < c.xla_errors[1], str(c)
  assert c.ours_bytes <= c.xla_bytes, str(c)


def test_known_difference_dropout(comparisons):
  """XLA's partition of a dropout mask's random bits differs from its own unpartitioned program; tf_gspmd's
  partition equals TF's, bit for bit per shard, in no more bytes."""
  c = comparisons["megatron_dropout"]
  assert c.ours_ok and not c.xla_ok, str(c)
  assert c.ours_bytes <= c.xla_bytes, str(c)
