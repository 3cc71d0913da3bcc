"""Detection latency: from a fault in the lab's faults.log to its alert at kvwatch's webhook.

The faults run one after another in one lab per setting, each healed before the next. Two settings:
the shipped production defaults (rules and Alertmanager timers as shipped, probes every 30 s, the lab's
5 s scrape and evaluation) and the lab's fast test settings (--fast: 1 s scrape/evaluation, probes
every 5 s, --rule-time-scale 0.1). Faults whose alert waits `for: 5m` by design are measured only fast.
The gateway-spread alert, which reads the gateway's log of real users' sessions, is measured in labs
without probes (--no-probes), so no probe can be what detects the break, and with three replicas for
four users (the real-sessions test's lab).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvwatch.collectors.store import Store

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 420

# fault arguments -> (alert name, label that must match, or None)
PROBED_FAULTS = {
    ("break-affinity",): ("KVWatchSessionAffinityBroken", ("target", "lab-affinity")),
    ("hash-request-id",): ("KVWatchSessionAffinityBroken", ("target", "lab-affinity")),
    ("drop-session-header",): ("KVWatchSessionIdNotPropagated", ("target", "lab-affinity")),
    ("disable-prefix-cache", "--replica", "r2"): ("KVWatchPrefixCachingDisabled", None),
    ("kill-replica", "r3"): ("KVWatchTargetDown", None),
    ("dynamic-prefix",): ("KVWatchPrefixCacheHitRateDrop", ("scope", "cluster")),
}
UNPROBED_FAULTS = {("break-affinity",): ("KVWatchGatewaySessionsSpread", ("log", "affinity"))}
SLOW_BY_DESIGN = {("dynamic-prefix",)}  # for: 5m in production
SETTINGS = {
    "production defaults": (),
    "lab fast": ("--fast", "--rule-time-scale", "0.1"),
}
# The alert tests' lab: enough users that their traffic outweighs the probes'.
PROBED_LAB = ("--replicas", "4", "--users", "8", "--think", "0.2", "--time-scale", "0.3")
# The real-sessions test's lab: as many users as replicas would let a broken gateway's strict round
# robin send each user's next request to the same replica, so the counts are coprime.
UNPROBED_LAB = ("--replicas", "3", "--users", "4", "--think", "0.2", "--time-scale", "0.2", "--no-probes")


def _kvwatch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvwatch.collectors.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _free_base() -> int:
    for base in range(24000, 32000, 100):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", base)) != 0 and sock.connect_ex(("127.0.0.1", base + 10)) != 0:
                return base
    raise RuntimeError("no free ports")


def _detect(
    state_dir: Path, fault: tuple[str, ...], alertname: str, label: tuple[str, str] | None
) -> float | None:
    assert _kvwatch("lab", "fault", *fault, "--state-dir", str(state_dir)).returncode == 0
    injected = json.loads((state_dir / "faults.log").read_text().splitlines()[-1])["unix"]
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        with Store(state_dir / "kvwatch.db", readonly=True) as store:
            for alert in store.alerts(since=injected, status="firing"):
                if alert["alertname"] == alertname and (
                    label is None or alert["labels"].get(label[0]) == label[1]
                ):
                    return alert["received_at"] - injected
        time.sleep(0.5)
    return None


def _wait_until_quiet(state_dir: Path) -> None:
    """After a heal, wait until only Watchdog fires: an alert still held (keep_firing_for) would hide
    the next fault's."""
    prometheus = json.loads((state_dir / "state.json").read_text())["base_port"] + 2
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        answer = httpx.get(f"http://127.0.0.1:{prometheus}/api/v1/alerts", timeout=10).json()["data"][
            "alerts"
        ]
        if all(a["labels"]["alertname"] == "Watchdog" for a in answer):
            return
        time.sleep(2)


def _measure(
    lab: tuple[str, ...],
    options: tuple[str, ...],
    faults: dict[tuple[str, ...], tuple[str, tuple[str, str] | None]],
) -> dict[tuple[str, ...], float | None]:
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = Path(tmp) / "lab"
        up = _kvwatch("lab", "up", "--detach", *lab, *options, "--base-port", str(_free_base()),
                      "--state-dir", str(state_dir))  # fmt: skip
        if up.returncode != 0:
            raise RuntimeError(up.stderr)
        try:
            time.sleep(120)  # a past for the hit-ratio alert to compare with
            found = {}
            for fault, (alertname, label) in faults.items():
                found[fault] = _detect(state_dir, fault, alertname, label)
                print(
                    f"{' '.join(options) or 'production defaults'}: {' '.join(fault)}: {found[fault]}",
                    flush=True,
                )
                _kvwatch("lab", "heal", "--state-dir", str(state_dir))
                _wait_until_quiet(state_dir)
            return found
        finally:
            _kvwatch("lab", "down", "--state-dir", str(state_dir))


def run() -> str:
    rows = []
    for lab, faults in ((PROBED_LAB, PROBED_FAULTS), (UNPROBED_LAB, UNPROBED_FAULTS)):
        fast = _measure(lab, SETTINGS["lab fast"], faults)
        slow = {fault: alert for fault, alert in faults.items() if fault not in SLOW_BY_DESIGN}
        production = _measure(lab, SETTINGS["production defaults"], slow)
        rows += [(fault, alertname, lab, production, fast) for fault, (alertname, _) in faults.items()]

    def shown(found: dict, fault: tuple[str, ...]) -> str:
        if fault not in found:
            return "5 min `for` + window (not measured)"
        return "not detected" if found[fault] is None else f"{found[fault]:.0f} s"

    lines = ["| fault | alert | production defaults | lab fast |", "|---|---|---|---|"]
    for fault, alertname, lab, production, fast in rows:
        name = f"{' '.join(fault)} (`--no-probes`)" if "--no-probes" in lab else " ".join(fault)
        lines.append(f"| {name} | {alertname} | {shown(production, fault)} | {shown(fast, fault)} |")
    return "\n".join(lines)
