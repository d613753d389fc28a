"""The docs stay a user's docs: guides and one table of current figures, no
diary of passes, no raw data, short table cells, a layout that names every
folder; and the product code says what and why, with no machine's timings."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
USER_DOCS = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", *ROOT.glob("docs/*.md")])
PRODUCT = ("protocol", "backends", "clients", "gateway", "tools")


def tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def folders_under_tests(files: list[str]) -> set[str]:
    return {"/".join(path.split("/")[:2]) for path in files if path.startswith("tests/") and path.count("/") > 1}


def table_cells(markdown: str) -> list[str]:
    return [cell.strip() for line in markdown.splitlines() if line.startswith("|") for cell in line.split("|")[1:-1]]


def test_benchmarks_doc_is_short():
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= 300


def test_docs_hold_guides_and_what_they_show_only():
    texts = "\n".join(path.read_text() for path in USER_DOCS)
    for path in (ROOT / "docs").rglob("*"):
        if path.is_dir() or path.suffix == ".md":
            continue
        relative = path.relative_to(ROOT / "docs").as_posix()
        assert relative in texts, f"docs/{relative}: raw data belongs in records"


@pytest.mark.parametrize("markdown", USER_DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_dated_diary_headings(markdown):
    headings = [line for line in markdown.read_text().splitlines() if re.match(r"#{1,6} ", line)]
    diary = [h for h in headings if re.search(r"\b20\d\d-\d\d-\d\d\b|\b\w+th pass\b|\bpass\b.*\(", h, re.I)]
    assert not diary, diary


def test_readme_table_cells_are_short():
    long = [cell[:80] for cell in table_cells((ROOT / "README.md").read_text()) if len(cell) > 400]
    assert not long, long


def test_readme_layout_names_every_folder():
    readme = (ROOT / "README.md").read_text()
    files = tracked()
    folders = {path.split("/")[0] for path in files if "/" in path}
    test_folders = folders_under_tests(files)
    missing = [folder for folder in sorted(folders | test_folders) if f"`{folder}" not in readme]
    assert not missing, missing


def test_architecture_lists_every_test_folder():
    architecture = (ROOT / "ARCHITECTURE.md").read_text()
    test_folders = folders_under_tests(tracked())
    assert not [folder for folder in sorted(test_folders) if f"`{folder}`" not in architecture]


def test_readme_quotes_no_figure_of_its_own():
    """Figures live in docs/benchmarks.md's table, with their commands."""
    readme = (ROOT / "README.md").read_text()
    assert not re.findall(r"\d[\d.,]*\s*(?:img/s|tok/s|tokens/s|×)|\b\d\.\d\d of (?:direct|the)", readme)


def test_product_code_carries_no_machine_timings():
    pattern = re.compile(r"\bH[12]00s?\b|\w+th pass\b|docs/benchmarks\.md")
    found = [f"{path}:{n}" for path in tracked() if path.startswith(PRODUCT) and path.endswith(".py")
             for n, line in enumerate((ROOT / path).read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


def test_every_gpu_test_file_is_in_exactly_one_group_of_docs_gpu():
    """docs/gpu.md runs tests/gpu in groups that each fit a sitting on a lent GPU machine: a new file
    that no group names would never run."""
    section = (ROOT / "docs" / "gpu.md").read_text().split("## The GPU tests in groups", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"tests/gpu/(test_\w+\.py)", section)
    files = sorted(path.name for path in (ROOT / "tests" / "gpu").glob("test_*.py"))
    assert sorted(named) == files, "each file of tests/gpu once in docs/gpu.md's groups"
