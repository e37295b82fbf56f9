"""Runs a program of this directory with every gs.function left at exchange="auto" exchanging through TF's
collective ops on every device: the tests' --exchange=collectives option, for the processes they launch.

  python with_collectives.py PROGRAM [ARGS...]
"""

import os
import runpy
import sys


def force_collectives(gs):
  """Makes exchange='auto' mean 'collectives' for every gs.function built from now on (Keras's included)."""
  import functools  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top
  init = gs.ShardedFunction.__init__
  signature = inspect.signature(init)

  @functools.wraps(init)
  def collectives_init(self, *args, **kwargs):
    bound = signature.bind(self, *args, **kwargs)
    if bound.arguments.get("exchange", "auto") == "auto":
      bound.arguments["exchange"] = "collectives"
    return init(*bound.args, **bound.kwargs)

  gs.ShardedFunction.__init__ = collectives_init


if __name__ == "__main__":
  import tf_gspmd  # pylint: disable=g-import-not-at-top
  force_collectives(tf_gspmd)
  program = os.path.abspath(sys.argv[1])
  sys.argv = sys.argv[1:]
  sys.path.insert(0, os.path.dirname(program))
  runpy.run_path(program, run_name="__main__")
