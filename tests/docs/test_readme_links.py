"""The README and the documentation pages: every relative link resolves, and no page carries project history.

A link is a Markdown inline link or image, `[text](target)` / `![alt](target)`, outside code blocks and code spans.
A relative target must name a file or folder of the checkout, resolved from the page's own folder (docs/results is
the link to benchmarks/results/ that makes the results pages part of the site); a `#anchor` on a Markdown target must
be one of that page's headings, slugified as MkDocs' `toc` extension does (Python-Markdown's `slugify`). External
links (`http(s)://`, `mailto:`) are not fetched. `mkdocs build --strict` (.ci/run) checks the site's own pages the
same way; this test also covers the README, which is not a page of the site, and runs in the unit tier.

User docs quote measured figures only through links to their results pages, so they carry no dates, run ids,
commit hashes or issue numbers (those live on the results pages): the second test looks for each of those shapes.
The generated reference pages (docs/reference/), the results pages and the changelog (docs/changelog.md, a link to
CHANGELOG.md) are left out of both scans: their owners' tests and the strict build cover them.
"""
from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"reference", "results"}  # generated / results pages: checked by their own tests and the strict build
# docs/changelog.md is a link to CHANGELOG.md (its owner dates its entries): links to pages elsewhere are left out too


def _pages() -> list[Path]:
    """README.md and every hand-written Markdown page under docs/ (not following the docs/results link)."""
    pages = [ROOT / "README.md"]
    for folder, dirs, files in os.walk(ROOT / "docs"):
        if Path(folder) == ROOT / "docs":
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        pages += [Path(folder) / f for f in sorted(files)
                  if f.endswith(".md") and not os.path.islink(Path(folder) / f)]  # changelog.md: CHANGELOG.md
    return pages


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (commands and outputs are not links)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _links(page: Path) -> list[str]:
    return LINK.findall(_prose(page.read_text(encoding="utf-8")))


def _slug(heading: str) -> str:
    """Python-Markdown's toc `slugify` (MkDocs' default): NFKD to ASCII, drop non-word characters, lower case,
    runs of spaces and hyphens to one hyphen."""
    value = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def _anchors(page: Path) -> set[str]:
    """The slugs of a Markdown page's headings (`#`-style, outside code blocks; inline code kept as its text)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M)
    return {_slug(re.sub(r"[`*_]", "", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h))) for h in headings}


def _problems(page: Path) -> list[str]:
    problems = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = page if not path else (page.parent / path)
        if not dest.exists():
            problems.append(f"{target}: no such file ({dest.relative_to(ROOT) if ROOT in dest.parents else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"{target}: {dest.name} has no heading '#{anchor}'")
    return problems


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    problems = _problems(page)
    assert not problems, f"{page.relative_to(ROOT)}: broken links:\n  " + "\n  ".join(problems)


def test_the_link_check_finds_what_it_should(tmp_path: Path):
    """The checker itself: a resolving link, a missing file, a missing anchor, a link inside code (ignored)."""
    (tmp_path / "b.md").write_text("# Heading One\n\n## Older run directories\n", encoding="utf-8")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#older-run-directories) ![img](b.md) [gone](c.md) [bad](b.md#nope)\n"
                    "`[code](d.md)`\n```\n[block](e.md)\n```\n[web](https://example.org/x.md)\n", encoding="utf-8")
    problems = _problems(page)
    assert [p.split(":")[0] for p in problems] == ["c.md", "b.md#nope"]


HISTORY = {
    "a date": re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b"),
    "a run id": re.compile(r"\b\d{8}-\d{6}-[0-9a-f]{4}\b"),
    "an issue number": re.compile(r"\bissues?\s+#?\d+|(?<![\w&])#\d+\b", re.I),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
}


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_carry_no_project_history(page: Path):
    text = page.read_text(encoding="utf-8")
    found = [f"{what}: {m.group(0)!r}" for what, rx in HISTORY.items() for m in rx.finditer(text)]
    assert not found, (f"{page.relative_to(ROOT)} quotes project history ({'; '.join(found)}): user docs link to a "
                       "results page under benchmarks/results/ instead, which carries the date, commit and run ids")
