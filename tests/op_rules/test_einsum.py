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
  assert low.report.collectives == ()


MESH8 = gs.Mesh((8,), ("x",))


@pytest.mark.parametrize("mesh,eq,shapes,specs", [
    (MESH8, "ii->i", [(8, 8)], (P("x", None),)),
    (MESH8, "ii->i", [(8, 8)], (P(None, "x"),)),
    (MESH8, "ii->", [(8, 8)], (P("x", None),)),
    (MESH8, "ii->", [(13, 13)], (P(None, "x"),)),          # uneven: the padding rows are masked
    (MESH8, "ii->i", [(13, 13)], (P("x", None),)),
    (MESH8, "bii->bi", [(2, 8, 8)], (P(None, None, "x"),)),
    (MESH8, "i->ii", [(8,)], (P("x"),)),                   # a diagonal built from a vector (einsum's gradient)
    (MESH, "ii->i", [(8, 8)], (P("data", "model"),)),
    (MESH, "ii->", [(12, 12)], (P(("data", "model"), None),)),
    (MESH, "bii->bi", [(4, 8, 8)], (P("data", None, "model"),)),
    (MESH, "bii->b", [(4, 6, 6)], (P("data", "model", None),)),
    (MESH, "ii,ij->j", [(8, 8), (8, 12)], (P("model", None), P(None, "data"))),
    (MESH, "iji->j", [(4, 6, 4)], (P("data", "model", None),)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_repeated_labels_take_diagonal_blocks(rng, mesh, eq, shapes, specs):
  """A label repeated in an operand reads only where its dims agree: split on one of them, each device slices
  its diagonal block of the others locally."""
  args = [rng.standard_normal(s).astype(np.float32) for s in shapes]

  def f(*a):
    return tf.raw_ops.Einsum(inputs=list(a), equation=eq)   # tf.einsum rejects "i->ii"; its gradient emits it

  got = gs.function(f, mesh=mesh, in_shardings=specs)(*args)
  assert_close(got.numpy(), f(*[tf.constant(a) for a in args]), rtol=1e-5, atol=1e-5)


def test_diagonal_of_a_split_matrix_moves_no_data(rng):
  x = rng.standard_normal((8, 8)).astype(np.float32)
  for spec in (P("x", None), P(None, "x")):
    f = gs.function(lambda a: tf.identity(tf.einsum("ii->i", a), name="d"), mesh=MESH8, in_shardings=spec)
    low = f.lower(tf.TensorSpec([8, 8]))
    assert low.report.collectives == () and low.shardings["d"].spec == P("x")
    assert_close(f(x).numpy(), np.diag(x), rtol=0, atol=0)


def test_gradient_of_a_diagonal(rng):
  x = rng.standard_normal((2, 8, 8)).astype(np.float32)

  def f(a):
    with tf.GradientTape() as tape:
      tape.watch(a)
      y = tf.reduce_sum(tf.einsum("bii->bi", a) ** 2)
    return y, tape.gradient(y, a)

  got = gs.function(f, mesh=MESH8, in_shardings=P(None, "x", None))(x)
  for g, w in zip(got, f(tf.constant(x))):
    assert_close(g.numpy(), w, rtol=1e-5, atol=1e-5)
