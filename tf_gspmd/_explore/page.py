"""One self-contained HTML page of a plan (`save_html`): no server, no network -- inline SVG and a little inline
JavaScript -- for a bug report or a CI artifact.

In order: the warnings (ops without a rule, involuntary gathers, uneven padding, the plan's own), the totals, the
collectives table (kind, dtype and shape, mesh axes, group, bytes per device, runs per step, the op it serves and
why; sortable, filterable), the bytes per layer as a bar chart, the per-device memory over the program's run as a
line chart with its peak marked, and the layouts of the arguments, variables and results as tile grids over the
mesh (as `visualize_array_sharding` draws them).

Sized for the paper's plans: the memory line keeps at most `MAX_POINTS` points (each the largest of its run of
ops, the peak itself kept), and the largest `MAX_GRIDS` tensors are drawn, each with at most `MAX_TILES` tiles a
side.
"""

import html

from tf_gspmd._explore.view import REPLICATED, WARNING, axis_colour

MAX_POINTS = 1500
MAX_GRIDS = 64
MAX_TILES = 16

_STYLE = """
body{font:13px/1.4 system-ui,sans-serif;margin:16px 24px;color:#222}
h1{font-size:18px;margin:0 0 4px}h2{font-size:15px;margin:22px 0 6px;border-bottom:1px solid #ddd}
.totals span{margin-right:18px}.warn{background:#fdecea;border-left:4px solid %(warn)s;padding:4px 8px;margin:3px 0}
table{border-collapse:collapse;font-size:12px}th,td{border:1px solid #ddd;padding:2px 6px;text-align:left;
vertical-align:top}th{background:#f4f4f4;cursor:pointer}td.num{text-align:right;font-variant-numeric:tabular-nums}
.grid{display:inline-block;margin:6px 14px 6px 0;vertical-align:top}.grid div{font-size:11px;max-width:420px}
.legend span{display:inline-block;margin-right:12px}.swatch{display:inline-block;width:10px;height:10px;
margin-right:4px}#filter{margin:4px 0;width:320px}
""" % {"warn": WARNING}

_SCRIPT = """
(function () {
  var table = document.getElementById('collectives-table');
  var body = table.tBodies[0];
  var headers = table.tHead.rows[0].cells;
  for (var k = 0; k < headers.length; k++) {
    headers[k].addEventListener('click', (function (col) {
      return function () {
        var rows = Array.prototype.slice.call(body.rows);
        var numeric = headers[col].dataset.numeric === '1';
        var down = headers[col].dataset.down !== '1';
        headers[col].dataset.down = down ? '1' : '0';
        rows.sort(function (a, b) {
          var x = a.cells[col].dataset.v || a.cells[col].textContent;
          var y = b.cells[col].dataset.v || b.cells[col].textContent;
          var c = numeric ? Number(x) - Number(y) : x.localeCompare(y);
          return down ? -c : c;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      };
    })(k));
  }
  document.getElementById('filter').addEventListener('input', function (e) {
    var q = e.target.value.toLowerCase();
    Array.prototype.forEach.call(body.rows, function (r) {
      r.style.display = r.textContent.toLowerCase().indexOf(q) >= 0 ? '' : 'none';
    });
  });
  document.body.dataset.ready = '1';
})();
"""


def _e(text):
  return html.escape(str(text), quote=True)


def _bytes(n):
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:,.2f} {unit}"
  return f"{n:,} B"


def _ranges(positions):
  """'0-3,8-11' for [0, 1, 2, 3, 8, 9, 10, 11]."""
  out, start, prev = [], None, None
  for p in sorted(positions):
    if start is None:
      start = prev = p
    elif p == prev + 1:
      prev = p
    else:
      out.append(f"{start}" if start == prev else f"{start}-{prev}")
      start = prev = p
  if start is not None:
    out.append(f"{start}" if start == prev else f"{start}-{prev}")
  return ",".join(out)


def _warnings(view):
  if not view.warnings:
    return '<p id="no-warnings">No warnings: every op has a rule, no involuntary gather, no padded shard.</p>'
  return "".join(f'<div class="warn" data-kind="{_e(w.kind)}"><b>{_e(w.kind)}</b> {_e(w.node)} {_e(w.text)}</div>'
                 for w in view.warnings)


