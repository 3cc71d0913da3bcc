"""What `kvwatch probe` reports of its sessions: the tables an SRE reads, the JSON, and what to check
first for each error kind."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict

from kvwatch.collectors.probe.blocksize import BlockSize
from kvwatch.collectors.probe.lifecycle import life_of
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.collectors.probe.session import ProbeSettings, api_url
from kvwatch.core.redaction import redact
from kvwatch.core.stats import median

# One line per error kind: what to check first.
HINTS = {
    "unauthorized": "send `Authorization: Bearer <key>` (--api-key-env VAR or --api-key-file FILE); "
    "check the key and that it belongs to this endpoint",
    "forbidden": "the key is expired or not allowed to use this model: renew it, or ask for the model",
    "not_found": "check the model id (GET <base URL>/models lists them) and the base URL "
    "(the API root, with or without /v1)",
    "connection_refused": "nothing accepted the connection: check the gateway's host and port; "
    "inside a container, localhost is the container itself",
    "dns_error": "check the host name for a typo, and that this machine's DNS knows "
    "it (a cluster-internal name such as *.svc.cluster.local resolves only inside the cluster)",
    "timeout": "no complete answer in time: raise --timeout, or look at the gateway's and engines' load",
    "bad_response": "an error object came back instead of a completion: read its excerpt "
    "(wrong model, bad request body, stream and non-stream mixed up)",
    "stream_error": "the event stream broke: check that no proxy buffers or cuts it "
    "(nginx: proxy_buffering off, proxy_read_timeout)",
    "http_error": "the server answered with an error status: read the excerpt and the server's logs",
    "tls_error": "TLS failed, for the reason the detail gives: trust the server's CA (SSL_CERT_FILE), "
    "and use the host name its certificate names",
    "tls_mismatch": "the base URL's scheme is not what the port speaks: http:// for a plain-HTTP server, "
    "https:// for a TLS port (the detail says which)",
    "protocol_error": "the server's answer is not valid HTTP/1.1 (the detail names what): check what "
    "listens at the base URL and every proxy in front of it",
    "internal_error": "kvwatch failed unforeseen (a bug): report the detail, which names the exception "
    "and where it was raised",
    "model_stream_error": "the model's stream broke or timed out inside SageMaker (ModelStreamError): "
    "read its code; check the container's logs and the endpoint's invocation timeout",
    "internal_stream_failure": "SageMaker's stream failed on its side (InternalStreamFailure): retry; if it "
    "persists, check the endpoint's health in CloudWatch",
    "checksum_error": "an event-stream frame failed its CRC32 check: something between the endpoint and "
    "kvwatch alters the bytes (a proxy, a broken front)",
    "model_error": "the container answered an error status (SageMaker's ModelError): read the original "
    "status and message; a 400 'stateful sessions not enabled' needs SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true",
    "credentials_error": "botocore found no usable AWS credentials: set AWS_ACCESS_KEY_ID / "
    "AWS_SECRET_ACCESS_KEY, a profile (--aws-profile, AWS_PROFILE) or a role; never on the command line",
}


def session_json(session: SessionResult) -> dict:
    """A session as `kvwatch probe --json` prints it; each round's `error` is its error kind."""
    return {
        "target": session.target,
        "route_mode": session.route_mode,
        "session_id": session.session_id,
        "ok": session.ok,
        "error_kind": session.error_kind,
        "sticky": session.sticky,
        "evidence": session.evidence,
        "closed": session.closed,
        "session_losses": [{"round": n, "kind": kind} for n, kind in session.session_losses],
        "life": None
        if (life := life_of(session)) is None
        else {**asdict(life), "as_expected": life.as_expected},
        "close_gone": session.close_gone,
        "backends": list(session.backends),
        "backend_switches": session.backend_switches,
        "session_id_echoed": session.session_id_echoed,
        "started_at": session.started_at,
        "finished_at": session.finished_at,
        "rounds": [
            {("error" if key == "error_kind" else key): value for key, value in asdict(r).items()}
            for r in session.rounds
        ],
    }


