"""NVIDIA Dynamo's session affinity: `X-Dynamo-Session-ID`, with a parent session for sub-agents and a
final marker on a session's last request. Only a frontend started with `--router-session-affinity-ttl-secs`
pins by it; without the flag the header is trace identity only."""

from kvwatch.collectors.sessionkeys.base import SessionKey

KEY = SessionKey(
    "dynamo",
    "X-Dynamo-Session-ID",
    "NVIDIA Dynamo's frontend (affinity only with --router-session-affinity-ttl-secs)",
    parent_header="X-Dynamo-Parent-Session-ID",
    final_header="X-Dynamo-Session-Final",
)
