"""The doctor says which session header a route keeps sessions by: it tries the session-key family's
headers (and none) against routes that each hash on one header, or on none."""

from __future__ import annotations

import itertools
import zlib

import pytest
from aiohttp import web
from loopback import chat_answer
from test_doctor import against, check

from kvwatch.doctor import session_keys

REPLICAS = 3


def keyed_on(header: str | None):
    """A route that picks one of three replicas by the value of `header` when the request carries it,
    else the next one in turn (None: always in turn); it echoes X-Session-Id, as a gateway passing it on."""
    served = itertools.count()

    async def chat(request: web.Request) -> web.StreamResponse:
        value = request.headers.get(header) if header else None
        replica = zlib.crc32(value.encode()) if value else next(served)
        headers = {"X-Upstream": f"r{replica % REPLICAS + 1}"}
        if sent := request.headers.get("X-Session-Id"):
            headers["X-Session-Id"] = sent
        return await chat_answer(request, headers)

    return chat


def test_a_route_keyed_on_another_header_of_the_family_is_named_with_it():
    diagnosis = against(keyed_on("X-Dynamo-Session-ID"), timeout_seconds=5)
    found = check(diagnosis, "hash key")
    assert (found.status, diagnosis.causes) == ("fail", ["session_header_not_the_routes"]), found
    assert "sessions changed backend" in found.evidence
    assert found.evidence.endswith("the route keeps sessions by X-Dynamo-Session-ID (session key dynamo)")
    assert found.fix.startswith("send the session id in X-Dynamo-Session-ID (session key dynamo)")


def test_a_route_keyed_on_the_header_sent_is_said_to_keep_sessions_by_it():
    found = check(against(keyed_on("X-Session-Id"), timeout_seconds=5), "hash key")
    assert found.status == "pass", found
    assert found.evidence.endswith(
        "the route keeps sessions by X-Session-Id (session key kvwatch, llm-d, olla)"
    )


async def one_replica(request: web.Request) -> web.StreamResponse:
    """A route with one replica: every session stays there, whatever it sends."""
    echoed = {"X-Session-Id": sent} if (sent := request.headers.get("X-Session-Id")) else {}
    return await chat_answer(request, {"X-Upstream": "r1", **echoed})


def test_a_route_that_keeps_sessions_without_any_header_says_so():
    found = check(against(one_replica, timeout_seconds=5), "hash key")
    assert found.status == "pass", found
    assert "sessions without any session header stayed on one backend too" in found.evidence


def test_a_route_keyed_on_no_header_of_the_family_says_none():
    diagnosis = against(keyed_on(None), timeout_seconds=5)
    found = check(diagnosis, "hash key")
    assert (found.status, diagnosis.causes) == ("fail", ["hash_key_not_session"]), found
    assert (
        f"no header of the family kept sessions on one backend ({', '.join(session_keys.family_headers())})"
        in (found.evidence)
    )
    assert found.fix.startswith("hash on the session id: ")


@pytest.mark.parametrize("header", session_keys.family_headers())
def test_every_header_of_the_family_is_found(header):
    """Whichever header of the family the route hashes on, the doctor names it (the probe sends kvwatch's)."""
    found = check(against(keyed_on(header), timeout_seconds=5), "hash key")
    assert f"the route keeps sessions by {header}" in found.evidence, found
