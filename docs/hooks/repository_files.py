"""mkdocs hook: the repository files the docs pages link to (the recipes, BENCHMARKS.md) are published
with the site, so that those links resolve there as they do in the repository.

A page writes ``../recipes/quickstart.yaml`` (right on GitHub and in a checkout, where docs/ sits beside
recipes/); the site has no parent folder, so the hook adds each such file at the top of the site and
drops the ``../`` from the links to it before mkdocs validates them (``mkdocs build --strict`` then
fails on any link that still points nowhere).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ("BENCHMARKS.md", "recipes/*.yaml")
"""Files outside docs/ that pages link to, as globs from the repository root."""
_UP_TO_PUBLISHED = re.compile(r"\]\(\.\./((?:recipes/[\w.-]+\.yaml|BENCHMARKS\.md)(?:#[\w-]*)?)\)")


def on_files(files: Files, config: Any) -> Files:
    for pattern in PUBLISHED:
        for path in sorted(ROOT.glob(pattern)):
            files.append(File.generated(config, path.relative_to(ROOT).as_posix(), abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    return _UP_TO_PUBLISHED.sub(r"](\1)", markdown)
