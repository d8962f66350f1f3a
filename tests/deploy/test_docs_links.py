"""The user docs hold together: every relative link in README.md, docs/*.md and the lab
notebooks under bench/notes/ names a file that exists, the README stays short, and
docs/README.md lists every document in docs/."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200

# [text](target) and [text](target "title"); images too. Code spans and fenced blocks are
# dropped first: a link shown as code is not a link.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")


def relative_links(text: str) -> list[str]:
    """The link targets of a Markdown text that point into the repository (no scheme, no
    pure anchor), anchors and queries dropped."""
    text = _CODE.sub("", _FENCE.sub("", text))
    out = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "//")):
            continue  # http:, https:, mailto: ...; an anchor in the same page
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path:
            out.append(path)
    return out


def broken_links(md: Path) -> list[str]:
    return [t for t in relative_links(md.read_text(encoding="utf-8")) if not (md.parent / t).exists()]


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench" / "notes").glob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_readme_is_short() -> None:
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; the rest belongs in docs/ (docs/README.md maps it)"


def test_the_docs_map_lists_every_document() -> None:
    listed = set(relative_links((ROOT / "docs" / "README.md").read_text(encoding="utf-8")))
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "README.md" and p.name not in listed]
    assert missing == [], f"docs/README.md does not link {missing}"


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The link reader finds what it must (and skips what is not a repository link)."""
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[a](there.md#part) [b](missing.md) ![c](img/none.png \"t\") [d](https://x.org/y.md) "
                    "[e](#local) `[f](in-code.md)`\n```\n[g](in-fence.md)\n```\n")
    assert broken_links(page) == ["missing.md", "img/none.png"]
