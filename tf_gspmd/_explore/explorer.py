"""Google's Model Explorer on a plan: two graphs of one `PlanView` and its node data, served on this machine.

* "global": the global graph after completion. Each node is labelled with its op type and coloured by its first
  output's layout (a colour per mesh axis it is split over, grey when replicated); its side panel lists every
  output's shape, layout and why completion chose it; a node with a warning (no rule, involuntary gather, uneven
  padding) has a red border and says why.
* "per-device": the program every device runs. A collective is labelled with its kind and bytes per device
  (`all-reduce 16,384 B`); its panel gives the mesh axes, group size, runs per step, the global op it serves (a link
  to that op's partitioned copy) and why. A control-flow node whose body holds collectives lists them.
* Node data (Model Explorer's per-node overlays): "layout: shards" (how many ways each global tensor is split, in
  its layout's colour), "warnings", "collective bytes per step" and "memory live (bytes)" (per device, at each op
  of the per-device program; the peak in red).

Ops keep their name scopes as Model Explorer namespaces, so a 64-layer model folds into its layers. Model Explorer
is an optional dependency (`pip install tf_gspmd[explore]`); nothing here is imported by the core.
"""

import dataclasses
import socket
import threading
import time
import urllib.request

from tf_gspmd._explore.view import REPLICATED, WARNING, axis_colour
from tf_gspmd.errors import InputError

GLOBAL, DEVICE = "global", "per-device"
PEAK = "#e15759"


def _model_explorer():
  try:
    import model_explorer  # pylint: disable=g-import-not-at-top
    from model_explorer import graph_builder, node_data_builder  # pylint: disable=g-import-not-at-top
    from model_explorer.config import ModelExplorerConfig  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise InputError("explore() opens Google's Model Explorer, which is not installed: pip install "
                     "'tf_gspmd[explore]' (ai-edge-model-explorer); or save the plan as one HTML page with "
                     "lowered.report.save_html(path)", node="model_explorer") from e
  return model_explorer, graph_builder, node_data_builder, ModelExplorerConfig


def _light(colour):
  """A paler shade of a #rrggbb colour (node backgrounds keep their labels readable)."""
  r, g, b = (int(colour[k:k + 2], 16) for k in (1, 3, 5))
  return "#%02x%02x%02x" % tuple(round(c + (255 - c) * 0.55) for c in (r, g, b))


def _edges(gb, op):
  return [gb.IncomingEdge(sourceNodeId=src, sourceNodeOutputId=str(k), targetNodeInputId=str(i))
          for i, (src, k) in enumerate(op.inputs)]


def _global_graph(gb, view):
  warned = {}
  for w in view.warnings:
    warned.setdefault(w.node, []).append(w)
  nodes = []
  for op in view.global_ops:
    first = op.outputs[0] if op.outputs else None
    attrs = [gb.KeyValue("op", op.op)]
    for k, t in enumerate(op.outputs):
      attrs.append(gb.KeyValue(f"layout {k}", f"{list(t.shape) if t.shape is not None else '?'} {t.dtype} "
                                              f"{t.sharding}"))
      if t.why:
        attrs.append(gb.KeyValue(f"why {k}", t.why))
    for w in warned.get(op.name, ()):
      attrs.append(gb.KeyValue(f"warning: {w.kind}", w.text))
    metadata = [gb.MetadataItem(id=str(k), attrs=[gb.KeyValue("__tensor_tag", t.ref), gb.KeyValue("layout", t.sharding),
                                                  gb.KeyValue("shape", str(list(t.shape or ())))])
                for k, t in enumerate(op.outputs)]
    colour = axis_colour(view.mesh, first.axes) if first is not None else REPLICATED
    style = gb.GraphNodeStyle(backgroundColor=_light(colour), borderColor=WARNING if op.name in warned else "",
                              hoveredBorderColor=WARNING if op.name in warned else "")
    nodes.append(gb.GraphNode(id=op.name, label=op.op, namespace=op.namespace, attrs=attrs,
                              incomingEdges=_edges(gb, op), outputsMetadata=metadata, style=style))
  return gb.Graph(id=GLOBAL, nodes=nodes)


def _device_graph(gb, view):
  collectives = view.collectives_of()
  names = {op.name for op in view.device_ops}
  nodes = []
  for op in view.device_ops:
    label, attrs, style = op.op, [gb.KeyValue("op", op.op)], None
    for k, c in enumerate(collectives.get(op.name, ())):
      where = f" (in {c.inside}'s body)" if c.inside else ""
      label = c.label if not c.inside else f"{op.op}: {c.label}"
      attrs += [gb.KeyValue(f"collective {k}", f"{c.kind} {c.op} {c.dtype}[{','.join(map(str, c.shape))}]{where}"),
                gb.KeyValue(f"mesh axes {k}", ",".join(c.axes) or "-"),
                gb.KeyValue(f"group size {k}", str(c.group_size)),
                gb.KeyValue(f"bytes per device {k}", f"{c.bytes:,}"),
                gb.KeyValue(f"runs per step {k}", f"{c.times:,}"),
                gb.KeyValue(f"serves {k}", gb.NodeIdsNodeAttributeValue(nodeIds=[c.source]) if c.source in names
                            else c.source),
                gb.KeyValue(f"why {k}", c.reason)]
      style = gb.GraphNodeStyle(backgroundColor="#fde2c8", borderColor="#f28e2b")
    nodes.append(gb.GraphNode(id=op.name, label=label, namespace=op.namespace, attrs=attrs,
                              incomingEdges=[e for e in _edges(gb, op) if e.sourceNodeId in names], style=style))
  return gb.Graph(id=DEVICE, nodes=nodes)


