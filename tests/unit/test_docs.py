"""The README and the docs pages: every relative link resolves (a file of the repository, or a
heading of a page); ``tests/e2e/test_docs_commands.py`` runs their command blocks marked runnable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs make it: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return re.sub(r" ", "-", text)


def anchors(page: Path) -> set[str]:
    inside_code, found = False, set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            inside_code = not inside_code
        elif not inside_code and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def links(page: Path) -> list[str]:
    inside_code, found = False, []
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            inside_code = not inside_code
        elif not inside_code:
            found += LINK.findall(re.sub(r"`[^`]*`", "", line))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no file {resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    assert not broken, f"{page.name}: broken links: {broken}"
