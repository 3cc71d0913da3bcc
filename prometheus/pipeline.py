"""Whether kvwatch can see: each link from the engines and `kvwatch serve` through Prometheus' rules to
Alertmanager, as Prometheus itself reports it. A blind kvwatch shows no alert firing, which reads as
health: the Overview (dashboard.data) and `kvwatch doctor --setup` ask here what it cannot see and why.

Each link is judged from Prometheus' own API (targets, rules, alertmanagers) and its series; a link whose
evidence Prometheus did not give is UNKNOWN, never OK."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvwatch.core.errors import UpstreamError
from kvwatch.core.promapi import PrometheusApi
from kvwatch.core.redaction import redact
from kvwatch.prometheus import queries
from kvwatch.prometheus.rules import RULE_GROUPS

OK, BROKEN, UNKNOWN = "ok", "broken", "unknown"
STATUSES = (OK, BROKEN, UNKNOWN)
MAX_NAMED = 3  # rules or targets a link's evidence names one by one


@dataclass(frozen=True)
class Link:
    """One link of kvwatch's pipeline: what was looked at, whether it holds, what shows it, what to do."""

    name: str
    status: str  # OK, BROKEN or UNKNOWN
    evidence: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}")


def links(prometheus: PrometheusApi, exporter_port: int) -> tuple[Link, ...]:
    """Every link Prometheus can tell of, in pipeline order: Prometheus answers, it scrapes kvwatch serve
    (listening on `exporter_port`) and the engines, evaluates kvwatch's rules, and sends alerts to an
    Alertmanager. Never raises: a link Prometheus did not answer for is UNKNOWN."""
    try:
        targets = prometheus.targets()
    except UpstreamError as error:
        down = Link(
            "Prometheus answers",
            BROKEN,
            f"Prometheus at {redact(prometheus.url)} did not answer: {error}.",
            "Start Prometheus, or set prometheus.url in the config to where it listens.",
        )
        unasked = f"Not asked: Prometheus at {redact(prometheus.url)} did not answer."
        return (down, *(Link(name, UNKNOWN, unasked) for name, _ in CHECKS))
    answers = Link("Prometheus answers", OK, f"Prometheus at {redact(prometheus.url)} answers its API.")
    return (answers, *(_judged(name, check, prometheus, targets, exporter_port) for name, check in CHECKS))


def _judged(name: str, check: Callable[..., Link], *evidence) -> Link:
    """The link `name` as `check` judges it from `evidence`; UNKNOWN where Prometheus fails to answer."""
    try:
        return check(name, *evidence)
    except UpstreamError as error:
        return Link(name, UNKNOWN, f"Prometheus did not answer: {error}.")


def exporter_scraped(name: str, prometheus: PrometheusApi, targets: list[dict], port: int) -> Link:
    """kvwatch serve is a scrape target that answers: a target on its port, else its own series."""
    ours = [t for t in targets if _port(t.get("scrapeUrl", "")) == port]
    up = [t for t in ours if t.get("health") == "up"]
    if up:
        return Link(name, OK, f"Prometheus scrapes kvwatch serve at {_named(up)}.")
    if ours:
        errors = "; ".join(f"{t.get('scrapeUrl')}: {t.get('lastError') or t.get('health')}" for t in ours)
        return Link(
            name,
            BROKEN,
            f"kvwatch serve's scrape target is down ({errors}).",
            "Start `kvwatch serve --config FILE`, and let Prometheus reach its exporter.listen.",
        )
    series = prometheus.query(queries.EXPORTER_SERIES)
    if series:
        sources = ", ".join(f"{s['metric'].get('job')} / {s['metric'].get('instance')}" for s in series)
        return Link(name, OK, f"Prometheus holds kvwatch serve's series, scraped as {sources}.")
    return Link(
        name,
        BROKEN,
        f"Prometheus has no scrape target on port {port} (exporter.listen) and holds none of kvwatch "
        "serve's series (kvwatch_*): it does not scrape kvwatch serve, so no probe result reaches it.",
        f"Add a scrape job for kvwatch serve's /metrics on port {port} to Prometheus' scrape_configs "
        'and reload it (docs/troubleshooting.md, "kvwatch doctor --setup").',
    )


def engines_scraped(name: str, prometheus: PrometheusApi, targets: list[dict], port: int) -> Link:
    """Prometheus holds the series of at least one vLLM or SGLang engine."""
    engines = prometheus.query(queries.ENGINES_SCRAPED)
    if engines:
        found = [f"{e['metric'].get('job')} / {e['metric'].get('instance')}" for e in engines]
        return Link(name, OK, f"{len(found)} engine(s) scraped: {_few(found)}.")
    return Link(
        name,
        BROKEN,
        "Prometheus holds no vLLM or SGLang engine series (vllm:num_requests_running, "
        "sglang:num_running_reqs): no cache hit ratio, load or engine alert can be judged.",
        "Add a scrape job for every engine's /metrics, with a `replica` label per target, to Prometheus' "
        "scrape_configs and reload it.",
    )