def format_report(settings: ProbeSettings, sessions: list[SessionResult], block: BlockSize) -> str:
    """Per round across sessions, then per session: what an SRE reads first."""
    route, sessions_carried = route_description(settings)
    title = f"{len(sessions)} sessions through {route}, model {settings.model}, {sessions_carried}"
    rows = []
    for number in range(1, max((len(s.rounds) for s in sessions), default=0) + 1):
        rounds = [s.rounds[number - 1] for s in sessions if len(s.rounds) >= number]
        ok = [r for r in rounds if r.ok]
        ttfts = [r.ttft_seconds for r in ok if r.ttft_seconds is not None]
        errors = Counter(r.error_kind for r in rounds if r.error_kind)
        rows.append(
            (
                str(number),
                f"{median(ttfts) * 1000:.1f} ms" if ttfts else "-",
                f"{_total(r.cached_tokens for r in ok)} / {_total(r.ideal_cached_tokens for r in ok)}",
                ", ".join(sorted({r.backend for r in ok if r.backend})) or "unknown",
                ", ".join(f"{kind} x{count}" for kind, count in errors.items()) or "-",
            )
        )
    lines = [title, block.describe(), ""] + _table(
        ("round", "median TTFT", "cached / ideal tokens", "backends", "errors"), rows
    )
    rows = []
    for number, session in enumerate(sessions, start=1):
        failed = next((r for r in session.rounds if not r.ok), None)
        rows.append(
            (
                str(number),
                {True: "sticky", False: "NOT sticky", None: "unknown"}[session.sticky],
                session.evidence,
                f"{sum(r.ok for r in session.rounds)}",
                {True: "yes", False: "NO", None: "-"}[session.session_id_echoed],
                " > ".join(
                    name + (f" x{n}" if (n := len(list(run))) > 1 else "")
                    for name, run in itertools.groupby(session.backends)
                )
                or "unknown",
                f"{failed.error_kind} in round {failed.round}" if failed else "-",
            )
        )
    header = ("session", "stickiness", "evidence", "rounds ok", "id echoed", "backends", "error")
    lines += [""] + _table(header, rows)
    answered = [r for s in sessions for r in s.rounds if r.ok]
    if answered and not any(r.backend for r in answered):
        looked = ", ".join((*settings.backend_headers, *settings.backend_json_paths))
        lines += [
            "",
            f"No response named its replica ({looked}): stickiness is inferred from the cached tokens.",
        ]
    return "\n".join(lines + _session_lines(sessions))


def route_description(settings: ProbeSettings) -> tuple[str, str]:
    """The route as the report's title names it, and how its sessions are carried."""
    endpoint, mode = settings.sagemaker, settings.session_mode
    if endpoint is None:
        return redact(api_url(settings.base_url, "chat/completions")), f"session ids: {mode}"
    named = (
        ("region", endpoint.region),
        ("variant", endpoint.variant),
        ("component", endpoint.inference_component),
    )
    where = ", ".join(f"{key} {value}" for key, value in named if value)
    sessions = "no sessions" if mode == "none" else "stateful sessions"
    return f"SageMaker endpoint {endpoint.endpoint_name} ({where}) at {redact(settings.base_url)}", sessions


def _session_lines(sessions: list[SessionResult]) -> list[str]:
    """What happened to the route's sessions: those lost and opened anew, by kind, and those closed."""
    losses = Counter(kind for s in sessions for _, kind in s.session_losses)
    closable = [s.closed for s in sessions if s.closed is not None]
    lines = []
    if losses:
        counted = ", ".join(f"{kind} x{n}" for kind, n in sorted(losses.items()))
        lines.append(f"Sessions lost and opened anew before a round: {counted} (those rounds count as cold).")
    if closable:
        lines.append(f"Sessions closed at the end: {sum(closable)} of {len(closable)}.")
    lines += _life_lines(sessions)
    return [""] + lines if lines else []


def _life_lines(sessions: list[SessionResult]) -> list[str]:
    """Each idled session's life after the idle, and the closes checked (collectors.probe.lifecycle)."""
    lines = []
    for number, session in enumerate(sessions, start=1):
        if (life := life_of(session)) is None:
            continue
        woken = life.idled_after_round + 1
        expiry = f"the route said {life.expiry}" if life.expiry else "the route said nothing"
        cold = {
            True: "cold (a full prefill)",
            False: "WARM (the session outlived the idle)",
            None: "unjudged",
        }
        moved = {True: " on another replica", False: " on the same replica", None: ""}[life.new_replica]
        pinned = {True: "re-pinned", False: "NOT re-pinned", None: "no rounds after"}[life.repinned]
        verdict = {True: "as expected", False: "NOT as expected", None: "not judged"}[life.as_expected]
        lines.append(
            f"Session {number} idled {life.idle_seconds:g} s after round {life.idled_after_round}: {expiry}; "
            f"round {woken} {cold[life.cold]}{moved}; then {pinned}: {verdict}."
        )
    checked = [s.close_gone for s in sessions if s.close_gone is not None]
    if checked:
        alive = checked.count(False)
        left = f"; {alive} left ALIVE by their close" if alive else ""
        lines.append(f"Closed sessions gone afterwards: {sum(checked)} of {len(checked)}{left}.")
    return lines


def _total(values: Iterable[int | None]) -> str:
    values = list(values)
    return "n/a" if None in values else str(sum(values))


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def failure_hints(sessions: list[SessionResult]) -> list[str]:
    """One line per error kind seen: an example detail and what to check."""
    seen: dict[str, RoundResult] = {}
    for session in sessions:
        for r in session.rounds:
            if r.error_kind:
                seen.setdefault(r.error_kind, r)
    return [f"{kind} ({r.error_detail}): {HINTS[kind]}" for kind, r in seen.items()]
