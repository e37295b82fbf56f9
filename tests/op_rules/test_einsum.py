"""Einsum as a factor rule: parsing, completion and partitioned results."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
import tf_gspmd as gs
from tf_gspmd import P
from tf_gspmd.ops.einsum import parse_equation

MESH = gs.Mesh((2, 4), ("data", "model"))


def test_parse_equation():
  assert parse_equation("bsd,df->bsf", [3, 2]) == ((tuple("bsd"), tuple("df")), tuple("bsf"))
  assert parse_equation("...d,df->...f", [3, 2]) == ((("_e0", "_e1", "d"), ("d", "f")), ("_e0", "_e1", "f"))
  assert parse_equation("ij,jk", [2, 2]) == ((tuple("ij"), tuple("jk")), tuple("ik"))


@pytest.mark.parametrize("eq,shapes,specs", [
    ("bsd,df->bsf", [(4, 6, 8), (8, 12)], (P("data", None, "model"), P("model", None))),
    ("bqhd,bkhd->bhqk", [(4, 6, 4, 8), (4, 6, 4, 8)], (P("data", None, "model", None), P("data", None, "model", None))),
    ("gsm,gsec->egcm", [(8, 4, 6), (8, 4, 8, 2)], (P(("data", "model"), None, None), P(("data", "model")))),
    ("ij,jk->ik", [(8, 13), (13, 4)], (P(None, "model"), P("model", None))),
], ids=lambda v: v if isinstance(v, str) else "")
def test_einsum_matches(rng, eq, shapes, specs):
  args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
  f = gs.function(lambda *a: tf.einsum(eq, *a), mesh=MESH, in_shardings=specs)
  assert_close(f(*args).numpy(), tf.einsum(eq, *args), rtol=1e-4, atol=1e-4)


def test_einsum_completion():
  f = gs.function(lambda x, w: tf.identity(tf.einsum("bsd,df->bsf", x, w), name="y"), mesh=MESH,
                  in_shardings=(P("data", None, None), P(None, "model")))
  low = f.lower(tf.TensorSpec([4, 6, 8]), tf.TensorSpec([8, 12]))
  assert low.shardings["y"].spec == P("data", None, "model")
  assert low.report.collectives == []
