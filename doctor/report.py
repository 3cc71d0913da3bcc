"""The doctor's findings as `kvwatch doctor` prints them."""

from __future__ import annotations

import textwrap

from kvwatch.doctor.findings import Diagnosis
from kvwatch.prometheus.pipeline import Link

LINK_WORDS = {"ok": "PASS", "broken": "FAIL", "unknown": "UNKNOWN"}


def format_diagnosis(diagnosis: Diagnosis) -> str:
    """One block per check, fixes under those that did not pass, then the causes."""
    lines = []
    for check in diagnosis.checks:
        # a skipped check's fix says how to have it judged
        lines += _block(check.status.upper(), check.name, check.evidence, check.status != "pass", check.fix)
    causes = diagnosis.causes
    lines += ["", f"causes: {', '.join(causes)}" if causes else "no cause found"]
    return "\n".join(lines)


def format_links(links: tuple[Link, ...]) -> str:
    """One block per link of kvwatch's pipeline (PASS, FAIL or UNKNOWN), its fix under any but PASS, then
    how many links are broken."""
    lines = []
    for link in links:
        lines += _block(LINK_WORDS[link.status], link.name, link.evidence, link.status != "ok", link.fix)
    troubled = sum(link.status != "ok" for link in links)
    lines += ["", f"{troubled} of {len(links)} links do not hold" if troubled else "every link holds"]
    return "\n".join(lines)


def _block(status: str, name: str, evidence: str, troubled: bool, fix: str) -> list[str]:
    """A finding's lines: `STATUS name: evidence`, wrapped, and its fix under it when `troubled`."""
    head = f"{status:<8} {name}: "
    lines = _wrapped(evidence, head, " " * 9) or [head]
    if fix and troubled:
        lines += _wrapped(fix, " " * 9 + "fix: ", " " * 14)
    return lines


def _wrapped(text: str, first: str, rest: str) -> list[str]:
    """`text` in lines of 110 characters, a path or URL whole on its line."""
    return textwrap.wrap(
        text,
        110,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )
