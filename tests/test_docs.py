"""The README is a front page and ``docs/`` the manual: no broken link or image anywhere in them,
every capability page linked from the README, and the README short (issue 27: <= 200 lines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: a Markdown link or image: [text](target) / ![alt](target)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _targets(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks are no links
    return [t for t in LINK.findall(text) if not t.startswith(("http://", "https://", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_image_resolves(page: Path) -> None:
    broken = []
    for target in _targets(page):
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            broken.append(target)
    assert broken == [], f"{page.relative_to(ROOT)}: broken links {broken}"


def test_readme_is_a_front_page_linking_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    linked = {Path(t.split("#", 1)[0]).name for t in _targets(ROOT / "README.md")}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), "docs pages the README does not link"


def test_the_link_check_finds_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text("[a](there.md) ![b](missing.png) [c](https://x.org) `[d](no.md)`\n")
    targets = _targets(page)
    assert targets == ["there.md", "missing.png", "no.md"]  # inline code is checked too
    assert [t for t in targets if not (tmp_path / t).exists()] == ["missing.png", "no.md"]
