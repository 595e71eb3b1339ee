"""CHANGELOG.md (also the site's changelog page, docs/changelog.md) reads newest first and speaks to users.

Its `## ` sections are an optional `Unreleased` first, then dated sections (`## YYYY-MM-DD`, or a range/pair whose
first date is the section's) in strictly decreasing order; every dated section has at least one entry. It quotes no
internal issue numbers and no commit hashes: those are the project's history, not what a user of a run or conf needs
(the results pages under benchmarks/results/ carry the commits of measurements). Unit tier: reads one file.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = ROOT / "CHANGELOG.md"
DATE = re.compile(r"\b(20\d\d-[01]\d-[0-3]\d)\b")


def sections(text: str) -> list[tuple[str, str]]:
    """[(heading, body)] of the `## ` sections, in file order (fenced code ignored)."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S)
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return [(parts[i].strip(), parts[i + 1]) for i in range(1, len(parts), 2)]


def order_problems(heads: list[str]) -> list[str]:
    """What breaks "Unreleased first, then dates newest first" in a list of section headings."""
    problems, last = [], None
    for i, head in enumerate(heads):
        if head == "Unreleased":
            if i != 0:
                problems.append(f"'Unreleased' is section {i + 1}, not the first")
            continue
        m = DATE.search(head)
        if not m:
            problems.append(f"section {head!r} has no YYYY-MM-DD")
            continue
        if last is not None and m.group(1) >= last:
            problems.append(f"section {head!r} is not older than the one before ({last})")
        last = m.group(1)
    return problems


def test_sections_are_unreleased_then_dates_newest_first():
    secs = sections(CHANGELOG.read_text(encoding="utf-8"))
    assert secs, "CHANGELOG.md has no '## ' sections"
    assert not order_problems([h for h, _ in secs])
    empty = [h for h, body in secs if not re.search(r"^\s*- ", body, flags=re.M)]
    assert not empty, f"sections without an entry: {empty}"


def test_the_order_check_catches_a_misplaced_section():
    assert order_problems(["Unreleased", "2026-12-07", "2026-12-05 and 2026-12-06", "2026-11-29"]) == []
    assert order_problems(["2026-12-05", "2026-12-07"])  # older first
    assert order_problems(["2026-12-07", "Unreleased"])  # Unreleased not first
    assert order_problems(["Later"])  # no date


def test_no_issue_numbers_or_commit_hashes():
    text = CHANGELOG.read_text(encoding="utf-8")
    issues = re.findall(r"\bissues?\s+#?\d+|(?<![\w&])#\d+\b", text, flags=re.I)
    # a hash-like word: 7-40 hex digits with at least one letter and one digit (not a plain number or word)
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert not issues and not hashes, f"CHANGELOG.md quotes project history: {issues + hashes}"
