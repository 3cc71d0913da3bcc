"""The openai target kind: an OpenAI-compatible route over HTTP, timed by collectors.probe.streaming."""

from __future__ import annotations

from collections.abc import Hashable

from kvwatch.collectors import sessionkeys
from kvwatch.collectors.probe.session import HttpExchange, ProbeSettings
from kvwatch.collectors.probe.streaming import StreamClient


class OpenAIKind:
    name = "openai"
    serves_metrics = True
    session_header = sessionkeys.DEFAULT.header  # the session id's header unless a target names another

    def client_key(self, settings: ProbeSettings) -> Hashable:
        return None  # one pool of kept-alive connections per origin serves every route

    def client(self, settings: ProbeSettings) -> StreamClient:
        return StreamClient()

    def exchange(self, client: StreamClient, settings: ProbeSettings) -> HttpExchange:
        return HttpExchange(client, settings)


KIND = OpenAIKind()
