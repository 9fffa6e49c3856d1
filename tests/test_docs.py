"""The documents name only paths that exist, the README stays a product page with the two
commands, and every decision record is in its index and cited by a name that exists (the
notebook's citations went stale unnoticed as results moved; a moved file must take its
mentions along)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DECISIONS = ROOT / "docs" / "decisions"
SITE = ROOT / "docs"
DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "benchmarks" / "README.md",
        ROOT / "benchmarks" / "RESULTS.md", ROOT / "benchmarks" / "results" / "README.md",
        ROOT / "src" / "egeria" / "policies" / "SMARTFRZ.md", *sorted(SITE.rglob("*.md"))]
DEMO_COMMAND = "bash scripts/setup.sh && .venv/bin/egeria demo"
TEST_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m pytest -q"
README_MAX_LINES = 160

# a backticked path from the repository root (a folder ending in "/" or a file), or a bare
# file name with one of these extensions (found from the root or beside the document)
BACKTICKED = re.compile(r"`((?:src|tests|benchmarks|scripts|examples|docs)/[\w./-]*|[\w-]+\.(?:md|toml|sh))`")
# a Markdown link or image target, relative to the document's folder
LINK = re.compile(r"\]\(([^)\s]+)\)")
RECORD = re.compile(r"^\d{3}-[\w-]+\.md$")
CITATION = re.compile(r"docs/decisions/(\d{3}-[\w-]+\.md)")


def named_paths(text: str) -> list[str]:
    """Every path a Markdown text names in backticks or as a link target (web links left out)."""
    links = [target.split("#")[0] for target in LINK.findall(text)]
    return BACKTICKED.findall(text) + [t for t in links if t and "://" not in t and not t.startswith("mailto:")]


def missing_paths(doc: Path, root: Path = ROOT) -> list[str]:
    """The paths ``doc`` names that exist neither from ``root`` nor beside ``doc``."""
    return [name for name in named_paths(doc.read_text())
            if not (root / name).exists() and not (doc.parent / name).exists()]


def test_the_parser_finds_paths_and_links_and_skips_code() -> None:
    text = ("see `src/egeria/engine.py`, `tests/helpers/`, `README.md`, [a record](003-eval-interval.md#evidence), "
            "![plot](benchmarks/results/oracle/oracle.png), not `eg.step()`, `egeria.Egeria`, "
            "`benchmarks/results/demo/seed*/demo.json` or [the paper](https://example.org/egeria.pdf)")
    assert named_paths(text) == ["src/egeria/engine.py", "tests/helpers/", "README.md",
                                 "003-eval-interval.md", "benchmarks/results/oracle/oracle.png"]


def test_a_broken_path_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "kept.md").write_text("x")
    doc = tmp_path / "docs" / "page.md"
    doc.write_text("`docs/kept.md` and [beside](kept.md), but `docs/gone.md` and [lost](gone/plot.png)")
    assert missing_paths(doc, root=tmp_path) == ["docs/gone.md", "gone/plot.png"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_names_exists(doc: Path) -> None:
    assert named_paths(doc.read_text()), f"{doc.relative_to(ROOT)} names no path: the parser proves nothing"
    missing = missing_paths(doc)
    assert missing == [], f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_readme_is_a_short_page_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    lines = len(text.splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; keep it under {README_MAX_LINES}"
    assert DEMO_COMMAND in text, f"README.md lost the demo command {DEMO_COMMAND!r}"
    assert TEST_COMMAND in text, f"README.md lost the test command {TEST_COMMAND!r}"


CELL_MAX_WORDS, PARAGRAPH_MAX_WORDS = 40, 150
# An issue number ("issue 49", "issues 49 and 50", "#49"), a benchmark task's letter, or a
# term of the decision records that the README does not define (the glossary does).
ISSUE = re.compile(r"\bissues? \d+|(?<![\w&])#\d+\b", re.I)
TASK_LETTER = re.compile(r"\([a-f]\)")
INTERNAL = re.compile(r"\b(twins?|pace|watch|regimes?|idle|spent|floor)\b", re.I)


def blocks(text: str) -> tuple[list[str], list[str]]:
    """(table cells, paragraphs) of a Markdown text: code blocks, headings and HTML comments
    left out, each list item a paragraph of its own."""
    cells: list[str] = []
    paragraphs: list[str] = []
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    current: list[str] = []
    for line in [*text.splitlines(), ""]:
        stripped = line.strip()
        if stripped.startswith("|"):
            cells += [c.strip() for c in stripped.strip("|").split("|") if not re.fullmatch(r"-*:?-*:?", c.strip())]
        starts_item = re.match(r"[-*] |\d+\. ", stripped)
        if not stripped or stripped.startswith(("|", "#", "![")) or starts_item:
            if current:
                paragraphs.append(" ".join(current))
            current = [stripped] if starts_item else []
        else:
            current.append(stripped)
    return cells, paragraphs


def readme_faults(text: str) -> list[str]:
    """What keeps a README from reading as a product page: long cells and paragraphs, issue
    numbers, task letters and undefined internal terms."""
    cells, paragraphs = blocks(text)
    faults = [f"a table cell of {len(c.split())} words: {c[:60]!r}" for c in cells if len(c.split()) > CELL_MAX_WORDS]
    faults += [f"a paragraph of {len(p.split())} words: {p[:60]!r}" for p in paragraphs
               if len(p.split()) > PARAGRAPH_MAX_WORDS]
    prose = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", text))  # link targets and code are not read
    faults += [f"an issue number: {m!r}" for m in ISSUE.findall(prose)]
    faults += [f"a task letter: {m!r}" for m in TASK_LETTER.findall(prose)]
    faults += [f"an internal term: {m!r}" for m in INTERNAL.findall(prose)]
    return faults


def test_the_readme_has_short_cells_and_paragraphs_and_no_issue_numbers_or_internal_terms() -> None:
    faults = readme_faults((ROOT / "README.md").read_text())
    assert faults == [], f"README.md: {faults}"


def test_a_long_cell_a_long_paragraph_an_issue_number_and_an_internal_term_are_found() -> None:
    long_cell = "| task | " + "word " * 41 + "|\n|---|---|\n| a | b |"
    assert readme_faults(long_cell) == [f"a table cell of 41 words: {('word ' * 41).strip()[:60]!r}"]
    paragraph = "One " + "word " * 150 + "\nmore lines.\n\n- an item of its own"
    assert [f.split(":")[0] for f in readme_faults(paragraph)] == ["a paragraph of 153 words"]
    assert readme_faults("Goals (issues 49 and 50; see #51), task (f), its twin at plain's pace.") == [
        "an issue number: 'issues 49'", "an issue number: '#51'", "a task letter: '(f)'",
        "an internal term: 'twin'", "an internal term: 'pace'"]
    assert readme_faults("```\n#49 in code\n```\n[a link](RESULTS.md#f-idle) and `floor_ratio`") == []


def test_ci_runs_the_readme_test_command() -> None:
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text(), f".ci/run no longer runs {TEST_COMMAND!r}"


def records() -> list[str]:
    return sorted(p.name for p in DECISIONS.glob("*.md") if RECORD.match(p.name))


def test_every_decision_record_is_in_the_index_and_has_its_sections() -> None:
    names = records()
    assert len(names) >= 20  # the records exist; an empty folder would pass the rest
    index = set(LINK.findall((DECISIONS / "README.md").read_text()))
    assert [name for name in names if name not in index] == [], "docs/decisions/README.md does not list them"
    for name in names:
        text = (DECISIONS / name).read_text()
        absent = [s for s in ("## Question", "## Evidence", "## Decision") if s not in text]
        assert absent == [], f"docs/decisions/{name} lacks {absent}"


def test_every_record_the_code_cites_exists() -> None:
    cited = {}
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        for name in CITATION.findall(path.read_text()):
            cited.setdefault(name, str(path.relative_to(ROOT)))
    assert cited, "the code cites no decision record"
    missing = {name: where for name, where in cited.items() if not (DECISIONS / name).exists()}
    assert missing == {}, f"the code cites decision records that do not exist: {missing}"


# a script the benchmarks index names in a command: benchmarks/NAME.py, benchmarks/studies/NAME.sh, ...
SCRIPT = re.compile(r"benchmarks/[\w/]+\.(?:py|sh)")


def scripts() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*")
                  if p.suffix in (".py", ".sh") and "results" not in p.parts)


def test_the_benchmarks_index_lists_every_script_and_names_only_scripts_that_exist() -> None:
    named = set(SCRIPT.findall((ROOT / "benchmarks" / "README.md").read_text()))
    assert len(scripts()) >= 20  # the scripts exist; an empty folder would pass
    assert [s for s in scripts() if s not in named] == [], "benchmarks/README.md does not list these scripts"
    assert sorted(s for s in named if not (ROOT / s).exists()) == [], "benchmarks/README.md names scripts that do not exist"


def test_every_benchmark_script_opens_with_the_question_it_answers() -> None:
    import ast
    for name in (s for s in scripts() if s.endswith(".py")):
        doc = ast.get_docstring(ast.parse((ROOT / name).read_text()))
        assert doc and doc.splitlines()[0].strip(), f"{name} has no first docstring line saying what it answers"


RESULTS_MARKER = "<!-- results table"
FIGURE_PAGES = [ROOT / "README.md", *sorted((SITE / "policies").glob("*.md"))]


def results_rows(doc: Path) -> list[str]:
    """The rows of every results table of ``doc``, each under a marker comment."""
    lines = doc.read_text().splitlines()
    rows = []
    for start in (i for i, line in enumerate(lines) if line.startswith(RESULTS_MARKER)):
        for line in lines[start + 3:]:
            if not line.startswith("|"):
                break
            rows.append(line)
    return rows


def page_numbers(text: str) -> list[float]:
    return [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))]


def figures(row: str) -> list[str]:
    """The figures of a table row, with their % or x, outside link targets; a range
    (93.20-93.39%) gives both ends, each with the range's unit."""
    text = re.sub(r"\]\([^)]*\)", "]", row).replace(",", "")
    found: list[str] = []

    def ends(m: re.Match) -> str:
        found.extend([m[1] + m[3], m[2] + m[3]])
        return " "

    text = re.sub(r"(?<![\w.])(\d+(?:\.\d+)?)-(\d+(?:\.\d+)?)(%|x|)", ends, text)
    return found + re.findall(r"(?<![\w.-])-?\d+(?:\.\d+)?(?:%|x)?", text)


