"""SMG (once sglang-router): its manual policy pins a routing key, by default from `x-smg-routing-key`
(`--routing-key-headers`)."""

from kvwatch.collectors.sessionkeys.base import SessionKey

KEY = SessionKey("smg", "X-SMG-Routing-Key", "SMG's manual policy (--routing-key-headers)")
