"""AIPerf and clients like it: one `X-Correlation-ID` per conversation, which some gateways hash on."""

from kvwatch.collectors.sessionkeys.base import SessionKey

KEY = SessionKey("aiperf", "X-Correlation-ID", "AIPerf's per-conversation correlation id")
