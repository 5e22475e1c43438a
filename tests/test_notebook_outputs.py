"""The committed notebooks are executed on a GPU and saved with their outputs (scripts/run_notebooks.py
--write): a reader on the web sees every table, plot and number. Checked from the .ipynb JSON alone, so
this runs on any CPU.

What a committed notebook must be (each rule a `problems_<rule>` function, unit-tested on small synthetic
notebooks below, then applied to every notebook):

- executed once, top to bottom, compiled on a GPU that an output names, with a plot and no error;
- quiet: no code cell prints more than `MAX_CELL_LINES` text lines (its stream outputs and the text/plain
  form of what it displays, together; images do not count);
- honest: every number its markdown quotes with a decimal point (0.75, 1.04x) or with three or more digits
  that is not a round number (2048, 260, 1,024; not 100, 300, 8000) is a number token of its own text
  outputs. Not checked: link targets and URLs, HTML tag attributes and entities, LaTeX math ($...$, $$...$$),
  digits glued to letters before them (H100, fp16, sm_90), and the first cell's CPU budget phrase;
- clean: no machine path and no lowercase `nan` placeholder in any text output;
- concluded: its last heading is `## What we learned` (a section number such as `## 9 · ` may precede the
  words), followed by exactly one code cell that prints a few sentences built from the run's results, so
  its source holds no numeric literal;
- sectioned: each `## ` section (the cells from one markdown cell holding a `## ` heading to the next one;
  `### ` subsections belong to their section) between the setup and "What we learned" ends with a
  markdown cell of its own whose text starts with `**Takeaway.**`: one sentence, what to conclude from it;
- one palette: no notebook code cell or helper module passes a colour literal (`color=`, `c=`, `colors=`)
  other than black, white, none or a grey ("0.6"), nor spells a colour such as "tab:red", "C3" or
  "#1f77b4": implementations take their colours from `benchmarks.grids.COLORS`;
- budgeted: its metadata holds `"tritonattn": {"cpu_budget_s": N}` and its first markdown cell says
  "N s on a CPU"; notebooks/conftest.py fails the nbmake run of a notebook that takes longer on a CPU.

The notebooks' helper modules (notebooks/*.py but its conftest.py) together stay within `MAX_HELPER_LINES`.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
HELPERS = sorted(p for p in NOTEBOOK_DIR.glob("*.py") if p.name != "conftest.py")
MAX_CELL_LINES = 15
MAX_HELPER_LINES = 600

# What a section prints when it had nothing to show, and what an exception leaves in an output.
EMPTY_OR_FAILED = re.compile(
    r"nothing to (plot|show)|no committed GPU results|no results for suite|no .*results yet|rows wrong/error"
    r"|Traceback \(most recent call last\)",
    re.IGNORECASE,
)


# ============================================================================================
# Reading a notebook's JSON
# ============================================================================================
@lru_cache(maxsize=None)
def load(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def join(value) -> str:
    """nbformat stores text as one string or a list of lines."""
    return "".join(value) if isinstance(value, list) else str(value)


def source(cell: dict) -> str:
    return join(cell.get("source", ""))


def first_line(cell: dict) -> str:
    line = next((line.strip() for line in source(cell).splitlines() if line.strip()), "")
    return line if len(line) <= 80 else line[:77] + "..."


def where(index: int, cell: dict) -> str:
    return f"cell {index} ({first_line(cell)!r})"


def code_cells(nb: dict) -> list:
    """(index among all cells, cell) of each code cell."""
    return [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]


def markdown_cells(nb: dict) -> list:
    """(index among all cells, text) of each markdown cell."""
    return [(i, source(c)) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"]


def _texts(output, kinds=("text/plain", "text/html")) -> list:
    """The text of one output: a stream's text, an error's name and message, or the `kinds` forms of a
    displayed value."""
    if output["output_type"] == "stream":
        return [join(output["text"])]
    if output["output_type"] == "error":
        return [f"{output.get('ename')}: {output.get('evalue')}\nTraceback (most recent call last)"]
    data = output.get("data", {})
    return [join(data[key]) for key in kinds if key in data]


def output_texts(cell: dict, kinds=("text/plain", "text/html", "text/markdown")) -> list:
    """Every text a code cell's outputs show a reader (errors left out)."""
    return [t for o in cell.get("outputs", []) if o["output_type"] != "error" for t in _texts(o, kinds)]