def _collectives(view):
  head = ("<tr><th>op</th><th>kind</th><th>dtype[shape]</th><th>axes</th><th data-numeric='1'>group</th>"
          "<th data-numeric='1'>bytes/device</th><th data-numeric='1'>runs/step</th>"
          "<th data-numeric='1'>bytes/step</th><th>serves</th><th>why</th></tr>")
  rows = []
  for c in sorted(view.collectives, key=lambda c: -c.step_bytes):
    rows.append(
        f'<tr class="collective" data-op="{_e(c.name)}" data-bytes="{c.bytes}"><td>{_e(c.name)}</td>'
        f"<td>{_e(c.kind)}</td><td>{_e(c.dtype)}[{_e(','.join(map(str, c.shape)))}]</td>"
        f"<td>{_e(','.join(c.axes) or '-')}</td><td class='num' data-v='{c.group_size}'>{c.group_size}</td>"
        f"<td class='num' data-v='{c.bytes}'>{c.bytes:,}</td><td class='num' data-v='{c.times}'>{c.times:,}</td>"
        f"<td class='num' data-v='{c.step_bytes}'>{c.step_bytes:,}</td><td>{_e(c.source)}</td>"
        f"<td>{_e(c.reason)}</td></tr>")
  return (f'<input id="filter" placeholder="filter the collectives (op, kind, axis...)">'
          f'<table id="collectives-table"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>')


def _layers(view):
  layers = view.layers()
  if not layers:
    return "<p>No collectives.</p>"
  most = max(b for _, b in layers) or 1
  width, bar_h, label_w = 760, 16, 220
  out = [f'<svg id="layers-chart" width="{width + label_w + 140}" height="{len(layers) * (bar_h + 4) + 4}">']
  for k, (layer, nbytes) in enumerate(layers):
    y = k * (bar_h + 4) + 2
    w = max(1, round(width * nbytes / most)) if nbytes else 0
    out.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end" font-size="11">{_e(layer)}</text>'
               f'<rect class="layer-bar" data-layer="{_e(layer)}" data-bytes="{nbytes}" x="{label_w}" y="{y}" '
               f'width="{w}" height="{bar_h}" fill="#4e79a7"><title>{_e(layer)}: {nbytes:,} B</title></rect>'
               f'<text x="{label_w + w + 6}" y="{y + 12}" font-size="11">{_e(_bytes(nbytes))}</text>')
  out.append("</svg>")
  return "".join(out)


def _points(timeline, peak, most=MAX_POINTS):
  """[(op index, bytes)]: every op when few, else the largest of each run of ops, the peak kept exactly."""
  n = len(timeline)
  if n <= most:
    return [(k, t[2]) for k, t in enumerate(timeline)]
  step = -(-n // most)
  out = []
  for start in range(0, n, step):
    stop = min(n, start + step)
    k = peak if start <= peak < stop else max(range(start, stop), key=lambda j: timeline[j][2])
    out.append((k, timeline[k][2]))
  return out


def _memory(view):
  m = view.memory
  if m is None or not m.timeline:
    return "<p>No memory estimate (the program has no per-device ops).</p>"
  width, height, left, top = 900, 260, 70, 16
  n = len(m.timeline)
  most = m.peak_bytes or 1
  pts = _points(m.timeline, m.peak)

  def xy(k, b):
    return left + width * k / max(n - 1, 1), top + height * (1 - (m.held + b) / most)

  line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(k, b) for k, b in pts))
  px, py = xy(m.peak, m.timeline[m.peak][2])
  op, op_type, _ = m.timeline[m.peak]
  held_y = xy(0, 0)[1]
  ticks = "".join(f'<text x="{left - 6}" y="{top + height * (1 - f) + 4:.1f}" text-anchor="end" font-size="10">'
                  f"{_e(_bytes(int(most * f)))}</text>" for f in (0, 0.5, 1))
  return (f'<svg id="memory-chart" width="{width + left + 40}" height="{height + top + 40}">'
          f'<line x1="{left}" y1="{top + height}" x2="{left + width}" y2="{top + height}" stroke="#999"/>'
          f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + height}" stroke="#999"/>{ticks}'
          f'<line x1="{left}" y1="{held_y:.1f}" x2="{left + width}" y2="{held_y:.1f}" stroke="#bbb" '
          f'stroke-dasharray="4 3"><title>held throughout: {m.held:,} B</title></line>'
          f'<polyline id="memory-line" fill="none" stroke="#4e79a7" stroke-width="1.2" points="{line}"/>'
          f'<circle id="peak" cx="{px:.1f}" cy="{py:.1f}" r="5" fill="{WARNING}" data-op="{_e(op)}" '
          f'data-bytes="{m.peak_bytes}"><title>peak {m.peak_bytes:,} B at {_e(op)}</title></circle>'
          f'<text id="peak-label" x="{min(px + 8, left + width - 260):.1f}" y="{max(py - 8, 12):.1f}" '
          f'font-size="11">peak {_e(_bytes(m.peak_bytes))} at {_e(op)} ({_e(op_type)})</text>'
          f'<text x="{left + width / 2}" y="{top + height + 30}" text-anchor="middle" font-size="11">'
          f"ops of the per-device program in run order ({n:,}); dashed: arguments, variables and constants "
          f"({_e(_bytes(m.held))})</text></svg>")