def _node_data(ndb, view):
  """{name: ModelNodeData} of the overlays."""
  layout = {}
  for op in view.global_ops:
    if op.outputs:
      t = op.outputs[0]
      shards = 1
      for a in t.axes:
        shards *= view.mesh.axis_size(a)
      layout[op.name] = ndb.NodeDataResult(value=shards, bgColor=axis_colour(view.mesh, t.axes))
  out = {"layout: shards": ndb.ModelNodeData(graphsData={GLOBAL: ndb.GraphNodeData(results=layout)})}
  if view.warnings:
    warned = {w.node: ndb.NodeDataResult(value=1, bgColor=WARNING) for w in view.warnings if w.node}
    out["warnings"] = ndb.ModelNodeData(graphsData={GLOBAL: ndb.GraphNodeData(results=warned)})
  sent = {}
  for c in view.collectives:
    sent[c.name] = sent.get(c.name, 0) + c.step_bytes
  if sent:
    out["collective bytes per step"] = ndb.ModelNodeData(graphsData={DEVICE: ndb.GraphNodeData(
        results={name: ndb.NodeDataResult(value=b) for name, b in sent.items()},
        gradient=[ndb.GradientItem(stop=0, bgColor="#fff5eb"), ndb.GradientItem(stop=1, bgColor="#d94801")])})
  m = view.memory
  if m is not None and m.timeline:
    names = {op.name for op in view.device_ops}
    peak_op = m.timeline[m.peak][0]
    live = {op: ndb.NodeDataResult(value=m.held + b, bgColor=PEAK if op == peak_op else None)
            for op, _, b in m.timeline if op in names}
    out["memory live (bytes)"] = ndb.ModelNodeData(graphsData={DEVICE: ndb.GraphNodeData(
        results=live, gradient=[ndb.GradientItem(stop=0, bgColor="#f7fbff"),
                                ndb.GradientItem(stop=1, bgColor="#2171b5")])})
  return out


def graphs(view, name="plan"):
  """(Model Explorer's graphs of a `PlanView`: one collection `name` of the global and the per-device graph, the
  global one first; {overlay name: node data})."""
  _, gb, ndb, _ = _model_explorer()
  collection = gb.GraphCollection(label=name, graphs=[_global_graph(gb, view), _device_graph(gb, view)],
                                  graphSorting="node_count_asc")
  return {"graphCollections": [collection]}, _node_data(ndb, view)


@dataclasses.dataclass
class Explorer:
  """A Model Explorer server on this machine showing a plan: open `url` in a browser."""
  url: str
  port: int
  thread: threading.Thread

  def wait(self):
    """Blocks (serving) until interrupted (Ctrl+C)."""
    try:
      while self.thread.is_alive():
        time.sleep(0.5)
    except KeyboardInterrupt:
      pass


def _free_port(host):
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def serve(view, name="plan", host="127.0.0.1", port=None, open_browser=False, timeout=60.0):
  """Starts Model Explorer's server (a daemon thread of this process) on `view`; returns an `Explorer` once the
  server answers. The page's address carries which graphs and overlays to open."""
  config_class = _model_explorer()[3]
  collection, overlays = graphs(view, name)
  config = config_class()
  config.graphs_list.append(collection)
  config.model_sources.append({"url": f"graphs://{name}/0"})
  for overlay, data in overlays.items():
    config.add_node_data(overlay, data)
  port = port or _free_port(host)
  from model_explorer import server  # pylint: disable=g-import-not-at-top
  thread = threading.Thread(target=server.start, kwargs=dict(host=host, port=port, config=config,
                                                             no_open_in_browser=not open_browser), daemon=True)
  thread.start()
  deadline = time.monotonic() + timeout
  base = f"http://{host}:{port}"
  while True:
    try:
      with urllib.request.urlopen(base + "/", timeout=2):
        break
    except OSError as e:
      if time.monotonic() > deadline or not thread.is_alive():
        raise InputError(f"Model Explorer did not answer on {base} within {timeout:.0f} s ({e}); give another "
                         f"port=", node="explore") from e
      time.sleep(0.2)
  return Explorer(url=f"{base}/?data={config.to_url_param_value()}", port=port, thread=thread)
