"""Eager writes to managed variables since the last step, brought into the shards before the step reads them."""

import tensorflow as tf

from tf_gspmd._platform import compat as _compat


class HostWrites:
  """Brings eager writes since the last step into the shards of a step's variables, in one function call when the
  same variables are written again and again (Keras resets its metric variables before every step).

  Every variable whose tf.Variable was written outside a gs.function (`host_newer`) is copied into its shards
  before the step reads them. A set of written variables seen once is loaded op by op; from its second time on, a
  tf.function built for that set reads each variable and assigns every device's tile in one call. Owned by one
  program (it holds that program's variables, which the program captures anyway).
  """

  def __init__(self):
    self._seen = {}   # ids of a written set -> (its storages, the loading function or None)

  def before_step(self, storages):
    pending = tuple(st for st in storages if st.host_newer)
    if not pending:
      return
    key = tuple(id(st) for st in pending)
    entry = self._seen.get(key)
    if entry is None or any(a is not b for a, b in zip(entry[0], pending)):
      self._seen[key] = (pending, None)   # first time: op by op
      for st in pending:
        st.before_step()
      return
    if entry[1] is None:
      entry = (pending, _loader(pending))
      self._seen[key] = entry
    _compat.call_flat(entry[1], [])
    for st in pending:
      st.host_newer = False


def _loader(storages):
  variables = [st._variable() for st in storages]  # pylint: disable=protected-access

  @tf.function(autograph=False)
  def load():
    for st, v in zip(storages, variables):
      st._load_ops(_compat.read_unhooked(v))  # pylint: disable=protected-access

  return load.get_concrete_function()   # called as is: no signature matching per call
