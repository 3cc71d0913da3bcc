"""Detection latency: from a fault in the lab's faults.log to its alert at kvwatch's webhook, and its floor.

Every fault runs at two settings (the real-traffic lab, whose row is about production timers, at the
first only): the shipped production defaults (rules and Alertmanager timers as
shipped, probes every 30 s, the lab's 5 s scrape and evaluation) and the lab's fast test settings (--fast:
1 s scrape and evaluation, probes every 5 s, --rule-time-scale 0.1). Labs run side by side, each a few
faults one after another; before the next fault starts, every alert it or a later fault must raise
has resolved at the webhook, whichever fault raised it: an alert still held by keep_firing_for when the
next fault breaks the same thing never resolves, and Alertmanager sends an alert that stays firing again
only after its route's repeat_interval (an hour for critical ones). Its group must be gone too, so
that the next alert waits group_wait as a first one does. Faults injected together touch disjoint
replicas and alerts.

The floor of each row comes from the config files the lab ran (read from its state directory): the
rule's `for` and the Alertmanager route's group_wait, plus up to one probe interval (for alerts on probe
results), one scrape interval and one evaluation interval, by where the fault falls between their ticks:
a detection within that range took nothing but the pipeline's own steps. Rate windows and the
gateway-spread window come on top, so the hit-ratio and spread rows sit above it.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvwatch.core.promapi import PrometheusApi
from kvwatch.lab.process import kvwatch_command
from kvwatch.store.history import Store

REPO = Path(__file__).resolve().parent.parent
QUIET_TIMEOUT_S = 600
ALERTMANAGER_MAINTENANCE_S = 30  # how often Alertmanager drops the groups whose alerts all resolved
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_MATCHER = re.compile(r'\s*(\w+)\s*(=~|!~|!=|=)\s*"(.*)"\s*')


@dataclass(frozen=True, eq=False)
class Case:
    """A fault and the alert it must raise (with these labels); no alert: it must raise none but Watchdog."""

    fault: tuple[str, ...]
    alertname: str | None = None
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return " ".join(self.fault)


@dataclass(frozen=True)
class LabRun:
    """One lab: its options, how long it runs healthy first, and its batches of faults injected together."""

    name: str
    options: tuple[str, ...]
    warmup_s: float
    batches: tuple[tuple[Case, ...], ...]


AFFINITY = {"target": "lab-affinity"}
BREAK_AFFINITY = Case(("break-affinity",), "KVWatchSessionAffinityBroken", AFFINITY)
HASH_REQUEST_ID = Case(("hash-request-id",), "KVWatchSessionAffinityBroken", AFFINITY)
DROP_SESSION_HEADER = Case(
    ("drop-session-header",), "KVWatchSessionIdNotPropagated", {**AFFINITY, "source": "probe"}
)
DYNAMIC_PREFIX = Case(("dynamic-prefix",), "KVWatchPrefixCacheHitRateDrop", {"scope": "cluster"})
KILL_REPLICA = Case(("kill-replica", "r3"), "KVWatchTargetDown", {"replica": "r3"})
RESTART_REPLICA = Case(("restart-replica", "r4"))
SCALE_OUT = Case(("scale-out",))
# r1 is vLLM-flavoured: its cache_config_info says prefix caching is off. r2 is SGLang-flavoured, with no
# such gauge: only its own hit ratio's drop tells.
CACHING_OFF = Case(
    ("disable-prefix-cache", "--replica", "r1"), "KVWatchPrefixCachingDisabled", {"replica": "r1"}
)
CACHING_OFF_UNREPORTED = Case(
    ("disable-prefix-cache", "--replica", "r2"),
    "KVWatchPrefixCacheHitRateDrop",
    {"scope": "instance", "replica": "r2"},
)
GATEWAY_SPREAD = Case(("break-affinity",), "KVWatchGatewaySessionsSpread", {"log": "affinity"})
GATEWAY_MOVED = Case(("break-affinity",), "KVWatchGatewaySessionsMoved", {"log": "affinity"})
RESTART_REPLICA_R2 = Case(("restart-replica", "r2"))

# The alert tests' lab: enough users that their traffic outweighs the probes'.
PROBED = (
    "--replicas",
    "4",
    "--flavours",
    "vllm,sglang",
    "--users",
    "8",
    "--think",
    "0.2",
    "--time-scale",
    "0.3",
)
# The real-sessions test's lab: as many users as replicas would let a broken gateway's strict round
# robin send each user's next request to the same replica, so the counts are coprime.
UNPROBED = ("--replicas", "3", "--users", "4", "--think", "0.2", "--time-scale", "0.2", "--no-probes")
# The real-traffic lab: 20 users through the affinity gateway, each back about every 50 s, so about 20
# sessions come back a minute, one request each; no probes. A restart must raise nothing there.
REAL_TRAFFIC = ("--replicas", "3", "--users", "20", "--think", "50", "--time-scale", "0.2", "--no-probes")
PRODUCTION = ()
FAST = ("--fast", "--rule-time-scale", "0.1")
# The hit-ratio alert compares with the ratio's own past: an hour before the last 10 minutes (6 minutes
# before the last minute when fast); a lab younger than that offset has no past to compare with.
PAST_S = {PRODUCTION: 660, FAST: 120}
SPREAD_PAST_S = 120  # healthy sessions in the spread window, as the real-sessions test's lab has
REAL_TRAFFIC_PAST_S = 180  # every user has started and come back at least once
SETTINGS = {PRODUCTION: "production defaults", FAST: "lab fast"}

# Lanes run side by side; each runs its labs one after another. About 20 minutes in all.
LANES = (
    (LabRun("probed", PRODUCTION, PAST_S[PRODUCTION], ((DYNAMIC_PREFIX,),)),),
    (
        LabRun(
            "probed",
            PRODUCTION,
            0,
            ((RESTART_REPLICA, SCALE_OUT), (BREAK_AFFINITY,), (HASH_REQUEST_ID,), (DROP_SESSION_HEADER,)),
        ),
        LabRun("unprobed", PRODUCTION, SPREAD_PAST_S, ((GATEWAY_SPREAD,),)),
    ),
    (
        LabRun("probed", PRODUCTION, 0, ((KILL_REPLICA,), (CACHING_OFF, CACHING_OFF_UNREPORTED))),
        LabRun(
            "probed",
            FAST,
            PAST_S[FAST],
            (
                (DYNAMIC_PREFIX,),
                (RESTART_REPLICA, SCALE_OUT),
                (BREAK_AFFINITY,),
                (HASH_REQUEST_ID,),
                (DROP_SESSION_HEADER,),
                (KILL_REPLICA,),
                (CACHING_OFF, CACHING_OFF_UNREPORTED),
            ),
        ),
        LabRun("unprobed", FAST, SPREAD_PAST_S, ((GATEWAY_SPREAD,),)),
    ),
    (LabRun("real traffic", PRODUCTION, REAL_TRAFFIC_PAST_S, ((RESTART_REPLICA_R2,), (GATEWAY_MOVED,))),),
)
LAB_OPTIONS = {"probed": PROBED, "unprobed": UNPROBED, "real traffic": REAL_TRAFFIC}
NO_PROBES = {"unprobed": "`--no-probes`", "real traffic": "`--no-probes`, 20 users back every ~50 s"}


def seconds(duration: str) -> float:
    """A Prometheus or Alertmanager duration (`1m30s`, `0m`) in seconds."""
    if not re.fullmatch(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d))+", duration):
        raise ValueError(f"not a duration: {duration!r}")
    return sum(float(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION.findall(duration))


def _matches(matcher: str, labels: dict[str, str]) -> bool:
    name, op, value = _MATCHER.fullmatch(matcher).groups()
    have = labels.get(name, "")
    if op in ("=", "!="):
        return (have == value) == (op == "=")
    return bool(re.fullmatch(value, have)) == (op == "=~")


def group_wait(route: dict, labels: dict[str, str]) -> float:
    """The group_wait of the Alertmanager route that takes an alert with these labels (the first matching
    child route, depth first, inheriting what it does not set)."""
    wait = seconds(route.get("group_wait", "30s"))
    while child := next(
        (c for c in route.get("routes", []) if all(_matches(m, labels) for m in c.get("matchers", []))), None
    ):
        route, wait = child, seconds(child.get("group_wait", f"{wait}s"))
    return wait


@dataclass(frozen=True)
class Floor:
    """What a lab's config makes the fastest detection: the rule's `for` and the route's group_wait, plus up
    to one probe interval (for alerts on probe results), one scrape and one evaluation, by how the fault
    falls between their ticks."""

    probe_s: float
    scrape_s: float
    evaluation_s: float
    for_s: float
    group_wait_s: float

    @property
    def earliest(self) -> float:
        return self.for_s + self.group_wait_s

    @property
    def latest(self) -> float:
        return self.earliest + self.probe_s + self.scrape_s + self.evaluation_s

    def __str__(self) -> str:
        parts = (self.probe_s, self.scrape_s, self.evaluation_s, self.for_s, self.group_wait_s)
        return f"{self.earliest:.0f}-{self.latest:.0f} s ({'+'.join(f'{part:g}' for part in parts)})"


def floor(state_dir: Path, case: Case) -> Floor:
    """The floor of a case's alert from the config files the lab wrote: the fastest rule of that name
    whose own labels the case's labels carry."""
    prometheus = yaml.safe_load((state_dir / "prometheus.yml").read_text())["global"]
    candidates = []
    for path in sorted((state_dir / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            evaluation = seconds(group.get("interval", prometheus["evaluation_interval"]))
            for rule in group["rules"]:
                own = rule.get("labels", {})
                if rule.get("alert") == case.alertname and all(
                    case.labels.get(k, v) == v for k, v in own.items()
                ):
                    candidates.append((seconds(rule.get("for", "0s")), evaluation, rule["expr"], own))
    if not candidates:
        raise LookupError(f"no rule {case.alertname} with labels {case.labels} in {state_dir / 'rules'}")
    for_s, evaluation, expr, own = min(candidates, key=lambda c: c[0] + c[1])
    probe = 0.0
    if "kvwatch_probe_" in expr:
        targets = yaml.safe_load((state_dir / "kvwatch.yaml").read_text())["targets"]
        probe = next(t["interval_seconds"] for t in targets if t["name"] == case.labels["target"])
    route = yaml.safe_load((state_dir / "alertmanager.yml").read_text())["route"]
    return Floor(
        probe_s=float(probe),
        scrape_s=seconds(prometheus["scrape_interval"]),
        evaluation_s=evaluation,
        for_s=for_s,
        group_wait_s=group_wait(route, {**own, "alertname": case.alertname}),
    )


def _kvwatch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        kvwatch_command(*args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


_PORTS = threading.Lock()


def _lab_up(state_dir: Path, options: tuple[str, ...]) -> None:
    """Start a lab on the first free block of ports (one lab at a time, so that side-by-side labs do not
    pick the same block)."""
    with _PORTS:
        for base in range(24000, 32000, 100):
            with socket.socket() as sock:
                if any(sock.connect_ex(("127.0.0.1", port)) == 0 for port in (base, base + 10)):
                    continue
            up = _kvwatch("lab", "up", "--detach", "--no-dashboard", *options, "--base-port", str(base),
                          "--state-dir", str(state_dir))  # fmt: skip
            if up.returncode != 0:
                raise RuntimeError(f"lab up failed: {up.stderr[-2000:]}")
            return
    raise RuntimeError("no free ports")


def _alerts(state_dir: Path, since: float) -> list[dict]:
    with Store(state_dir / "kvwatch.db", readonly=True) as store:
        return [a for a in store.alerts(since=since) if a["alertname"] != "Watchdog"]


def _wanted(state_dir: Path, case: Case) -> dict[str, str]:
    """The case's labels, a replica id named by its instance: not every rule keeps the replica label."""
    wanted = dict(case.labels)
    if replica := wanted.pop("replica", None):
        replicas = json.loads((state_dir / "state.json").read_text())["replicas"]
        wanted["instance"] = next(f"127.0.0.1:{r['port']}" for r in replicas if r["id"] == replica)
    return wanted


def _fires(alert: dict, alertname: str, wanted: dict[str, str]) -> bool:
    return (
        alert["status"] == "firing"
        and alert["alertname"] == alertname
        and all(alert["labels"].get(k) == v for k, v in wanted.items())
    )


def _inject(state_dir: Path, case: Case) -> float:
    result = _kvwatch("lab", "fault", *case.fault, "--state-dir", str(state_dir))
    if result.returncode != 0:
        raise RuntimeError(f"fault {case.name} failed: {result.stderr[-2000:]}")
    return json.loads((state_dir / "faults.log").read_text().splitlines()[-1])["unix"]


def _measure_batch(state_dir: Path, batch: tuple[Case, ...], floors: dict[Case, Floor]) -> dict[Case, str]:
    """Inject a batch's faults, then wait for each one's alert; a fault that must raise nothing is watched
    for three minutes at production timers (scaled with the rules)."""
    injected = {case: _inject(state_dir, case) for case in batch}
    expected = [c for c in batch if c.alertname]
    timeout = max((2 * floors[c].latest + 300 for c in expected), default=0.0)
    watch = 180 * _scale(state_dir)
    deadline = time.monotonic() + max(timeout, watch)
    wanted = {case: _wanted(state_dir, case) for case in expected}
    found: dict[Case, str] = {}
    while time.monotonic() < deadline and len(found) < len(expected):
        alerts = _alerts(state_dir, min(injected.values()))
        for case in expected:
            hit = next(
                (
                    a
                    for a in reversed(alerts)
                    if _fires(a, case.alertname, wanted[case]) and a["received_at"] >= injected[case]
                ),
                None,
            )
            if hit and case not in found:
                found[case] = f"{hit['received_at'] - injected[case]:.0f} s"
        time.sleep(0.5)
    found.update({c: "not detected" for c in expected if c not in found})
    quiet = [c for c in batch if not c.alertname]
    if quiet:
        time.sleep(max(0.0, min(injected.values()) + watch - time.time()))
        raised = unexpected(_alerts(state_dir, min(injected.values())), {c.alertname for c in expected})
        for case in quiet:
            found[case] = f"none in {watch:.0f} s" if not raised else f"raised {', '.join(raised)}"
    return found


def unexpected(alerts: list[dict], expected: set[str | None]) -> list[str]:
    """The alerts not expected, each named with the replica it is about where it has one."""
    named = (
        " on ".join(filter(None, (a["alertname"], a["labels"].get("replica"))))
        for a in alerts
        if a["alertname"] not in expected
    )
    return sorted(set(named))


def _scale(state_dir: Path) -> float:
    return json.loads((state_dir / "state.json").read_text()).get("rule_time_scale", 1)


def unresolved(alerts: list[dict]) -> set[str]:
    """The label sets whose latest notification at the webhook says firing: one still firing would carry
    the next fault's alert of the same labels, sent again only after the route's repeat_interval."""
    latest = {
        json.dumps(a["labels"], sort_keys=True): a["status"]
        for a in sorted(alerts, key=lambda a: a["received_at"])
    }
    return {labels for labels, status in latest.items() if status == "firing"}


def awaited(run: LabRun, index: int) -> set[str]:
    """The alerts that must have resolved before the batch after `index` starts: those of that batch and
    of every later one, also when a batch that expects none or another raised them (the probe's sessions
    failing over from a restarted replica break affinity), since one still firing hides a later fault's
    alert of the same labels. Others may stay: the gateway-spread alert a break raises on the real
    users' sessions holds until they leave its 10-minute window, and holds no probe alert back."""
    return {case.alertname for batch in run.batches[index:] for case in batch if case.alertname}


def groups_gone_at(alerts: list[dict]) -> float:
    """When Alertmanager has dropped the groups of these resolved alerts: it drops an emptied group only at
    its next maintenance. Until then an alert of the same group labels joins the old group and is sent at
    its next group_interval tick instead of after group_wait, as a first alert is (a hash-request-id
    after a break-affinity: both KVWatchSessionAffinityBroken on one target)."""
    return max((a["received_at"] for a in alerts), default=0.0) + ALERTMANAGER_MAINTENANCE_S + 1


def _heal_until_resolved(state_dir: Path, since: float, names: set[str]) -> None:
    """Heal, then wait until every alert of these names that fired since `since` has been sent resolved
    to the webhook and Alertmanager has dropped its group."""
    if (result := _kvwatch("lab", "heal", "--state-dir", str(state_dir))).returncode != 0:
        raise RuntimeError(f"heal failed: {result.stderr[-2000:]}")
    deadline = time.monotonic() + QUIET_TIMEOUT_S
    while left := unresolved(alerts := [a for a in _alerts(state_dir, since) if a["alertname"] in names]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"alerts still unresolved {QUIET_TIMEOUT_S} s after heal: {sorted(left)}")
        time.sleep(2)
    if alerts:
        time.sleep(max(0.0, groups_gone_at(alerts) - time.time()))


def returning_per_minute(state_dir: Path, minutes: int = 3) -> float:
    """Requests that came back to the affinity listener a minute, over the last minutes (Prometheus's
    scrapes of kvwatch's counter): the traffic a real-traffic row was measured at."""
    status = json.loads(_kvwatch("lab", "status", "--json", "--state-dir", str(state_dir)).stdout)
    expr = f'sum(increase(kvwatch_gateway_returning_requests_total{{listener="affinity"}}[{minutes}m]))'
    (series,) = PrometheusApi(status["prometheus"], 30).query(expr)
    return float(series["value"][1]) / minutes


def _run_lab(run: LabRun, rows: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = Path(tmp) / "lab"
        _lab_up(state_dir, (*LAB_OPTIONS[run.name], *run.options))
        try:
            time.sleep(run.warmup_s)
            for index, batch in enumerate(run.batches):
                floors = {case: floor(state_dir, case) for case in batch if case.alertname}
                traffic = returning_per_minute(state_dir) if run.name == "real traffic" else None
                started = time.time()
                found = _measure_batch(state_dir, batch, floors)
                if traffic is not None:
                    found = {case: f"{m} ({traffic:.0f} returning a minute)" for case, m in found.items()}
                for case in batch:
                    rows[(run.name, case, run.options)] = (found[case], floors.get(case))
                    print(
                        f"{SETTINGS[run.options]}, {run.name}: {case.name}: {found[case]}"
                        f" (floor {floors.get(case, '-')})",
                        file=sys.stderr,
                        flush=True,
                    )
                if index < len(run.batches) - 1:
                    _heal_until_resolved(state_dir, started, awaited(run, index))
        finally:
            _kvwatch("lab", "down", "--state-dir", str(state_dir))


def _run_lane(lane: tuple[LabRun, ...], rows: dict, errors: list) -> None:
    for run in lane:
        try:
            _run_lab(run, rows)
        except Exception as error:  # one lab's failure is reported; the other lanes' rows still count
            errors.append(f"{SETTINGS[run.options]}, {run.name} lab: {error}")


def _shown(row: tuple[str, Floor | None] | None) -> tuple[str, str]:
    if row is None:
        return "not run", ""
    measured, its_floor = row
    return measured, "" if its_floor is None else str(its_floor)


def run() -> str:
    rows: dict = {}
    errors: list[str] = []
    lanes = [threading.Thread(target=_run_lane, args=(lane, rows, errors)) for lane in LANES]
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join()
    runs = [run for lane in LANES for run in lane]
    cases = dict.fromkeys((run.name, case) for run in runs for batch in run.batches for case in batch)
    lines = [
        "| fault | alert | production defaults | floor (probe+scrape+eval+for+wait) | lab fast | floor |",
        "|---|---|---|---|---|---|",
    ]
    for name, case in cases:
        fault = f"{case.name} ({NO_PROBES[name]})" if name in NO_PROBES else case.name
        alert = case.alertname or "none but Watchdog"
        if case.labels.get("scope"):
            alert += f" ({case.labels['scope']})"
        production, fast = _shown(rows.get((name, case, PRODUCTION))), _shown(rows.get((name, case, FAST)))
        lines.append(f"| {fault} | {alert} | {production[0]} | {production[1]} | {fast[0]} | {fast[1]} |")
    return "\n".join(lines + [f"\n{error}" for error in errors])
