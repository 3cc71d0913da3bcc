"""The gateway log follower against the lab's real nginx: what each listener logged, request by request,
as the client saw it answered, then after session affinity breaks and a replica dies."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import ExitStack

import httpx
import pytest
from test_gatewaylog_sessions import spread

from kvwatch.collectors.gatewaylogs.follower import GatewayLogFollower
from kvwatch.collectors.gatewaylogs.tally import GatewayLogSnapshot


def chat(client: httpx.Client, url: str, session_id: str | None) -> str:
    """One short chat round through a gateway; the X-Upstream header the client saw."""
    response = client.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Where is my order?"}], "max_tokens": 2},
        headers={"X-Session-Id": session_id} if session_id else {},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    return response.headers["X-Upstream"]


def answered(x_upstream: str) -> str:
    return x_upstream.split(", ")[-1]


class Sent:
    """What the client sent through one listener and which upstream answered each request."""

    def __init__(self, listener: str):
        self.listener = listener
        self.requests: list[tuple[str | None, str]] = []  # (session id sent, X-Upstream)

    def send(self, client: httpx.Client, url: str, sessions: list[str], rounds: int, keyless: int) -> None:
        for session_id in sessions:
            for _ in range(rounds):
                self.requests.append((session_id, chat(client, url, session_id)))
        for _ in range(keyless):
            self.requests.append((None, chat(client, url, None)))

    def per_upstream(self) -> Counter:
        return Counter((self.listener, answered(upstream)) for _, upstream in self.requests)

    def spread_sessions(self) -> int:
        upstreams: dict[str, set[str]] = {}
        for session_id, upstream in self.requests:
            if session_id:
                upstreams.setdefault(session_id, set()).add(answered(upstream))
        return sum(len(seen) > 1 for seen in upstreams.values())


def poll_until_lines(follower: GatewayLogFollower, lines: int) -> GatewayLogSnapshot:
    """nginx logs a request just after the client got its response: poll until its line is there."""
    deadline = time.monotonic() + 5
    while (snapshot := follower.poll()).lines < lines and time.monotonic() < deadline:
        time.sleep(0.02)
    assert snapshot.lines == lines and not any(snapshot.malformed.values()), snapshot
    return snapshot


def increase(after: GatewayLogSnapshot, before: GatewayLogSnapshot, statistic: str) -> Counter:
    """How much a per-key statistic grew between two snapshots (keys that did not grow left out)."""
    return Counter(getattr(after, statistic)) - Counter(getattr(before, statistic))


@pytest.mark.integration
def test_follows_the_lab_gateway_logs_and_sees_affinity_break(start_lab):
    lab = start_lab("--replicas", "3", "--users", "0", "--no-probes", "--time-scale", "0.05")
    urls = {"affinity": lab.affinity, "round_robin": lab.round_robin}
    with ExitStack() as stack, httpx.Client() as client:
        followers = {
            listener: stack.enter_context(
                GatewayLogFollower(lab.state_dir / "logs" / f"gateway-{listener}.jsonl", listener)
            )
            for listener in urls
        }
        # The baseline: what the logs hold already (the lab's own readiness checks are not logged).
        before = {listener: follower.poll() for listener, follower in followers.items()}
        sent = {listener: Sent(listener) for listener in urls}
        for listener, url in urls.items():
            sent[listener].send(client, url, [f"{listener}-{i}" for i in range(4)], rounds=3, keyless=3)
        for listener, follower in followers.items():
            start = before[listener]
            after = poll_until_lines(follower, start.lines + 15)
            assert increase(after, start, "requests") == sent[listener].per_upstream()
            assert increase(after, start, "without_session_key") == {listener: 3}
            assert increase(after, start, "assigned_session_ids") == {listener: 3}
            assert increase(after, start, "failovers") == {}
            assert increase(after, start, "active_sessions") == {listener: 7}
            assert after.spread_sessions == spread(listener, moved=sent[listener].spread_sessions())
        assert followers["affinity"].latest.spread_sessions == spread()
        assert followers["round_robin"].latest.spread_sessions["round_robin", "false"] > 0

        assert lab.cli("fault", "break-affinity").returncode == 0
        affinity = followers["affinity"]
        lines = affinity.latest.lines
        sent["affinity"].send(client, lab.affinity, ["broken-0", "broken-1", "broken-2"], rounds=4, keyless=0)
        snapshot = poll_until_lines(affinity, lines + 12)
        assert snapshot.spread_sessions == spread(moved=sent["affinity"].spread_sessions())
        assert snapshot.spread_sessions["affinity", "false"] > 0

        # A dead replica: nginx fails over and logs both upstreams; the one that answered counts.
        assert lab.cli("fault", "kill-replica", "--replica", "r2").returncode == 0
        round_robin = followers["round_robin"]
        start = round_robin.latest
        failover = Sent("round_robin")
        failover.send(client, lab.round_robin, ["after-kill"], rounds=6, keyless=0)
        snapshot = poll_until_lines(round_robin, start.lines + 6)
        failovers = sum(", " in upstream for _, upstream in failover.requests)
        assert failovers >= 1
        assert increase(snapshot, start, "failovers") == {"round_robin": failovers}
        assert increase(snapshot, start, "requests") == failover.per_upstream()
    assert lab.cli("heal").returncode == 0
