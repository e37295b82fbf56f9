"""Pictures of a plan (tf_gspmd/_explore): the view agrees with the report it is drawn from, and a real browser --
headless Chromium, driven by Playwright -- loads the saved HTML page and Model Explorer's UI served on 127.0.0.1 for
the transformer binary's plan. The browser tests read the rendered DOM, fail on any JavaScript error and save
screenshots under build/test-artifacts/ (or $TF_GSPMD_ARTIFACTS). Without Chromium (`make test` installs Debian's
where it can) they skip, saying so."""

import os
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as gs
from tf_gspmd._explore import page as page_module
from tf_gspmd._explore.view import PlanView, layer_of

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import transformer_model as tm  # pylint: disable=g-import-not-at-top,wrong-import-position

CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = os.environ.get("TF_GSPMD_ARTIFACTS") or os.path.join(ROOT, "build", "test-artifacts")
CPUS = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(8)]
# Chromium as root, headless, its background connections off (this machine's network is closed).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


@pytest.fixture(scope="module")
def megatron():
  """A Megatron transformer's Adam step (2 layers) on (2, 4), lowered without its devices."""
  cfg = tm.Config(layers=2)
  step, args, specs = tm.megatron_train_args(cfg)
  mesh = gs.Mesh((2, 4), ("data", "model"), devices=CPUS)
  return gs.function(step, mesh=mesh, in_shardings=specs).lower(
      *[tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in args])


def test_the_view_is_the_report_drawn(megatron):
  low = megatron
  view = low.view()
  report = low.report
  assert view is low.view()   # made once
  assert view.step_bytes == report.bytes_per_device() > 0
  assert len(view.collectives) == len(report.emitted_ops())
  layers = dict(view.layers())
  assert {"l0", "l1"} <= set(layers) and layers["l0"] == layers["l1"] > 0   # the two layers send alike
  assert abs(sum(layers.values()) - report.bytes_per_device()) <= len(report.collectives)   # shares rounded down
  assert view.memory.peak_bytes == report.memory.peak_bytes
  assert view.memory.timeline[view.memory.peak][0] == report.memory.at.split(" (")[0]
  ops = {op.name: op for op in view.global_ops}
  assert set(ops) == {node.name for node in low.program.ir.nodes}
  for node in low.program.ir.nodes:
    for k, t in enumerate(ops[node.name].outputs):
      assert t.sharding == str(low.program.shardings[node.ref(k)])
  wq = next(t for t in view.tiles if t.role == "argument" and t.shape == (64, 4, 16))   # l*/wq: P(None, "model")
  assert (wq.rows, wq.cols, wq.axes) == (1, 4, ("model",)) and wq.cells[(0, 2)] == [2, 6]
  assert len(view.tiles) == len(low.program.arg_specs) + len(low.program.output_specs)


def test_gradients_fall_into_their_forward_layer():
  assert layer_of("gradient_tape/functional_1/l3_attn/einsum/Einsum", 2) == "functional_1/l3_attn"
  assert layer_of("functional_1/l3_attn/einsum/Einsum", 2) == "functional_1/l3_attn"
  assert layer_of("Mean") == "(top level)"


def test_warnings_name_the_op_and_why():
  mesh = gs.Mesh((4,), ("d",), devices=CPUS[:4])

  def fn(x, y):
    diag = tf.raw_ops.MatrixDiagPartV3(input=tf.reshape(x[:8], [2, 2, 2]), k=0, padding_value=0.0)   # no rule
    big = tf.sort(y, axis=0)                              # sorted over its split dim: gathered (2 MiB)
    return x * 2.0, big, diag

  low = gs.function(fn, mesh=mesh, in_shardings=(gs.P("d"), gs.P("d", None))).lower(
      tf.TensorSpec([10]), tf.TensorSpec([1024, 512]))
  warnings = low.view().warnings
  kinds = {(w.kind, w.node) for w in warnings}
  assert ("no rule", "MatrixDiagPartV3") in kinds, kinds
  assert [node for kind, node in kinds if kind == "uneven padding"] == ["x"], kinds   # 10 over 4, where it starts
  assert any(kind == "involuntary gather" for kind, _ in kinds), kinds
  assert len(low.report.rematerializations) == sum(w.kind == "involuntary gather" for w in warnings)


def test_a_report_not_of_a_lowering_cannot_draw_itself(megatron, tmp_path):
  report = megatron.program.report   # the pipeline's own, not the lowering's
  with pytest.raises(gs.InputError, match="lower"):
    report.save_html(str(tmp_path / "x.html"))
  assert megatron.report.save_html(str(tmp_path / "x.html")) == str(tmp_path / "x.html")


