"""Every relative link in the README and docs/ reaches a file that exists, and
every ``#anchor`` a heading of it, the way GitHub names headings (lower case,
punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/*.md")])
LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)")


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    in_code = False
    for line in markdown.read_text().splitlines():
        in_code ^= line.startswith("```")
        heading = re.match(r"#{1,6} (.*)", line)
        if heading and not in_code:
            name = slug(heading.group(1))
            found.add(f"{name}-{counts[name]}" if counts.get(name) else name)
            counts[name] = counts.get(name, 0) + 1
    return found


@pytest.mark.parametrize("markdown", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(markdown):
    broken = []
    for path, anchor in LINK.findall(markdown.read_text()):
        if re.match(r"[a-z]+:", path):  # https:, mailto:
            continue
        target = (markdown.parent / path) if path else markdown
        if not target.exists():
            broken.append(f"{path}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{path}#{anchor}: no such heading")
    assert not broken, broken
