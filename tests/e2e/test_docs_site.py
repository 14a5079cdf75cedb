"""The built docs site has no broken link: every relative href and src of every page (the navigation,
the API reference, the recipes and BENCHMARKS.md published beside the pages) names a file of the site,
and every #anchor an id in its page. mkdocs' own checks see the markdown; this reads the HTML it made."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (pip install -e '.[docs]')")


class Links(HTMLParser):
    """The ids of a page and the targets of its links (href, src)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.targets: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            elif name in ("href", "src") and value:
                self.targets.append(value)


def parsed(page: Path) -> Links:
    links = Links()
    links.feed(page.read_text(encoding="utf-8", errors="replace"))
    return links


def broken_links(site: Path) -> list[str]:
    pages = {page: parsed(page) for page in site.rglob("*.html")}
    broken = []
    for page, links in pages.items():
        for target in links.targets:
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or target.startswith(("mailto:", "javascript:")):
                continue
            base = site if parts.path.startswith("/") else page.parent  # /css/theme.css: from the site's root (the 404 page)
            path = (base / unquote(parts.path).lstrip("/")).resolve() if parts.path else page
            if path.is_dir():
                path = path / "index.html"
            if not path.exists():
                broken.append(f"{page.relative_to(site)}: {target} (no file)")
            elif parts.fragment and path.suffix == ".html" and unquote(parts.fragment) not in pages.get(path, parsed(path)).ids:
                broken.append(f"{page.relative_to(site)}: {target} (no id #{parts.fragment})")
    return broken


@pytest.mark.timeout(300)
def test_the_built_site_has_no_broken_link(tmp_path):
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                           capture_output=True, text=True, timeout=240, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    assert (site / "recipes" / "quickstart.yaml").is_file() and (site / "BENCHMARKS" / "index.html").is_file()
    broken = broken_links(site)
    assert not broken, "\n".join(broken[:40])