def test_keras_train_step_is_drawn(tmp_path):
  import keras  # pylint: disable=g-import-not-at-top
  gs.split_cpu_devices(8)
  dist = keras.distribution
  mesh = dist.DeviceMesh((2, 4), ("batch", "model"), devices=[f"cpu:{i}" for i in range(8)])
  layout_map = dist.LayoutMap(mesh)
  layout_map["dense_up/kernel"] = (None, "model")
  layout_map["dense_down/kernel"] = ("model", None)
  dist.set_distribution(dist.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
  try:
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, activation="relu", name="dense_up")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="dense_down")(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    x, y = np.ones((8, 16), np.float32), np.zeros((8, 4), np.float32)
    low = gs.keras.lower_train_step(model, x, y)
    view = low.view()
    assert view.step_bytes == low.report.bytes_per_device() > 0
    assert any(layer.startswith(model.name) or "dense" in layer for layer, _ in view.layers())
    kernels = {t.name: t for t in view.tiles if t.role == "variable"}
    up = next(t for name, t in kernels.items() if "dense_up" in name and "kernel" in name and t.shape == (16, 64))
    assert up.axes == ("model",) and up.cols == 4
    path = low.report.save_html(str(tmp_path / "keras.html"))
    assert "dense_up" in open(path, encoding="utf-8").read()
  finally:
    dist.set_distribution(None)


# ---- a real browser -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
  if not os.path.exists(CHROMIUM):
    pytest.skip(f"headless Chromium is not installed ({CHROMIUM}): apt-get install chromium (make test installs it "
                "where it can); the browser tests of the plan's pictures need it")
  sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (pip install -e '.[test]') drives "
                                                               "Chromium for the browser tests")
  os.makedirs(ARTIFACTS, exist_ok=True)
  with sync_api.sync_playwright() as p:
    b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield b
    b.close()


def _page(browser, errors):
  """A page that records JavaScript errors (uncaught exceptions and console errors) in `errors`; requests that
  leave this machine (Model Explorer's web fonts) are answered empty, as a closed network would not answer."""
  page = browser.new_page(viewport={"width": 1500, "height": 1000})
  page.route(re.compile(r"^https?://(?!127\.0\.0\.1[:/]).*"), lambda route: route.fulfill(status=204, body=""))
  page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
  page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
  return page


def test_the_page_in_chromium(browser, megatron, tmp_path):
  low, errors = megatron, []
  view = low.view()
  path = low.report.save_html(str(tmp_path / "plan.html"))
  page = _page(browser, errors)
  page.goto("file://" + path)
  page.wait_for_selector("body[data-ready='1']", timeout=30000)   # the page's script ran to its end
  rows = page.locator("tr.collective")
  assert rows.count() == len(view.collectives)
  assert int(page.get_attribute("#total-bytes", "data-bytes")) == low.report.bytes_per_device()
  biggest = max(view.collectives, key=lambda c: c.step_bytes)
  assert f"{biggest.bytes:,}" in rows.first.inner_text() and biggest.name in rows.first.inner_text()
  peak = page.locator("#peak")
  assert int(peak.get_attribute("data-bytes")) == low.report.memory.peak_bytes
  label = page.text_content("#peak-label")
  assert "peak" in label and peak.get_attribute("data-op") in label
  bars = page.locator(".layer-bar")
  assert [(bars.nth(k).get_attribute("data-layer"), int(bars.nth(k).get_attribute("data-bytes")))
          for k in range(bars.count())] == view.layers()
  roles = [t.role for t in view.tiles]
  assert page.locator(".grid").count() == sum(min(roles.count(r), page_module.MAX_GRIDS) for r in set(roles))
  # sorting: the group-size column, largest first on the first click
  page.locator("#collectives-table th", has_text="group").click()
  assert int(rows.first.locator("td").nth(4).inner_text()) == max(c.group_size for c in view.collectives)
  page.fill("#filter", "'data'")
  visible = [rows.nth(k).is_visible() for k in range(rows.count())]
  assert 0 < sum(visible) < len(visible)
  page.screenshot(path=os.path.join(ARTIFACTS, "plan_page.png"), full_page=True)
  assert not errors, errors


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_the_transformer_binary_in_the_page_and_in_model_explorer(browser, tmp_path):
  """The transformer binary's plan (--plan --report_html --explore): its page, and Model Explorer's UI on
  127.0.0.1 -- the per-device program with a collective labelled with its bytes, the memory overlay peaking at the
  binary's estimated peak, the global graph with its layouts."""
  pytest.importorskip("model_explorer", reason="Model Explorer (pip install -e '.[test]' or tf_gspmd[explore])")
  html_path = str(tmp_path / "transformer.html")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path), TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
  proc = subprocess.Popen([sys.executable, "examples/train_transformer.py", "--plan", "--plan_mesh=2,4",
                           f"--report_html={html_path}", "--explore", f"--explore_port={_free_port()}"],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    out, url = [], None
    for line in proc.stdout:   # the plan, then the page's path, then the server's address (it then serves)
      out.append(line)
      if line.startswith("Model Explorer: "):
        url = line.split(": ", 1)[1].strip()
        break
    text = "".join(out)
    assert url and url.startswith("http://127.0.0.1:"), text[-3000:]
    peak = int(re.search(r"estimated peak memory: [\d.,]+ MiB per device \(([\d,]+) B at", text).group(1)
               .replace(",", ""))
    sent = {int(b.replace(",", "")) for b in re.findall(r"^  all-reduce \S+ over .*?, ([\d,]+) B/device", text, re.M)}
    assert sent, text[-3000:]

    errors = []
    page = _page(browser, errors)
    page.goto("file://" + html_path)
    page.wait_for_selector("body[data-ready='1']", timeout=30000)
    assert page.locator("tr.collective").count() > 0
    assert int(page.get_attribute("#peak", "data-bytes")) == peak
    page.screenshot(path=os.path.join(ARTIFACTS, "transformer_page.png"), full_page=True)

    page.goto(url)
    page.get_by_text("NODE DATA PROVIDERS").wait_for(timeout=90000)
    body = page.inner_text("body")
    assert "per-device" in body and "collective bytes per step" in body and "memory live (bytes)" in body, body[:2000]
    # The memory overlay's largest value (its aggregated Max) is the binary's estimated peak, drawn in red.
    assert re.search(rf"Max\s[^A-Za-z]*\b{peak}\b", body), body[:3000]
    search = page.get_by_placeholder("Search nodes/layers by regex")
    search.fill("all_reduce")
    search.press("Enter")
    labels = set()
    for _ in range(60):   # (the matches are drawn in their own time: a busy machine takes longer)
      page.wait_for_timeout(500)
      labels = set(re.findall(r"all-reduce ([\d,]+) B", page.inner_text("body")))
      if labels:
        break
    assert {int(b.replace(",", "")) for b in labels} & sent, (labels, sent)
    # Alt+click on a result selects the collective: its panel gives the mesh axes, group size and bytes.
    page.get_by_text(f"all-reduce {sorted(labels)[0]} B", exact=True).first.click(modifiers=["Alt"])
    page.get_by_text("bytes per device 0").first.wait_for(timeout=30000)
    panel = page.inner_text("body")
    assert "mesh axes 0" in panel and "group size 0" in panel and "serves 0" in panel, panel[:3000]
    page.screenshot(path=os.path.join(ARTIFACTS, "model_explorer_device.png"))
    # The global graph, from the graph selector: the layouts overlay.
    page.locator("mat-select").first.focus()
    page.keyboard.press("Enter")
    page.locator(".graph-selector-panel mat-option").filter(has_text="global").first.click()
    page.get_by_text("layout: shards").first.wait_for(timeout=30000)
    page.wait_for_timeout(1000)
    page.screenshot(path=os.path.join(ARTIFACTS, "model_explorer_global.png"))
    assert not errors, errors
  finally:
    proc.kill()
    proc.wait()


def test_gs_explore_serves_both_graphs_without_blocking():
  """gs.explore(fn, *specs, block=False): Model Explorer's server answers on 127.0.0.1 with the global and the
  per-device graph of the lowering, every node of each."""
  pytest.importorskip("model_explorer", reason="Model Explorer (pip install -e '.[test]' or tf_gspmd[explore])")
  import json  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top
  mesh = gs.Mesh((4,), ("d",), devices=CPUS[:4])
  f = gs.function(lambda x, w: tf.nn.relu(x @ w), mesh=mesh, in_shardings=(gs.P(None, "d"), gs.P("d", None)))
  shown = gs.explore(f, tf.TensorSpec([8, 16]), tf.TensorSpec([16, 4]), open_browser=False, block=False)
  assert shown.url.startswith(f"http://127.0.0.1:{shown.port}/?data=")
  with urllib.request.urlopen(f"http://127.0.0.1:{shown.port}/api/v1/load_graphs_json?graph_index=0") as r:
    served = json.load(r)
  graphs = {g["id"]: g for g in served["graphCollections"][0]["graphs"]}
  low = f.lower(tf.TensorSpec([8, 16]), tf.TensorSpec([16, 4]))
  assert {n["id"] for n in graphs["global"]["nodes"]} == {node.name for node in low.program.ir.nodes}
  assert {n["id"] for n in graphs["per-device"]["nodes"]} == {n.name for n in low.graph_def.node}
  reduce = next(n for n in graphs["per-device"]["nodes"] if n["label"].startswith("all-reduce"))
  attrs = {a["key"]: a["value"] for a in reduce["attrs"]}
  assert (attrs["mesh axes 0"], attrs["group size 0"]) == ("d", "4")
  assert attrs["bytes per device 0"] == f"{8 * 4 * 4:,}"
  with pytest.raises(gs.InputError, match="specs"):
    gs.explore(low, tf.TensorSpec([8, 16]))