def printed_lines(cell: dict) -> list:
    """The lines a code cell prints: its streams in order, and each displayed value's text (a rendered
    Markdown's source, else its text/plain form)."""
    text = ""
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            text += join(output["text"])
        elif output["output_type"] in ("execute_result", "display_data"):
            data = output.get("data", {})
            if any(key.startswith("image/") for key in data):
                continue  # a plot's text/plain is "<Figure ...>", not text a reader reads
            shown = data.get("text/markdown", data.get("text/plain"))
            if shown is not None:
                text += ("" if not text or text.endswith("\n") else "\n") + join(shown).rstrip("\n") + "\n"
    return text.splitlines()


def python_tree(code: str):
    """The code cell's AST, IPython lines (%magic, !shell) dropped; None when it still does not parse."""
    code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
    try:
        return ast.parse(code)
    except SyntaxError:
        return None


# ============================================================================================
# The rules
# ============================================================================================
def problems_cell_lines(nb: dict, limit: int = MAX_CELL_LINES) -> list:
    """Code cells that print more than `limit` text lines."""
    found = []
    for i, cell in code_cells(nb):
        n = len(printed_lines(cell))
        if n > limit:
            found.append(f"{where(i, cell)} prints {n} lines, more than {limit}: put the full table in "
                         f"results/ or behind a flag")
    return found


