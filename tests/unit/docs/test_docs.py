"""The README and docs/ hold together: every relative link and image resolves, anchors included, and the
README stays a short front door with its screenshots near the top."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from paths import REPO

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300
SCREENSHOTS_WITHIN_LINES = 60
SCREENSHOTS = ["docs/dashboard-overview.png", "docs/dashboard-alerts.png"]
# Pages with an opening of their own: the reliability guarantees are kept section by section by each area.
OWN_OPENING = {"reliability.md"}

# [text](target) and ![alt](target); the text may hold one level of brackets or backticks.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`(?:[^`\n]|\n(?!\n))*`")  # a code span may go on over a line break
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text without code blocks and inline code, where brackets are no links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, spaces to `-`, punctuation but `-` and `_` dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken(page: Path, target: str) -> str | None:
    """Why a link of `page` does not resolve, or None when it does."""
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return f"{page.name}: {target}: no such file"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"{page.name}: {target}: no heading #{anchor} in {file.name}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_and_image_resolves(page):
    assert [why for target in relative_links(page) if (why := broken(page, target))] == []


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading, with punctuation!\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-code-heading-with-punctuation) [gone](missing.md) [bad anchor](other.md#nope)\n"
        "`[not a\nlink](nowhere.md)` [after code](gone.md)\n```\n[nor this](nowhere.md)\n```\n"
    )
    found = [broken(page, target) for target in relative_links(page)]
    assert found == [
        None,
        "page.md: missing.md: no such file",
        "page.md: other.md#nope: no heading #nope in other.md",
        "page.md: gone.md: no such file",
    ]


def test_github_slugs():
    assert slug("`kvwatch serve` at scale") == "kvwatch-serve-at-scale"
    assert slug("The A/B experiment on real vLLM") == "the-ab-experiment-on-real-vllm"
    assert slug("Exit codes, progress and version") == "exit-codes-progress-and-version"
    assert slug("max_sessions and time-outs") == "max_sessions-and-time-outs"


def test_the_readme_is_a_short_front_door():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_the_readme_shows_the_dashboard_and_a_firing_alert_near_the_top():
    top = "\n".join(README.read_text().splitlines()[:SCREENSHOTS_WITHIN_LINES])
    images = LINK.findall(" ".join(re.findall(r"!\[[^\]]*\]\([^)]*\)", top)))
    assert [shot for shot in SCREENSHOTS if shot not in images] == []
    assert all((REPO / shot).is_file() for shot in SCREENSHOTS)


def test_every_docs_page_says_what_it_is_for_and_links_back():
    for page in [page for page in PAGES[1:] if page.name not in OWN_OPENING]:
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# "), page.name
        assert "](../README.md)" in "\n".join(lines[:8]), page.name
