"""The README is the front door and docs/ holds the rest: every relative link in them resolves to a
file (and a heading, for `page.md#anchor`), every docs page is linked from the README, and the
README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text without fenced blocks and inline code, where brackets are code, not links."""
    return _CODE.sub("", _FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -N for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(path: Path):
    for target in _LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, …
            continue
        yield target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert broken == []


def test_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    shown = [ln for ln in readme.splitlines() if not re.fullmatch(r"\s*<!--.*-->\s*", ln)]  # not rendered
    assert len(shown) <= README_MAX_LINES
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert unlinked == []
    assert "make test" in readme and "make demo" in readme


def test_the_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](page.md#title) [bad](missing.md) `[code](not-a-link.md)`\n")
    assert list(relative_links(page)) == ["page.md#title", "missing.md"]
    assert anchors(page) == {"title"}