def rules_loaded(name: str, prometheus: PrometheusApi, targets: list[dict], port: int) -> Link:
    """kvwatch's rule groups are loaded, have been evaluated, and every rule of them evaluates."""
    groups = {g.get("name"): g for g in prometheus.rule_groups() if g.get("name") in RULE_GROUPS}
    missing = [f"{group} ({path})" for group, path in RULE_GROUPS.items() if group not in groups]
    if missing:
        return Link(
            name,
            BROKEN,
            f"Rule groups not loaded: {_few(missing)}: no kvwatch alert can fire.",
            "List alerts/kvwatch.rules.yml and prometheus/rules/*.yml under rule_files in prometheus.yml "
            "and reload Prometheus (check them first with `promtool check rules`).",
        )
    rules = [rule for group in groups.values() for rule in group.get("rules", [])]
    failing = [f"{_rule_name(r)}: {r.get('lastError')}" for r in rules if r.get("health") == "err"]
    if failing:
        return Link(
            name,
            BROKEN,
            f"{len(failing)} of kvwatch's rules fail to evaluate: {_few(failing)}.",
            "Regenerate the rule files with `kvwatch generate` for your Prometheus and reload it.",
        )
    unevaluated = [_rule_name(r) for r in rules if r.get("health") != "ok"]
    if unevaluated:
        return Link(name, UNKNOWN, f"Not evaluated yet: {_few(unevaluated)}; look again after an interval.")
    return Link(name, OK, f"{len(groups)} rule groups loaded, their {len(rules)} rules evaluate.")


def alertmanager_attached(name: str, prometheus: PrometheusApi, targets: list[dict], port: int) -> Link:
    """Prometheus sends its alerts to at least one Alertmanager. A rule engine without the Alertmanagers
    API (vmalert) is judged by the alerts it counts as sent, where the store scrapes it."""
    try:
        managers = [m.get("url", "?") for m in prometheus.alertmanagers()]
    except UpstreamError as error:
        if prometheus.rules_url == prometheus.url:
            raise
        return _alerts_sent(name, prometheus, error)
    if managers:
        return Link(name, OK, f"Alerts go to {_few(managers)}.")
    return Link(
        name,
        BROKEN,
        "Prometheus sends its alerts to no Alertmanager: a firing kvwatch alert reaches no one.",
        "Add your Alertmanager under alerting.alertmanagers in prometheus.yml and reload Prometheus.",
    )


def _alerts_sent(name: str, prometheus: PrometheusApi, unlisted: UpstreamError) -> Link:
    """The Alertmanagers the rule engine at prometheus.rules_url counts alerts sent to; it lists none."""
    engine = redact(prometheus.rules_url)
    counted = prometheus.query(queries.RULE_ENGINE_NOTIFIERS)
    sent = [series["metric"]["addr"] for series in counted if series["metric"].get("addr")]
    if sent:
        return Link(name, OK, f"The rule engine at {engine} has sent alerts to {_few(sent)}.")
    return Link(
        name,
        UNKNOWN,
        f"The rule engine at {engine} does not list its Alertmanagers ({unlisted}), and the store holds no "
        "vmalert_alerts_sent_total of it: whether a firing kvwatch alert reaches anyone is not known.",
        "Scrape the rule engine's /metrics (vmalert's counts the alerts it sends to each -notifier.url), "
        "and give it your Alertmanager with -notifier.url.",
    )


CHECKS = (
    ("Prometheus scrapes kvwatch serve", exporter_scraped),
    ("Prometheus scrapes the engines", engines_scraped),
    ("Prometheus evaluates kvwatch's rules", rules_loaded),
    ("Prometheus sends alerts to Alertmanager", alertmanager_attached),
)


def _port(url: str) -> int | None:
    try:
        parts = urlsplit(url)
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None


def _named(targets: list[dict]) -> str:
    return _few([f"{t.get('scrapeUrl')} (job {t.get('labels', {}).get('job')})" for t in targets])


def _rule_name(rule: dict) -> str:
    return str(rule.get("name") or rule.get("record") or "?")


def _few(items: list[str]) -> str:
    """The first MAX_NAMED items, and how many more."""
    shown = ", ".join(items[:MAX_NAMED])
    return shown if len(items) <= MAX_NAMED else f"{shown} and {len(items) - MAX_NAMED} more"
