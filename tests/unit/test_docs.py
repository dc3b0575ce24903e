"""The documentation's citations: measured figures live in dated files of docs/benchmarks/, which the
code and the docs cite by name (the old README's run letters meant nothing once the README moved),
and every file they cite exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "docs" / "benchmarks"
DISTINCT_CHATS = BENCHMARKS / "2026-12-06-distinct-chats-h100.md"

# A run named by the letter the old README gave it: one capital, or A and a second up to H.
RUN_LETTER = re.compile(r"\b[Rr]uns?\s+(?:A[A-H]|[A-Z])\b")
# A dated file may say once which run it was, so that history can be traced.
FORMERLY = re.compile(r"^\(formerly runs? [^)\n]*\)$", re.MULTILINE)
CITED_BENCHMARK = re.compile(r"docs/benchmarks/[\w.-]+\.md")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]+\.md)(?:#[^)]*)?\)")
DATED_NAME = re.compile(r"\d{4}-\d{2}-\d{2}-[a-z0-9]+(?:-[a-z0-9]+)*\.md")
# Rows of more than one chat: "16 chats", "c16", "8 chats at once".
SEVERAL_CHATS = re.compile(r"\b(?:[2-9]|\d{2,}) chats\b|\bc(?:8|16|32)\b")
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?!\w)")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".sh", ".yml", ".yaml"}


def _text_files(*names: str) -> list[Path]:
    files: list[Path] = []
    for name in names:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    return files


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _run_letters(path: Path) -> list[str]:
    text = path.read_text()
    if path.parent == BENCHMARKS:
        text = FORMERLY.sub("", text)
    rel = path.relative_to(ROOT)
    return [f"{rel}:{_line_of(text, m.start())}: {m.group()!r}" for m in RUN_LETTER.finditer(text)]


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|") and not set(line) <= set("|-: ")]


def test_no_code_test_or_doc_cites_a_run_by_its_letter():
    files = _text_files("omni_local", "tests", "docs", "README.md", "app.py", "settings.toml")
    cited = [where for path in files for where in _run_letters(path)]
    assert cited == []


def test_a_benchmark_file_says_at_most_once_which_run_it_was():
    notes = {path.name: len(FORMERLY.findall(path.read_text())) for path in BENCHMARKS.glob("*.md")}
    assert {name: n for name, n in notes.items() if n > 1} == {}


def test_every_benchmark_file_the_repository_cites_exists():
    files = _text_files("omni_local", "tests", "docs", ".ci", "README.md", "app.py", "settings.toml", "pyproject.toml")
    cited = {m.group() for path in files for m in CITED_BENCHMARK.finditer(path.read_text())}
    assert cited, "nothing cites docs/benchmarks/: the pattern no longer matches"
    assert sorted(name for name in cited if not (ROOT / name).is_file()) == []


def test_every_link_between_the_docs_leads_to_a_file():
    missing = [
        f"{path.relative_to(ROOT)}: {target}"
        for path in _text_files("docs", "README.md")
        if path.suffix == ".md"
        for target in MARKDOWN_LINK.findall(path.read_text())
        if "://" not in target and not (path.parent / target).is_file()
    ]
    assert missing == []


def test_each_benchmark_file_is_dated_and_names_its_card_and_versions():
    files = sorted(BENCHMARKS.glob("*.md"))
    assert files
    for path in files:
        text = path.read_text()
        assert DATED_NAME.fullmatch(path.name), path.name
        assert text.startswith(f"# {path.name[:10]}"), path.name
        assert "- Card:" in text and "- Versions:" in text, path.name


def test_benchmark_files_before_the_distinct_chats_run_mark_their_rows_of_several_chats():
    """Before 2026-12-06 every chat of a concurrent row computed the same tokens: not what users see."""
    for path in sorted(BENCHMARKS.glob("*.md")):
        text = path.read_text()
        if path.name < DISTINCT_CHATS.name and any(SEVERAL_CHATS.search(row) for row in _table_rows(text)):
            assert "Measured on identical chats" in text and DISTINCT_CHATS.name in text, path.name


def test_performance_page_takes_its_figures_of_several_chats_from_the_distinct_chats_run():
    measured = set(NUMBER.findall(DISTINCT_CHATS.read_text()))
    page = (ROOT / "docs" / "performance.md").read_text()
    rows = [row for row in _table_rows(page) if SEVERAL_CHATS.search(row)]
    assert rows, "the page has no rows of several chats: the pattern no longer matches"
    for row in rows:
        figures = NUMBER.findall("|".join(row.split("|")[2:]))
        assert set(figures) <= measured, row
