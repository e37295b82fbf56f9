"""The docs agree with the code: the pass list, the modules, the floors, the README's size and every relative link.

Fast: the sources are parsed (ast), the Markdown read as text; only the check of the paths imports the pipeline.
"""

import ast
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
if os.environ.get("TEST_SRCDIR"):   # a Bazel runfiles tree: the package as built, not the source tree the docs map
  pytest.skip("the docs describe the source tree; `make test` checks them", allow_module_level=True)
ARCHITECTURE = DOCS / "architecture.md"
README = ROOT / "README.md"
LIBRARY_DIRS = ("tf_gspmd", "ops", "rewriter")
README_MAX_LINES = 250

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _section(path, title):
  """The text of the `## title` section of `path`, up to the next heading of level 2 or above (a `#` line inside a
  fenced code block is no heading)."""
  out, inside, found, fenced = [], False, False, False
  for line in path.read_text().splitlines():
    if line.startswith("```"):
      fenced = not fenced
    elif not fenced and re.match(r"^#{1,2} ", line):
      if inside:
        break
      inside = line.strip() == f"## {title}"
      found = found or inside
      continue
    if inside:
      out.append(line)
  assert found, f"{path.relative_to(ROOT)} has no '## {title}' section"
  return "\n".join(out)


def _assigned_tuple(path, name):
  """The value (an ast node) assigned to module-level `name` in the Python file `path`."""
  tree = ast.parse(path.read_text(), str(path))
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
      return node.value
  raise AssertionError(f"{path.relative_to(ROOT)} assigns no {name}")


def pipeline_passes():
  """The pass names of PASSES in rewriter/pipeline.py, in order: the first element of each entry."""
  value = _assigned_tuple(ROOT / "rewriter" / "pipeline.py", "PASSES")
  assert isinstance(value, (ast.Tuple, ast.List)), "PASSES is no tuple literal"
  names = []
  for entry in value.elts:
    assert isinstance(entry, (ast.Tuple, ast.List)) and isinstance(entry.elts[0], ast.Constant), \
        f"an entry of PASSES is not (name, function): {ast.dump(entry)}"
    names.append(entry.elts[0].value)
  return names


def layering_floors():
  """The floor names of FLOORS in tests/test_layering.py, lowest first."""
  value = _assigned_tuple(ROOT / "tests" / "test_layering.py", "FLOORS")
  return [entry.elts[0].value for entry in value.elts]


def _only_docstring(path):
  body = ast.parse(path.read_text(), str(path)).body
  if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
      isinstance(body[0].value.value, str):
    body = body[1:]
  return not body


def library_modules():
  """Every .py file under tf_gspmd/, ops/ and rewriter/, repo-relative, except an __init__.py that holds nothing
  but a docstring."""
  out = []
  for directory in LIBRARY_DIRS:
    for path in sorted((ROOT / directory).rglob("*.py")):
      if path.name == "__init__.py" and _only_docstring(path):
        continue
      out.append(path.relative_to(ROOT).as_posix())
  return out


def passes_in_docs():
  """The pass names of docs/architecture.md's '## Passes' table, in order: the backticked name in each row's first
  cell."""
  names = []
  for line in _section(ARCHITECTURE, "Passes").splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
    if not cells or set(cells[0]) <= set("-: "):
      continue
    found = re.fullmatch(r"`([A-Za-z_][A-Za-z0-9_]*)`", cells[0])
    if found:
      names.append(found.group(1))
  return names


def paths_named(text):
  """Backticked repo-relative paths in `text`: tokens of path characters with a slash, or ending in .py."""
  found = []
  for token in re.findall(r"`([^`\n]+)`", text):
    if re.fullmatch(r"[A-Za-z0-9_.\-/]+", token) and ("/" in token or token.endswith(".py")) and \
        not token.startswith(("/", "-")):
      found.append(token)
  return found


def _same_passes(code, docs, where):
  """Asserts that `docs` (the pass names `where` lists) are PASSES's names `code`, in order."""
  missing = [p for p in code if p not in docs]
  extra = [p for p in docs if p not in code]
  assert not missing, f"passes of rewriter/pipeline.py PASSES that {where} does not name: {missing}"
  assert not extra, f"{where} names passes PASSES does not have: {extra}"
  assert docs == code, f"{where} is out of PASSES's order:\n  docs: {docs}\n  code: {code}"


def test_the_pass_list_is_pipeline_passes_in_order():
  _same_passes(pipeline_passes(), passes_in_docs(), "docs/architecture.md '## Passes'")


def passes_in_diagram():
  """The pass names of the diagram in docs/architecture.md's '## Data path': the indented lines of its first code
  block that start with a name (or names joined by ', '), in order."""
  found = FENCE.search(_section(ARCHITECTURE, "Data path"))
  assert found, "docs/architecture.md '## Data path' has no diagram (a fenced code block)"
  names = []
  for line in found.group(0).splitlines()[1:-1]:
    m = re.match(r"^ +([a-z][a-z0-9_]*(?:, [a-z][a-z0-9_]*)*)(?: {2,}|$)", line)
    if m:
      names += m.group(1).split(", ")
  return names


