"""The checks a per-device program decides after the step (rewriter/backend/checks.py): their verdicts, one int32
resource per check on each of this process's devices, set to 0 before the first step and after a failed one; the
step's verdict result read, and a failed check raised as the InvalidArgumentError TF raises for it."""

import tensorflow as tf


class Verdicts:
  """The verdicts of `checks` (rewriter.program.Check) on `devices` (this process's devices of the mesh); `agreed`:
  each device's verdict also says whether a check failed on any device."""

  def __init__(self, checks, devices, agreed):
    self.checks, self.devices, self.agreed = tuple(checks), tuple(devices), agreed
    self._set = False

  def _reset(self):
    for device in self.devices:
      with tf.device(device):
        for c in self.checks:
          handle = tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], shared_name=c.resource, container="")
          tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(0))

  def before_step(self):
    if not self._set:
      self._reset()
      self._set = True

  def after_step(self, verdicts):
    """Raises the InvalidArgumentError of the first failed check, reading `verdicts` (per local device, in
    `devices` order: [each check's verdict..., whether one failed: on any device where they agree, else on that
    one]); where they agree, only the first device's is read when none failed."""
    if self.agreed:
      first = verdicts[0].numpy()
      if not first[-1]:
        return
      rows = [first] + [v.numpy() for v in verdicts[1:]]
    else:
      rows = [v.numpy() for v in verdicts]
      if not any(row[-1] for row in rows):
        return
    self._reset()   # the next step starts from passed checks
    for device, row in zip(self.devices, rows):
      for c, code in zip(self.checks, row[:-1]):
        if code:
          raise tf.errors.InvalidArgumentError(None, None, _text(c, int(code), device))
    raise tf.errors.InvalidArgumentError(
        None, None, "Graph execution error:\n\nA check of the program failed on a device of another process "
        "(that process raises its message); the step's results are dropped and no variable was written")


def _text(check, code, device):
  """TF's message for `check` failing with verdict `code` on `device`."""
  if check.found:   # a numerics check: what its verdict's bits say the tensor held
    found = " and ".join(name for bit, name in check.found if code & bit)
    what = f"{check.message} : Tensor had {found} values"
  else:
    what = check.message
  return (f"Graph execution error:\n\nDetected at node {check.node} on device {device}:\n{what}\n\t [[{{{{node "
          f"{check.node}}}}}]] (the step's results are dropped and no variable was written)")
