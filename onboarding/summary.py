"""What `kvwatch init` prints: what it found, what it assumed, what it wrote and what to do next."""

from __future__ import annotations

from pathlib import Path

from kvwatch.core.naming import replica_name
from kvwatch.onboarding.survey import Survey
from kvwatch.onboarding.writers import ALERTMANAGER, CONFIG, PROMETHEUS, RULES, TOKEN, Layout


def found_lines(found: Survey) -> list[str]:
    """One line per thing learned, in the order it was looked at."""
    request = found.request
    header = request.session_header
    echo = {True: "echoed unchanged", False: "not echoed", None: "not sent"}[found.session_echoed]
    assigns = "assigns its own" if found.session_assigned else "assigns none"
    backends = sorted(set(found.backends))
    where = (
        f"{'stayed on' if found.sticky else 'moved between'} {', '.join(backends)}"
        if backends
        else "replica unknown"
    )
    lines = [
        f"models: {', '.join(found.models)} (using {found.model})",
        f"session id: {header} {echo}; without one the gateway {assigns}; session.mode {found.session_mode}",
        f"replica identity: {found.identity_header} ({found.identity_convention} convention)"
        if found.identity_header
        else "replica identity: none in the answers",
        f"a {len(found.backends)}-round probe session {where}",
    ]
    if request.prometheus_url:
        engines = ", ".join(replica_name(e.instance, e.replica) for e in found.engines) or "none"
        lines.append(f"engines in Prometheus: {engines}")
        lines.append(f"routers in Prometheus: {', '.join(r.instance for r in found.routers) or 'none'}")
    if found.block:
        lines.append(found.block.describe())
    return lines


def summary(found: Survey, layout: Layout, written: list[Path]) -> str:
    """The whole summary: found, assumed, written, next steps."""
    directory = layout.directory
    out = ["Found:", *(f"  {line}" for line in found_lines(found))]
    if found.assumed:
        out += ["Assumed (check these):", *(f"  {line}" for line in found.assumed)]
    out += ["Wrote:", *(f"  {path}" for path in written)]
    exporter = layout.exporter_address
    out += [
        "Next:",
        f"  kvwatch config check {directory / CONFIG} && kvwatch serve --config {directory / CONFIG}",
        f"  Prometheus: merge {directory / PROMETHEUS} into yours and copy {directory / RULES}/ beside it; "
        f"it must reach kvwatch at {exporter}",
        f"  Alertmanager: merge {directory / ALERTMANAGER} into yours; it sends the token in "
        f"{directory / TOKEN}",
        f"  then: kvwatch dashboard --config {directory / CONFIG}",
    ]
    if layout.api_key_env:
        out.append(f"  kvwatch serve reads the API key from ${layout.api_key_env}: set it where serve runs")
    return "\n".join(out)
