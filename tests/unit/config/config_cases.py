"""What the config tests share: where their files are, a key that must never be echoed, a target."""

from __future__ import annotations

from kvwatch.config.settings import Target
from paths import REPO

TESTDATA = REPO / "tests" / "testdata" / "config"
KEY = "sk-live-0123456789abcdef"  # what a pasted key looks like; it must never be echoed


def target(**key_source) -> Target:
    return Target(name="chat", base_url="http://127.0.0.1:18000", model="lab-model", **key_source)
