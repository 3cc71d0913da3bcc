"""llm-d's router (EPP): its session scorer's `session_id` strategy reads `x-session-id`, not echoed."""

from kvwatch.collectors.sessionkeys.base import SessionKey

KEY = SessionKey("llm-d", "x-session-id", "llm-d's EPP session_id strategy (not echoed)")