# A number as prose writes it: not glued to a letter, digit, `_` or `.` before it (H100, fp16, sm_90, the 0
# of 3.6.0); thousands separated by commas or not; its decimals. Outputs glue numbers to letters (1x16384,
# bs8): there a number only needs no digit or `.` before it.
NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
OUTPUT_NUMBER = re.compile(r"(?<![\d.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
BUDGET_PHRASE = re.compile(r"(\d+) s on a CPU")
_MATH = re.compile(r"\$\$.*?\$\$|\$[^$\n]+\$", re.DOTALL)
_LINK_TARGET = re.compile(r"\]\([^)]*\)|^\s*\[[^\]]+\]:\s*\S+.*$", re.MULTILINE)
_URL = re.compile(r"(?:https?://|www\.)\S+")
_TAG = re.compile(r"</?[A-Za-z][^>]*>")
_CITATION_YEAR = re.compile(r"\bet al\.,?\s*\(?\d{4}\)?")
_ENTITY = re.compile(r"&#?\w+;")


def number_tokens(text: str, pattern=NUMBER) -> list:
    """(normalised number, start, end) of every number token of `text`: 1,024 -> 1024; 1.04x -> 1.04."""
    return [(m.group().replace(",", ""), m.start(), m.end()) for m in pattern.finditer(text)]


def must_come_from_outputs(number: str) -> bool:
    """A quoted measurement: a decimal point, or three or more digits that are not one digit and zeros."""
    if "." in number:
        return True
    digits = number.lstrip("0")
    return len(digits) >= 3 and digits.rstrip("0") != digits[:1]


def prose(text: str, first: bool = False) -> str:
    """A markdown cell's text with what quotes no measurement blanked out: math, link targets, URLs, HTML
    tags and entities, a citation's year (et al., 2023), and in the notebook's first cell its CPU budget
    phrase."""
    for pattern in (_MATH, _LINK_TARGET, _URL, _TAG, _ENTITY, _CITATION_YEAR) + ((BUDGET_PHRASE,) if first else ()):
        text = pattern.sub(" ", text)
    return text


def problems_markdown_numbers(nb: dict) -> list:
    """Numbers quoted in markdown that no text output of the notebook contains as a token."""
    shown = {n for _, cell in code_cells(nb) for t in output_texts(cell) for n, _, _ in number_tokens(t, OUTPUT_NUMBER)}
    found = []
    for k, (i, text) in enumerate(markdown_cells(nb)):
        text = prose(text, first=k == 0)
        for number, start, end in number_tokens(text):
            if must_come_from_outputs(number) and number not in shown:
                context = " ".join(text[max(0, start - 40):end + 40].split())
                found.append(f"markdown cell {i} quotes {number}, which no output shows: '...{context}...'")
    return found


MACHINE_PATH = re.compile(r"/home/|/root/|/content/|/tmp/|/work/|/usr/|site-packages|\b[A-Za-z]:\\")
NAN = re.compile(r"\bnan\b")


def problems_output_hygiene(nb: dict) -> list:
    """Text outputs that show a machine path or a lowercase `nan` placeholder."""
    found = []
    for i, cell in code_cells(nb):
        for text in output_texts(cell):
            for line in text.splitlines():
                for pattern, what in ((MACHINE_PATH, "a machine path"), (NAN, "a `nan` placeholder")):
                    if pattern.search(line):
                        found.append(f"{where(i, cell)} prints {what}: {line.strip()[:120]!r}")
    return found


HEADING = re.compile(r"^#{1,6} ", re.MULTILINE)
WHAT_WE_LEARNED = re.compile(r"^## (?:\d+ · )?What we learned\s*$")


def numeric_literals(code: str) -> list:
    """The int and float literals of `code` (bools are not numbers here; f-string format specs are text)."""
    tree = python_tree(code)
    if tree is None:
        return ["(does not parse)"]
    return [repr(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and type(node.value) in (int, float, complex)]


def problems_what_we_learned(nb: dict) -> list:
    """The notebook must end with `## What we learned` and one code cell printing numbers from its run."""
    cells = nb["cells"]
    headed = [(i, text) for i, text in markdown_cells(nb) if HEADING.search(text)]
    if not headed:
        return ["no markdown heading at all, so no `## What we learned`"]
    i, text = headed[-1]
    last = [line for line in text.splitlines() if HEADING.match(line)][-1]
    if not WHAT_WE_LEARNED.match(last):
        return [f"the last heading (markdown cell {i}) is {last!r}, not '## What we learned'"]
    after = [(j, c) for j, c in enumerate(cells) if j > i and source(c).strip()]
    if len(after) != 1 or after[0][1]["cell_type"] != "code":
        kinds = [f"{c['cell_type']} {j}" for j, c in after]
        return [f"'## What we learned' (cell {i}) is followed by {kinds or 'nothing'}, not exactly one code cell"]
    j, cell = after[0]
    found = []
    literals = numeric_literals(source(cell))
    if literals:
        found.append(f"'What we learned' {where(j, cell)} holds numeric literals {literals}: take its numbers "
                     f"from the run's results")
    if not "".join(output_texts(cell, kinds=("text/plain", "text/markdown"))).strip():
        found.append(f"'What we learned' {where(j, cell)} prints nothing")
    return found


SECTION = re.compile(r"^## ", re.MULTILINE)
TAKEAWAY = "**Takeaway.**"


def problems_takeaways(nb: dict) -> list:
    """`## ` sections before `## What we learned` that do not end with a `**Takeaway.**` markdown cell."""
    cells = nb["cells"]
    starts = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and SECTION.search(source(c))]
    learned = [i for i in starts if any(WHAT_WE_LEARNED.match(line) for line in source(cells[i]).splitlines())]
    end_all = learned[-1] if learned else len(cells)
    starts = [i for i in starts if i < end_all]
    found = []
    for start, end in zip(starts, starts[1:] + [end_all]):
        body = [(j, cells[j]) for j in range(start, end) if source(cells[j]).strip()]
        j, last = body[-1]
        heading = next(line for line in source(cells[start]).splitlines() if line.startswith("## "))
        if last["cell_type"] != "markdown" or not source(last).lstrip().startswith(TAKEAWAY) or j == start:
            found.append(f"section {heading!r} (cell {start}) ends with {last['cell_type']} {where(j, last)}, "
                         f"not a markdown cell starting with {TAKEAWAY}")
    return found


def problems_helper_lines(sources: dict, limit: int = MAX_HELPER_LINES) -> list:
    """The helper modules ({name: text}) together over `limit` lines."""
    counts = {name: len(text.splitlines()) for name, text in sources.items()}
    total = sum(counts.values())
    if total <= limit:
        return []
    return [f"notebooks/*.py hold {total} lines together, more than {limit}: {counts}; move benchmark code to "
            f"benchmarks/ and checks to tritonattn.testing"]


COLOR_KEYWORDS = ("color", "c", "colors")
NEUTRAL = re.compile(r"black|white|none|0?\.\d+|0|1(\.0*)?", re.IGNORECASE)
COLOR_SPELLING = re.compile(r"tab:\w+|xkcd:.+|C\d|#[0-9a-fA-F]{3}(?:[0-9a-fA-F]{3})?(?:[0-9a-fA-F]{2})?")


def problems_palette_source(code: str) -> list:
    """Colour literals in Python source: a `color=`/`c=`/`colors=` string other than a neutral one, or any
    string spelled as a colour (tab:red, C3, #1f77b4)."""
    tree = python_tree(code)
    if tree is None:
        return []
    found, seen = [], set()
    for node in ast.walk(tree):  # breadth first: a keyword comes before the constant it holds
        if isinstance(node, ast.keyword) and node.arg in COLOR_KEYWORDS:
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            for value in values:
                seen.add(id(value))
                if isinstance(value, ast.Constant) and isinstance(value.value, str) \
                        and not NEUTRAL.fullmatch(value.value):
                    found.append((value.lineno, f"{node.arg}={value.value!r}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in seen \
                and COLOR_SPELLING.fullmatch(node.value):
            found.append((node.lineno, f"colour {node.value!r}"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def problems_palette(nb: dict) -> list:
    """Colour literals in the notebook's code cells."""
    return [f"{where(i, cell)} {p}: take implementation colours from benchmarks.grids.COLORS"
            for i, cell in code_cells(nb) for p in problems_palette_source(source(cell))]


def problems_cpu_budget(nb: dict) -> list:
    """The CPU time budget: an int in the metadata, stated as "N s on a CPU" in the first markdown cell."""
    budget = nb.get("metadata", {}).get("tritonattn", {}).get("cpu_budget_s")
    if type(budget) is not int or budget <= 0:
        return [f'metadata "tritonattn": {{"cpu_budget_s": N}} is not a positive int (it is {budget!r})']
    first = markdown_cells(nb)[:1]
    stated = [int(n) for n in BUDGET_PHRASE.findall(first[0][1])] if first else []
    if stated != [budget] * len(stated) or not stated:
        return [f"the first markdown cell states {stated or 'no'} 'N s on a CPU', the metadata's budget is "
                f"{budget} s"]
    return []


# ============================================================================================
# Each rule fails on a bad example and passes a good one
# ============================================================================================
def md(text: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": text}


def code(text: str, *outputs: dict) -> dict:
    return {"cell_type": "code", "metadata": {}, "source": text, "outputs": list(outputs), "execution_count": 1}


def stream(text: str) -> dict:
    return {"output_type": "stream", "name": "stdout", "text": text}


def shown(plain: str, html: str = None, png: bool = False) -> dict:
    data = {"text/plain": plain.splitlines(keepends=True)}
    if html:
        data["text/html"] = html
    if png:
        data["image/png"] = "iVBORw0KGgo="
    return {"output_type": "display_data", "data": data, "metadata": {}}


def notebook(*cells: dict, budget=None) -> dict:
    meta = {} if budget is None else {"tritonattn": {"cpu_budget_s": budget}}
    return {"cells": list(cells), "metadata": meta, "nbformat": 4, "nbformat_minor": 5}


def lines(n: int) -> str:
    return "".join(f"line {k}\n" for k in range(n))


def test_problems_cell_lines():
    ok = notebook(code("print(x)", stream(lines(10)), shown(lines(5)), shown("<Figure>", png=True)))
    assert problems_cell_lines(ok) == []
    split = notebook(md("# t"), code("x = 1\nprint(x)", stream("a, "), stream(lines(15)), shown("<Figure>", png=True)))
    assert problems_cell_lines(split) == [], "a line written by two stream outputs is one line"
    loud = notebook(md("# t"), code("\nshow(df)", stream(lines(10)), shown(lines(6))))
    (problem,) = problems_cell_lines(loud)
    assert "cell 1 ('show(df)') prints 16 lines" in problem


def test_problems_markdown_numbers():
    outputs = code("report()", stream("ours/SDPA 0.752 at 2048, 1.0x, mean 3.5 over 1x16384\n"),
                   shown("1024", "<td>1,536</td>"))
    ok = notebook(md("Ours runs at 1.0x, 3.5 ms, 1,024 and 1536 keys, seqlen 2048, batch 8000, an H100 in fp16, "
                     "`BLOCK = 2048`, $O(N^{128})$ <img width=\"640\"> [link](https://x.org/a/999.5) "
                     "https://y.org/777 &#8594; 300 s on a CPU, 1 x 16384, `i <= j` and `k >= l` "
                     "(Kwon et al., 2023)"),
                  outputs)
    assert problems_markdown_numbers(ok) == []
    bad = notebook(md("Title, stated 123 s on a CPU"), outputs,
                   md("ours at 0.75 of cuDNN, memory ~260 MB, at 1,000 and 8192; `i <= j` 2.25 `k >= l`"))
    problems = problems_markdown_numbers(bad)
    assert [p.split(" quotes ")[1].split(",")[0] for p in problems] == ["0.75", "260", "8192", "2.25"], problems
    assert problems[0].startswith("markdown cell 2 quotes 0.75") and "ours at 0.75 of cuDNN" in problems[0]
    assert problems_markdown_numbers(notebook(md("x"), md("a budget of 123 s on a CPU"))), \
        "the budget phrase is exempt in the first markdown cell only"


def test_problems_output_hygiene():
    ok = notebook(code("run()", stream("gpu: NVIDIA H200\nNaN rows are dropped\n"), shown("nano  1.0")))
    assert problems_output_hygiene(ok) == []
    bad = notebook(code("run()", stream("repo root: /work/main\n"), shown("graph nan us"),
                        stream("C:\\Users\\me\n"), stream("/usr/lib/python3/site-packages/x.py:3: Warning\n")))
    problems = problems_output_hygiene(bad)
    assert len(problems) == 4 and "machine path" in problems[0] and "`nan`" in problems[1], problems


LEARNED_OK = "print(f'Ours ran {ratio:.2f}x SDPA at {n} keys.', flag is True)"


def test_problems_what_we_learned():
    ok = notebook(md("# t"), code("x"), md("## 9 · What we learned"), code(LEARNED_OK, stream("Ours ran 1.02x")))
    assert problems_what_we_learned(ok) == []
    literal = notebook(md("## What we learned"), code("print(f'{r[0]:.2f}', 1.5)", stream("1.50 1.5")))
    assert "numeric literals [" in problems_what_we_learned(literal)[0]
    assert "0" in problems_what_we_learned(literal)[0] and "1.5" in problems_what_we_learned(literal)[0]
    silent = notebook(md("## What we learned"), code(LEARNED_OK))
    (problem,) = problems_what_we_learned(silent)
    assert problem.startswith("'What we learned' cell 1 (") and problem.endswith("prints nothing")
    two = notebook(md("## What we learned"), code(LEARNED_OK, stream("a")), code("y"))
    assert "not exactly one code cell" in problems_what_we_learned(two)[0]
    later = notebook(md("## What we learned"), code(LEARNED_OK, stream("a")), md("## Appendix"), code("z"))
    assert "not '## What we learned'" in problems_what_we_learned(later)[0]
    assert problems_what_we_learned(notebook(code("x"))) != []


def test_problems_takeaways():
    ok = notebook(md("# Title"), code("setup"), md("## 1 · A\ntext"), code("a"), md("### 1a\n"), code("b"),
                  md("**Takeaway.** A holds."), md("## 2 · B"), code("c"), md("  **Takeaway.** B holds."),
                  md("## What we learned"), code(LEARNED_OK))
    assert problems_takeaways(ok) == []
    bad = notebook(md("# Title"), code("setup"), md("## 1 · A"), code("a"), md("## 2 · B"), code("b"),
                   md("Takeaway: B holds."), md("## 3 · C\n**Takeaway.** C"), md("## What we learned"), code("x"))
    problems = problems_takeaways(bad)
    assert [p.split("'")[1] for p in problems] == ["## 1 · A", "## 2 · B", "## 3 · C"], problems
    no_end = notebook(md("## 1 · A"), code("a"))
    assert len(problems_takeaways(no_end)) == 1


def test_problems_helper_lines():
    assert problems_helper_lines({"a.py": lines(400), "b.py": lines(200)}) == []
    (problem,) = problems_helper_lines({"a.py": lines(400), "b.py": lines(201)})
    assert "601 lines together" in problem


def test_problems_palette():
    ok = ("ax.plot(x, y, color=COLORS['ours'], label='ours')\nax.axhline(1.0, color='black', c='0.6')\n"
          "fig.savefig(p, facecolor='white')\nax.bar(x, y, color='none', colors=['0.3', 'white'])\n")
    assert problems_palette_source(ok) == []
    assert problems_palette(notebook(md("# t"), code("%matplotlib inline\n" + ok), code("%%time\nx = 1 +"))) == []
    bad = ("ax.plot(x, y, color='tab:orange')\nax.scatter(x, y, c='red')\nax.bar(x, y, colors=['0.3', 'blue'])\n"
           "PALETTE = {'ours': 'C3', 'sdpa': '#1f77b4'}\nax.plot(x, y, color=COLORS.get(k, 'purple'))\n")
    problems = problems_palette_source(bad)
    assert [p.split(":")[0] for p in problems] == ["line 1", "line 2", "line 3", "line 4", "line 4"], problems
    (problem,) = problems_palette(notebook(code("plot()"), code('ax.plot(x, color="C1")')))
    assert problem.startswith("cell 1 ('ax.plot(x, color=\"C1\")') line 1: color='C1'"), problem


def test_problems_cpu_budget():
    ok = notebook(md("[![Open In Colab](u)](v)\n\n# t\n\nRuns in about 300 s on a CPU."), budget=300)
    assert problems_cpu_budget(ok) == []
    assert "not a positive int" in problems_cpu_budget(notebook(md("300 s on a CPU")))[0]
    assert "not a positive int" in problems_cpu_budget(notebook(md("300 s on a CPU"), budget="300"))[0]
    assert "not a positive int" in problems_cpu_budget(notebook(md("1 s on a CPU"), budget=True))[0]
    assert "states [200]" in problems_cpu_budget(notebook(md("200 s on a CPU"), budget=300))[0]
    assert "states no" in problems_cpu_budget(notebook(md("# t"), md("300 s on a CPU"), budget=300))[0]


def notebooks_conftest():
    spec = importlib.util.spec_from_file_location("notebooks_conftest", NOTEBOOK_DIR / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeItem:
    def __init__(self, path: Path):
        self.path = path
        self.name = path.name


def test_conftest_enforces_the_cpu_budget(tmp_path, monkeypatch):
    nbconf = notebooks_conftest()
    path = tmp_path / "07_x.ipynb"
    path.write_text(json.dumps(notebook(md("10 s on a CPU"), budget=10)), encoding="utf-8")
    assert nbconf.cpu_budget_s(path) == 10
    bare = tmp_path / "08_y.ipynb"
    bare.write_text(json.dumps(notebook(md("t"))), encoding="utf-8")
    assert nbconf.cpu_budget_s(bare) is None
    assert nbconf.over_budget("01_gqa.ipynb", 412.3, 300) == (
        "01_gqa.ipynb ran 412 s on the CPU, over its stated budget of 300 s")
    assert nbconf.over_budget("01_gqa.ipynb", 299.6, 300) is None
    assert "no CPU time budget" in nbconf.over_budget("08_y.ipynb", 1.0, None)

    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def run(item, seconds):
        times = iter([100.0, 100.0 + seconds])
        monkeypatch.setattr(nbconf, "clock", lambda: next(times))
        hook = nbconf.pytest_runtest_call(item)
        next(hook)
        try:
            hook.send("ran")
        except StopIteration as stop:
            return stop.value

    assert run(FakeItem(path), 9.0) == "ran"
    with pytest.raises(nbconf.OverBudget, match="07_x.ipynb ran 12 s on the CPU, over its stated budget of 10 s"):
        run(FakeItem(path), 12.0)
    with pytest.raises(nbconf.OverBudget, match="no CPU time budget"):
        run(FakeItem(bare), 1.0)
    other = nbconf.pytest_runtest_call(FakeItem(tmp_path / "test_x.py"))
    next(other)
    with pytest.raises(StopIteration):
        other.send(None)


# ============================================================================================
# The committed notebooks
# ============================================================================================
def test_there_are_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == ["00", "01", "02", "03", "04", "05", "06"], [p.name for p in NOTEBOOKS]


by_notebook = pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)


def report(path: Path, problems: list) -> str:
    return f"{path.name}:\n  " + "\n  ".join(problems)


@by_notebook
def test_notebook_is_committed_executed_on_a_gpu(path):
    cells = [c for _, c in code_cells(load(path))]
    counts = [c.get("execution_count") for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name}: code cells not run once, top to bottom (execution counts {counts}); run "
        f"`python scripts/run_notebooks.py --write` on a GPU")

    texts = [t for c in cells for o in c["outputs"] for t in _texts(o)]
    everything = "\n".join(texts)
    gpu = re.search(r"^\s*gpu: (.+)$", everything, re.MULTILINE)
    assert gpu and gpu.group(1).strip() not in ("", "cpu", "None"), f"{path.name}: no output names the GPU"
    assert re.search(r"^\s*interpreter: False$", everything, re.MULTILINE), (
        f"{path.name}: executed under the Triton interpreter, not compiled on the GPU")

    plots = sum("image/png" in o.get("data", {}) for c in cells for o in c["outputs"])
    assert plots >= 1, f"{path.name}: no plot among the outputs"

    errors = [o.get("ename") for c in cells for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, f"{path.name}: cells raised {errors}"
    bad = [line.strip() for t in texts for line in t.splitlines() if EMPTY_OR_FAILED.search(line)]
    assert not bad, f"{path.name}: outputs say a section had nothing to show or raised: {bad[:3]}"


@by_notebook
def test_no_cell_prints_more_than_15_lines(path):
    problems = problems_cell_lines(load(path))
    assert not problems, report(path, problems)


@by_notebook
def test_markdown_numbers_come_from_outputs(path):
    problems = problems_markdown_numbers(load(path))
    assert not problems, report(path, problems)


@by_notebook
def test_outputs_show_no_machine_path_or_nan(path):
    problems = problems_output_hygiene(load(path))
    assert not problems, report(path, problems)


@by_notebook
def test_ends_with_what_we_learned(path):
    problems = problems_what_we_learned(load(path))
    assert not problems, report(path, problems)


@by_notebook
def test_sections_end_with_a_takeaway(path):
    problems = problems_takeaways(load(path))
    assert not problems, report(path, problems)


@by_notebook
def test_notebook_code_uses_the_palette(path):
    problems = problems_palette(load(path))
    assert not problems, report(path, problems)


@by_notebook
def test_cpu_budget_is_stated(path):
    problems = problems_cpu_budget(load(path))
    assert not problems, report(path, problems)


def test_helper_modules_are_thin():
    problems = problems_helper_lines({p.name: p.read_text(encoding="utf-8") for p in HELPERS})
    assert not problems, problems[0]


@pytest.mark.parametrize("path", HELPERS, ids=lambda p: p.name)
def test_helper_modules_use_the_palette(path):
    problems = problems_palette_source(path.read_text(encoding="utf-8"))
    assert not problems, f"{path.name}: " + "; ".join(problems) + ": take implementation colours from " \
        "benchmarks.grids.COLORS"
