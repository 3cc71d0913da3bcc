"""olla's sticky sessions: it reports the outcome of each request's pin in `X-Olla-Sticky-Session` (`hit`:
the pinned endpoint served it, `miss`: no pin yet, `repin`: pinned anew elsewhere, `disabled`) and where
it took the key from in `X-Olla-Sticky-Key-Source`. The probe sends its id in `X-Session-Id`."""

from kvwatch.collectors.sessionkeys.base import SessionKey

KEY = SessionKey(
    "olla",
    "X-Session-Id",
    "olla's sticky sessions (reports hit, miss or repin)",
    pin_header="X-Olla-Sticky-Session",
    pin_outcomes=("hit", "miss", "repin", "disabled"),
)