def _grid(view, t):
  rows, cols = min(t.rows, MAX_TILES), min(t.cols, MAX_TILES)
  cw, ch = max(36, min(110, 440 // max(cols, 1))), 34
  fill = axis_colour(view.mesh, t.axes) if t.axes else REPLICATED
  cells = []
  for r in range(rows):
    for c in range(cols):
      devs = t.cells.get((r, c), [])
      (r0, r1), (c0, c1) = t.bounds[0][r], t.bounds[1][c]
      label = _ranges(devs)
      cells.append(f'<rect x="{c * cw}" y="{r * ch}" width="{cw}" height="{ch}" fill="{fill}" fill-opacity="'
                   f'{0.35 + 0.5 * ((r + c) % 2)}" stroke="#fff"><title>devices {_e(label)}: [{r0}:{r1}, {c0}:{c1}]'
                   f'</title></rect><text x="{c * cw + cw / 2}" y="{r * ch + 20}" text-anchor="middle" '
                   f'font-size="10">{_e(label if len(label) <= cw // 6 else label[:cw // 6 - 1] + "…")}</text>')
  more = "" if (rows, cols) == (t.rows, t.cols) else f" (first {rows} x {cols} of {t.rows} x {t.cols} tiles)"
  return (f'<div class="grid" data-name="{_e(t.name)}" data-role="{t.role}"><div><b>{_e(t.name)}</b> ({t.role}) '
          f"{list(t.shape)} {_e(t.sharding)}{more}</div>"
          f'<svg class="tiles" width="{cols * cw}" height="{rows * ch}">{"".join(cells)}</svg></div>')


def _layouts(view):
  def size(t):
    out = 1
    for d in t.shape:
      out *= d
    return out

  drawn = sorted(view.tiles, key=lambda t: ({"argument": 0, "variable": 1, "result": 2}[t.role], -size(t)))
  legend = "".join(f'<span><span class="swatch" style="background:{axis_colour(view.mesh, (a,))}"></span>split over '
                   f"{_e(a)}</span>" for a in view.mesh.axis_names)
  legend += f'<span><span class="swatch" style="background:{REPLICATED}"></span>replicated</span>'
  per_role = {}
  for t in drawn:
    per_role.setdefault(t.role, []).append(t)
  out = [f'<div class="legend">{legend}</div>']
  for role, ts in per_role.items():
    shown = sorted(ts, key=lambda t: -size(t))[:MAX_GRIDS]
    out.append(f"<h3>{role}s ({len(ts)}" + (f", the largest {len(shown)} drawn" if len(shown) < len(ts) else "")
               + ")</h3>" + "".join(_grid(view, t) for t in shown))
  return "".join(out)


def render(view):
  """The page of a `PlanView`, as one HTML string."""
  m = view.memory
  totals = (f'<div class="totals"><span>{len(view.collectives):,} collective ops</span>'
            f'<span id="total-bytes" data-bytes="{view.step_bytes}">{view.step_bytes:,} B per device per step'
            f"</span><span>{len(view.global_ops):,} global ops, {len(view.device_ops):,} per-device ops</span>"
            + (f'<span>peak memory {m.peak_bytes:,} B per device (estimate)</span>' if m else "") + "</div>")
  return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(view.title)}</title>"
          f"<style>{_STYLE}</style></head><body><h1>{_e(view.title)}</h1>{totals}"
          f'<h2>Warnings ({len(view.warnings)})</h2><div id="warnings">{_warnings(view)}</div>'
          f'<h2>Collectives</h2><div id="collectives">{_collectives(view)}</div>'
          f'<h2>Bytes per layer (per device per step)</h2><div id="layers">{_layers(view)}</div>'
          f'<h2>Memory per device over the step</h2><div id="memory">{_memory(view)}</div>'
          f'<h2>Layouts</h2><div id="layouts">{_layouts(view)}</div>'
          f"<script>{_SCRIPT}</script></body></html>")


def save_html(view, path):
  """Writes the page of `view` to `path`; returns the path."""
  with open(path, "w", encoding="utf-8") as f:
    f.write(render(view))
  return path
