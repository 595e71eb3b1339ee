"""The results pages under benchmarks/results/ carry their provenance.

benchmarks/results/index.md lists the topic pages (and, per claim, the page it comes from). Every page it links
exists and opens with the provenance header, before its first `## ` section:

    - **Command:** the exact command(s)
    - **Machine:** where it ran
    - **Date:** when (at least one YYYY-MM-DD)
    - **Commit:** the commit(s) (at least one abbreviated or full hash)

and has a "History" section below its current figures. Every commit hash quoted in a header must exist in this
checkout's git history (`git cat-file --batch-check`); that check is skipped where there is no .git or the clone is
shallow (an old commit may be absent there without being wrong). A `#anchor` on an index link must be a heading of
the linked page (MkDocs' slug). Unit tier: reads files, one `git` call.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "index.md"
FIELDS = ("Command", "Machine", "Date", "Commit")
# the topic pages the project agreed on (docs and README link them by these names)
TOPIC_PAGES = {"default_job.md", "pickcube.md", "vla_recipe.md", "pi0.md", "libero.md", "throughput.md", "gpu.md",
               "clusters.md", "suite_timings.md", "behaviour_kept.md"}
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s#]+\.md)(?:#([^)\s]+))?\)")


def header_fields(text: str) -> dict[str, str]:
    """The provenance header of a results page: {field: its text, continuation lines joined}.

    Reads the lines before the first `## ` heading; a field is a line `- **Name:** text`, continued by the indented
    lines after it. Raises ValueError naming what is missing or out of order (the order is FIELDS')."""
    head = text.split("\n## ", 1)[0]
    fields: dict[str, str] = {}
    current = None
    for line in head.splitlines():
        m = re.match(r"- \*\*(\w+):\*\*\s*(.*)", line)
        if m:
            current = m.group(1)
            fields[current] = m.group(2).strip()
        elif current and line.startswith("  ") and line.strip():
            fields[current] += " " + line.strip()
        else:
            current = None
    missing = [f for f in FIELDS if not fields.get(f)]
    if missing:
        raise ValueError(f"no provenance field(s) {missing} before the first '## ' section")
    order = [f for f in fields if f in FIELDS]
    if order != list(FIELDS):
        raise ValueError(f"provenance fields in the order {order}, expected {list(FIELDS)}")
    if not DATE.search(fields["Date"]):
        raise ValueError(f"Date has no YYYY-MM-DD: {fields['Date']!r}")
    if not HASH.search(fields["Commit"]):
        raise ValueError(f"Commit quotes no commit hash: {fields['Commit']!r}")
    return fields


def _slug(heading: str) -> str:
    """Python-Markdown's toc slugify (MkDocs' default)."""
    value = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def _anchors(text: str) -> set[str]:
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S)
    return {_slug(m.group(1).replace("`", "")) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M)}


def _index_links() -> list[tuple[str, str | None]]:
    return [(page, anchor or None) for page, anchor in LINK.findall(INDEX.read_text(encoding="utf-8"))]


def _pages() -> list[str]:
    return sorted({page for page, _ in _index_links()})


def test_the_index_lists_every_agreed_topic_page():
    assert TOPIC_PAGES <= set(_pages()), f"index.md does not link {sorted(TOPIC_PAGES - set(_pages()))}"


@pytest.mark.parametrize("page", _pages())
def test_a_listed_page_exists_with_its_provenance_header_and_history(page):
    path = RESULTS / page
    assert path.is_file(), f"index.md links {page}, which does not exist in benchmarks/results/"
    text = path.read_text(encoding="utf-8")
    try:
        header_fields(text)
    except ValueError as exc:
        pytest.fail(f"benchmarks/results/{page}: {exc}")
    assert "history" in _anchors(text), f"benchmarks/results/{page}: no 'History' section"


def test_index_anchors_are_headings_of_their_pages():
    bad = [f"{page}#{anchor}" for page, anchor in _index_links()
           if anchor and (RESULTS / page).is_file()
           and anchor not in _anchors((RESULTS / page).read_text(encoding="utf-8"))]
    assert not bad, f"index.md links anchors that are no heading of their page: {bad}"


def test_the_header_check_names_what_is_missing():
    good = "# T\n\n- **Command:** `x`\n- **Machine:** m\n- **Date:** 2026-12-05\n- **Commit:** abc1234 (and\n  def5678)\n\n## Current\n"
    assert header_fields(good)["Commit"] == "abc1234 (and def5678)"
    with pytest.raises(ValueError, match=r"\['Machine'\]"):
        header_fields(good.replace("- **Machine:** m\n", ""))
    swapped = good.replace("- **Command:** `x`\n- **Machine:** m\n", "- **Machine:** m\n- **Command:** `x`\n")
    with pytest.raises(ValueError, match="order"):
        header_fields(swapped)
    with pytest.raises(ValueError, match="no commit hash"):
        header_fields(good.replace("abc1234 (and\n  def5678)", "the latest"))
    with pytest.raises(ValueError, match="no provenance"):  # a field after the first section does not count
        header_fields(good.replace("- **Date:** 2026-12-05\n", "") + "- **Date:** 2026-12-05\n")


def _git_history_usable() -> str | None:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return "no .git or no git here"
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                         capture_output=True, text=True)
    if out.returncode != 0 or out.stdout.strip() != "false":
        return "a shallow clone (old commits may be absent)"
    return None


def test_every_commit_quoted_in_a_header_exists():
    why = _git_history_usable()
    if why:
        pytest.skip(why)
    quoted = {}
    for page in _pages():
        if (RESULTS / page).is_file():
            for h in HASH.findall(header_fields((RESULTS / page).read_text(encoding="utf-8"))["Commit"]):
                quoted.setdefault(h, page)
    query = "".join(f"{h}^{{commit}}\n" for h in sorted(quoted))
    out = subprocess.run(["git", "-C", str(ROOT), "cat-file", "--batch-check"], input=query, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    missing = [f"{h} ({quoted[h]})" for h, line in zip(sorted(quoted), out) if line.endswith("missing")]
    assert not missing, f"commits quoted in results page headers that are not in the history: {missing}"
