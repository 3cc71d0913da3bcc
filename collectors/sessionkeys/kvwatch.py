"""kvwatch's own default and the source article's: `X-Session-Id`, which the lab's gateways hash on."""

from kvwatch.collectors.sessionkeys.base import SessionKey

KEY = SessionKey(
    "kvwatch", "X-Session-Id", "kvwatch's default; nginx or Envoy hashing on it, AIPerf's X-Session-ID"
)
