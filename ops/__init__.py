"""Per-op sharding rules, one module per op family, registered in `registry`."""

from tf_gspmd.ops import basic  # noqa: F401
from tf_gspmd.ops import concat  # noqa: F401
from tf_gspmd.ops import control_flow  # noqa: F401
from tf_gspmd.ops import einsum  # noqa: F401
from tf_gspmd.ops import elementwise  # noqa: F401
from tf_gspmd.ops import gather  # noqa: F401
from tf_gspmd.ops import generators  # noqa: F401
from tf_gspmd.ops import matmul  # noqa: F401
from tf_gspmd.ops import nn  # noqa: F401
from tf_gspmd.ops import random  # noqa: F401
from tf_gspmd.ops import reduction  # noqa: F401
from tf_gspmd.ops import scatter  # noqa: F401
from tf_gspmd.ops import shape_ops  # noqa: F401
from tf_gspmd.ops import slicing  # noqa: F401
from tf_gspmd.ops import softmax  # noqa: F401
from tf_gspmd.ops import tensor_list  # noqa: F401
from tf_gspmd.ops import variables  # noqa: F401
from tf_gspmd.ops.fallback import FALLBACK  # noqa: F401
from tf_gspmd.ops.registry import lookup, register, registered_ops, Rule  # noqa: F401
