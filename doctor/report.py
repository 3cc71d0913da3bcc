"""The doctor's findings as `kvwatch doctor` prints them."""

from __future__ import annotations

import textwrap

from kvwatch.doctor.findings import Diagnosis


def format_diagnosis(diagnosis: Diagnosis) -> str:
    """One block per check, fixes under those that did not pass, then the causes."""
    lines = []
    for check in diagnosis.checks:
        head = f"{check.status.upper():<8} {check.name}: "
        lines += textwrap.wrap(check.evidence, 110, initial_indent=head, subsequent_indent=" " * 9) or [head]
        if check.fix and check.status != "pass":  # a skipped check's fix says how to have it judged
            lines += textwrap.wrap(
                check.fix, 110, initial_indent=" " * 9 + "fix: ", subsequent_indent=" " * 14
            )
    causes = diagnosis.causes
    lines += ["", f"causes: {', '.join(causes)}" if causes else "no cause found"]
    return "\n".join(lines)
