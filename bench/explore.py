"""The plan's pictures at the paper's sizes: the transformer binary's --plan with --report_html and --explore, the
page and Model Explorer's UI then loaded in headless Chromium.

Per config it prints: lowering time, the page's size and load time, the ops of the global and per-device graphs,
the time until Model Explorer's UI shows its first graph (its op node count as the UI gives it), the peak resident
set of the binary (which builds the view and serves the graphs) and the resident set of Chromium's processes once both are shown,
and any JavaScript error.

  .venv/bin/python bench/explore.py [--only small,dense128b]
"""

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import scale  # pylint: disable=g-import-not-at-top,wrong-import-position

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic"]
CONFIGS = {
    "small": ["examples/train_transformer.py", "--plan", "--plan_mesh=2,4"],
    "dense128b": scale.transformer_argv(scale.DENSE["dense128b"], "megatron"),
}


def _port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _kib(pid, field):
  with open(f"/proc/{pid}/status", encoding="utf-8") as f:
    return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1))


def _chromium_rss():
  """Resident KiB of every Chromium process (the browser and its renderers)."""
  out = subprocess.run(["ps", "-C", "chromium", "-o", "rss="], capture_output=True, text=True, check=False).stdout
  return sum(int(v) for v in out.split())


def measure(name, argv):
  from playwright.sync_api import sync_playwright  # pylint: disable=g-import-not-at-top
  html = os.path.join(tempfile.mkdtemp(), f"{name}.html")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
  proc = subprocess.Popen([sys.executable] + argv + [f"--report_html={html}", "--explore", f"--explore_port={_port()}"],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    text, url = [], None
    for line in proc.stdout:
      text.append(line)
      if line.startswith("Model Explorer: "):
        url = line.split(": ", 1)[1].strip()
        break
    if url is None:
      raise RuntimeError("".join(text[-20:]))
    lowered = float(re.search(r"lowered in ([\d.]+) s", "".join(text)).group(1))
    row = {"lower_s": lowered, "page_mib": os.path.getsize(html) / 2**20}
    with open(html, encoding="utf-8") as f:   # the page's totals: the view's ops of each graph
      row["ops"] = re.search(r"([\d,]+ global ops, [\d,]+ per-device ops)", f.read()).group(1)
    errors = []
    with sync_playwright() as p:
      browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
      page = browser.new_page(viewport={"width": 1500, "height": 1000})
      page.route(re.compile(r"^https?://(?!127\.0\.0\.1[:/]).*"), lambda route: route.fulfill(status=204, body=""))
      page.on("pageerror", lambda e: errors.append(str(e)))
      page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
      start = time.perf_counter()
      page.goto("file://" + html)
      page.wait_for_selector("body[data-ready='1']", timeout=600000)
      row["page_s"] = time.perf_counter() - start
      start = time.perf_counter()
      page.goto(url)
      page.get_by_text("NODE DATA PROVIDERS").wait_for(timeout=600000)
      row["explorer_s"] = time.perf_counter() - start
      row["shown"] = re.search(r"op node count\s+(\d+)", page.inner_text("body")).group(1)   # the graph shown
      row["binary_gib"] = _kib(proc.pid, "VmHWM") / 2**20
      row["chromium_gib"] = _chromium_rss() / 2**20
      browser.close()
    row["errors"] = errors
    return row
  finally:
    proc.kill()
    proc.wait()


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--only", default="small,dense128b")
  args = parser.parse_args()
  print(f"{'plan':10s} {'lower s':>8s} {'page MiB':>9s} {'page s':>7s} {'ME s':>6s} {'graphs':>40s} "
        f"{'ME op nodes':>11s} {'binary GiB':>10s} {'Chromium GiB':>12s}  JS errors")
  for name in args.only.split(","):
    r = measure(name, CONFIGS[name])
    print(f"{name:10s} {r['lower_s']:8.1f} {r['page_mib']:9.2f} {r['page_s']:7.1f} {r['explorer_s']:6.1f} "
          f"{r['ops']:>40s} {r['shown']:>11s} {r['binary_gib']:10.2f} {r['chromium_gib']:12.2f}  {len(r['errors'])}",
          flush=True)
    for e in r["errors"][:5]:
      print(f"  {e}")


if __name__ == "__main__":
  main()
