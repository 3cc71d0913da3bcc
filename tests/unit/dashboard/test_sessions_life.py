"""The Sessions page: the probe sessions' lives as the store keeps them (an idle past the route's session
TTL and what followed, the route sessions lost, the closes), data layer replaced as fake_dashboard's."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
from fake_dashboard import SESSIONS, fake, open_page, rounds_frame, texts  # noqa: F401


def lived(number: int, **life) -> dict:
    """SESSIONS' lab-affinity session `number` with a life: idled 3.5 s after round 1."""
    return replace(SESSIONS[number], idle=(1, 3.5), **life)


def test_idled_and_closed_sessions_show_what_followed_their_idle_and_their_close(fake):  # noqa: F811
    at = open_page("sessions")
    assert "Session life" not in [s.value for s in at.subheader]  # no session idled, lost or closed one
    assert "idled past" not in texts(at) and len(at.dataframe) == 1

    # Session 1: expired, round 2 in a new session on another replica (cold), then stuck: as expected.
    moved = SESSIONS[1].rounds[1]
    cold = replace(moved, backend="r2", cached_tokens=0)
    rounds = (SESSIONS[1].rounds[0], cold, *(replace(r, backend="r2") for r in SESSIONS[1].rounds[2:]))
    expired = replace(lived(1, session_losses=((2, "expired"),), closed=True, close_gone=True), rounds=rounds)
    # Session 2: the route said nothing and the session outlived the idle (warm); its close left it alive.
    warm = lived(2, closed=True, close_gone=False)
    fake.probed = {**SESSIONS, 1: expired, 2: warm}
    fake.history = rounds_frame(fake.probed)
    at = open_page("sessions")
    shown = texts(at)
    assert "Route sessions lost and opened anew before a round: expired 1" in shown
    assert (
        "2 sessions idled past the route's session TTL: the route said the session was gone in 1, the next "
        "round was cold in 1 and on another replica in 1, the session stuck again after it in 2; as expected "
        "(cold, then stuck again) in 1 of the 2 judged."
    ) in shown
    closes = (
        "Sessions closed at the end: 2 of 2; 1 of 2 checked were gone after it, 1 left ALIVE by their close."
    )
    assert closes in shown
    _, life = at.dataframe  # the recent sessions, then the idled ones' lives
    rows = life.value.set_index("id")
    assert rows.loc[1, ["idle_after_round", "idle_expiry", "idle_cold", "idle_new_replica"]].tolist() == [
        1,
        "expired",
        True,
        True,
    ]
    assert rows.loc[1, ["idle_repinned", "idle_as_expected", "close_gone"]].tolist() == [True, True, True]
    assert rows.loc[2, ["idle_cold", "idle_new_replica", "idle_repinned", "idle_as_expected"]].tolist() == [
        False, False, True, False
    ]  # fmt: skip
    assert pd.isna(rows.loc[2, "idle_expiry"])  # the route said nothing
    assert not rows.loc[2, "close_gone"] and list(rows.index) == [2, 1]  # newest first
