"""The Sessions page: the pin outcome a router reported for each round (olla's X-Olla-Sticky-Session),
beside kvwatch's own stickiness verdict (data layer replaced, as fake_dashboard's)."""

from __future__ import annotations

from dataclasses import replace

from fake_dashboard import SESSIONS, fake, open_page, rounds_frame, texts  # noqa: F401


def test_the_routers_pin_outcomes_stand_beside_kvwatchs_verdict(fake):  # noqa: F811
    at = open_page("sessions")
    assert "reported its pin" not in texts(at)  # no round's response said
    assert list(at.table[0].value["router's pin"]) == [None] * 4

    outcomes = ("miss", "hit", "repin", "hit")
    pinned = replace(SESSIONS[2], rounds=tuple(
        replace(r, pin_outcome=o) for r, o in zip(SESSIONS[2].rounds, outcomes, strict=True)
    ))  # fmt: skip
    fake.history = rounds_frame({**SESSIONS, 2: pinned})
    at = open_page("sessions")
    assert "100% stayed on one replica" in texts(at)
    assert "The router reported its pin in 4 rounds: hit 2, miss 1, repin 1." in texts(at)
    at.selectbox(key="sessions_pick").set_value(2).run()
    assert list(at.table[0].value["router's pin"]) == list(outcomes)
