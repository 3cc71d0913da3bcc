"""LiteLLM's proxy: session affinity by `x-litellm-session-id`."""

from kvwatch.collectors.sessionkeys.base import SessionKey

KEY = SessionKey("litellm", "x-litellm-session-id", "LiteLLM's proxy (session affinity)")
