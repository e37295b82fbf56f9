"""Pictures of a plan, drawn from one `view.PlanView` of a lowering: a self-contained HTML page (`save_html`,
`lowered.report.save_html`) and Google's Model Explorer (`explore`), both in plan mode (no devices) as well."""

from tf_gspmd._explore import page
from tf_gspmd._explore.view import PlanView
from tf_gspmd.errors import InputError


def save_html(lowered, path):
  """Writes the page of a `Lowered` to `path`; returns the path."""
  return page.save_html(lowered.view(), path)


def explore(fn_or_lowered, *specs, host="127.0.0.1", port=None, open_browser=True, block=True):
  """Opens Model Explorer on a plan: the global graph with every tensor's layout, the per-device program with its
  collectives, the per-device memory at each op (optional dependency: pip install 'tf_gspmd[explore]').

  Args:
    fn_or_lowered: a `Lowered`, or a gs.function lowered here for `specs` (tf.TensorSpecs or example arguments).
    host, port: where the server listens (this machine; a free port when None).
    open_browser: open the page in this machine's browser.
    block: serve until interrupted (Ctrl+C); False returns at once, the server running in a daemon thread.

  Returns:
    The `explorer.Explorer` (its `url`).
  """
  from tf_gspmd._explore import explorer  # pylint: disable=g-import-not-at-top
  lowered = fn_or_lowered
  if not hasattr(lowered, "view"):
    if not hasattr(lowered, "lower"):
      raise InputError(f"gs.explore draws a gs.function (with its argument specs) or its lowering; got "
                       f"{type(lowered).__name__}", node="fn_or_lowered")
    lowered = lowered.lower(*specs)
  elif specs:
    raise InputError("gs.explore(lowered) takes no specs: the lowering has its own", node="specs")
  shown = explorer.serve(lowered.view(), name=lowered.view().title.split(" ")[0], host=host, port=port,
                         open_browser=open_browser)
  print(f"Model Explorer: {shown.url}", flush=True)
  if block:
    shown.wait()
  return shown


__all__ = ["PlanView", "explore", "save_html"]