def test_the_data_path_names_every_pass_in_order():
  _same_passes(pipeline_passes(), passes_in_diagram(), "the diagram of docs/architecture.md '## Data path'")


def test_the_layout_names_every_library_module():
  named = set(paths_named(_section(ARCHITECTURE, "Layout")))
  missing = [m for m in library_modules() if m not in named]
  assert not missing, "library modules docs/architecture.md '## Layout' does not name:\n" + "\n".join(missing)


def test_every_path_the_layout_names_exists():
  gone = [p for p in paths_named(_section(ARCHITECTURE, "Layout")) if not (ROOT / p).exists()]
  assert not gone, "paths docs/architecture.md '## Layout' names that do not exist:\n" + "\n".join(gone)


def floors_in_docs():
  """The floors of docs/architecture.md's '## Floors': the backticked name opening each numbered item, in order."""
  return re.findall(r"^\d+\. `([^`]+)`", _section(ARCHITECTURE, "Floors"), re.M)


def test_the_floors_are_test_layerings_in_order():
  code, docs = layering_floors(), floors_in_docs()
  missing = [f for f in code if f not in docs]
  assert not missing, \
      f"floors of tests/test_layering.py FLOORS missing from docs/architecture.md '## Floors': {missing}"
  assert docs == code, f"docs/architecture.md '## Floors' is not FLOORS in order:\n  docs: {docs}\n  code: {code}"


def test_the_readme_is_short_and_gives_the_two_commands():
  text = README.read_text()
  lines = len(text.splitlines())
  assert lines <= README_MAX_LINES, f"README.md has {lines} lines, more than {README_MAX_LINES}: move text to docs/"
  for command in ("make run", "make test"):
    assert command in text, f"README.md does not give `{command}`"


def _prose(text):
  """Markdown without its code: fenced blocks and inline code hold no links."""
  return INLINE_CODE.sub("", FENCE.sub("", text))


def test_the_readme_links_every_docs_page():
  linked = {pathlib.PurePosixPath(t.split("#")[0]).name for t in LINK.findall(_prose(README.read_text()))}
  missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name not in linked]
  assert not missing, f"docs pages README.md does not link: {missing}"


def slug(title):
  """GitHub's anchor of a heading."""
  title = INLINE_CODE.sub(lambda m: m.group(0)[1:-1], title).strip().lower()
  title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
  return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")


def anchors(path):
  seen, out = {}, set()
  for _, title in HEADING.findall(FENCE.sub("", path.read_text())):
    base = slug(title)
    n = seen.get(base, 0)
    seen[base] = n + 1
    out.add(base if n == 0 else f"{base}-{n}")
  return out


MARKDOWN = [README] + sorted(DOCS.glob("*.md"))


def test_there_are_docs():
  assert len(MARKDOWN) > 1 and ARCHITECTURE.exists(), "docs/*.md not found"


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_a_file_that_exists(page):
  broken = []
  for target in LINK.findall(_prose(page.read_text())):
    if re.match(r"^[a-z][a-z0-9+.\-]*:", target):   # http:, https:, mailto:
      continue
    file_part, _, anchor = target.partition("#")
    resolved = (page.parent / file_part).resolve() if file_part else page
    if not resolved.exists():
      broken.append(f"{target}: no file {resolved.relative_to(ROOT) if ROOT in resolved.parents else resolved}")
    elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
      broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}")
  assert not broken, f"broken relative links in {page.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("text,want", [
    ("The paper's scale", "the-papers-scale"),
    ("Automatic two-level plans (`gs.auto_parallel`)", "automatic-two-level-plans-gsauto_parallel"),
    ("GPUs and TPUs", "gpus-and-tpus"),
])
def test_slug_is_githubs(text, want):
  assert slug(text) == want


PATH_LETTERS = {"O": "one_graph", "C": "collectives", "P": "plan", "X": "xla"}


def paths_in_diagram():
  """{pass name: the paths its diagram line marks (its column of O, C, P, X letters; "-" for none)}."""
  found = FENCE.search(_section(ARCHITECTURE, "Data path"))
  out = {}
  for line in found.group(0).splitlines()[1:-1]:
    m = re.match(r"^ +([a-z][a-z0-9_]*(?:, [a-z][a-z0-9_]*)*) +([OCPX-]{4})  ", line)
    if m:
      for name in m.group(1).split(", "):
        out[name] = {PATH_LETTERS[c] for c in m.group(2) if c != "-"}
  return out


def test_the_data_path_marks_the_paths_each_pass_runs_on():
  """The diagram's path letters are rewriter/pipeline.py's PATHS (this one test imports the pipeline)."""
  from tf_gspmd.rewriter import pipeline  # pylint: disable=g-import-not-at-top
  drawn = paths_in_diagram()
  want = {name: {path for path, passes in pipeline.PATHS.items() if name in passes} for name, _ in pipeline.PASSES}
  wrong = {name: (sorted(drawn.get(name, ())), sorted(paths)) for name, paths in want.items()
           if drawn.get(name) != paths}
  assert not wrong, f"passes whose paths the diagram marks wrongly ((drawn, PATHS)): {wrong}"