def on_page(figure: str, numbers: list[float], text: str) -> bool:
    """A figure is on the results page as written, or a percentage as the fraction the run
    files hold (93.41% as 0.9341), to its rounding."""
    if re.search(r"(?<![\d.])" + re.escape(figure) + r"(?![\d])", text):
        return True
    if figure.endswith("%"):
        value, places = float(figure[:-1]) / 100, len(figure[:-1].partition(".")[2]) + 2
        return any(abs(n - value) <= 0.5 * 10 ** -places + 1e-9 for n in numbers)
    return False


@pytest.mark.parametrize("doc", FIGURE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_of_a_results_table_is_on_the_results_page(doc: Path) -> None:
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    numbers = page_numbers(text)
    rows = results_rows(doc)
    if doc.name == "README.md":
        assert len(rows) >= 6, "the README's results table was not found under its marker"
    missing = {row.split("|")[1].strip()[:50]: [f for f in figures(row) if not on_page(f, numbers, text)]
               for row in rows}
    assert {k: v for k, v in missing.items() if v} == {}, f"{doc.name}: figures not on benchmarks/RESULTS.md"


def test_a_figure_off_the_page_is_found() -> None:
    text = "| egeria | 0 | 0.9341 | 1.15x | 128.06 |"
    numbers = page_numbers(text)
    assert figures("| [a](x.md#b) | 93.20-93.39% | 1.15x, 2.00x | 128.06 |") == ["93.20%", "93.39%", "1.15x", "2.00x", "128.06"]
    assert on_page("93.41%", numbers, text) and on_page("1.15x", numbers, text) and on_page("128.06", numbers, text)
    assert not on_page("93.42%", numbers, text) and not on_page("1.16x", numbers, text)
    assert not on_page("28.06", numbers, text)
