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


LIBRARY_TESTS = ("test_transformers_apex.py", "test_lightning_apex.py", "test_mmengine_runner.py", "test_deepspeed_amp.py")


def test_the_apex_compatibility_table_names_existing_tests_and_every_library_test():
    """Each row of "Libraries that still import apex" cites the test that runs it; each library's test,
    and each pattern of tests/apex_importer_patterns.py, has its row."""
    page = (ROOT / "docs" / "migrating-from-apex.md").read_text(encoding="utf-8")
    table = page.split("## Libraries that still import apex", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| library") and "---" not in line]
    cited = [re.findall(r"`(tests/[^`]+\.py)`", row.rsplit("|", 2)[-2]) for row in rows]
    assert rows and all(cited), f"rows without a test: {[row[:60] for row, tests in zip(rows, cited) if not tests]}"
    for test in {test for tests in cited for test in tests}:
        assert (ROOT / test).is_file(), f"the table cites {test}, which does not exist"
    for name in LIBRARY_TESTS:
        assert f"tests/e2e/{name}" in table, f"tests/e2e/{name} has no row in the compatibility table"
    patterns = re.search(r"PATTERNS = \{(.*?)\}", (ROOT / "tests" / "apex_importer_patterns.py").read_text(), re.S).group(1)
    library_of = {"bert-pretraining": "run_pretraining.py", "bert-squad": "run_squad.py", "gnmt": "GNMT", "ssd": "SSD",
                  "colossalai": "ColossalAI", "deepspeed": "DeepSpeed", "opennmt": "OpenNMT-py", "fairseq": "fairseq"}  # fmt: skip
    for pattern in re.findall(r'"([a-z-]+)":', patterns):
        assert pattern in library_of and library_of[pattern] in table, f"pattern {pattern!r} has no row in the compatibility table"
