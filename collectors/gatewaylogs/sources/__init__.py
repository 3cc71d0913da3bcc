"""Where a gateway log comes from: one module per kind of source (`file`, `syslog`, `otlp`), all feeding
the same format parsers and the same counting (collectors/gatewaylogs/tally.py), so that every metric,
rule, alert and page works whatever the source. A gateway log's `source` in the config picks one by name.
"""

from __future__ import annotations

from kvwatch.collectors.gatewaylogs.follower import GatewayLogFollower
from kvwatch.collectors.gatewaylogs.sources import file, otlp, syslog
from kvwatch.collectors.gatewaylogs.sources.base import PushedLog, PushSource, Source, SourceUnavailable
from kvwatch.collectors.gatewaylogs.tally import SessionTally
from kvwatch.core.registry import Registry

SOURCES = Registry("gateway log source", (module.SOURCE for module in (file, syslog, otlp)))


def open_log(section) -> GatewayLogFollower | PushedLog:
    """The gateway log a config section (config.settings.GatewayLog) describes, not yet receiving: a
    pushed log listens from its `start()`."""
    source = SOURCES.lookup(section.source)
    tally = SessionTally(
        section.name,
        source=source.name,
        spread_window_seconds=section.spread_window_seconds,
        session_ttl_seconds=section.session_ttl_seconds,
        max_sessions=section.max_sessions,
        expect_sticky=section.expect_sticky,
        log_format=section.format,
        inference_paths=section.inference_paths,
        session_keys=section.session_keys,
    )
    if source.receiver is None:
        return GatewayLogFollower(section.path, section.name, tally=tally)
    return PushedLog(tally, source.receiver(section, tally))


__all__ = ["SOURCES", "PushSource", "PushedLog", "Source", "SourceUnavailable", "open_log"]
