"""What every source of a gateway log shares: how it is named and built, and how a push source's log
publishes its counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvwatch.collectors.gatewaylogs.tally import GatewayLogSnapshot, SessionTally, SourceState
from kvwatch.core.errors import KVWatchError


class SourceUnavailable(KVWatchError, ValueError):
    """A source that this kvwatch cannot run, or a receiver that cannot listen; the message says why."""


class PushSource(Protocol):
    """A receiver that gateways (or relays) send their access log to. `start()` returns once it listens
    (or raises OSError: the address is taken or not this host's); `stop()` returns once its sockets are
    closed. It hands what it receives to its tally from its own threads."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Source:
    """One kind of source. `receiver` builds a push source from its gateway log's config section (its
    `listen` address, host:port) and the log's tally; None for the file source, which the poll reads."""

    name: str
    default_port: int | None  # where a push source listens on 127.0.0.1 unless the config says
    receiver: Callable[[object, SessionTally], PushSource] | None


class PushedLog:
    """A gateway log a push source feeds: the poll publishes the tally's counts as `latest`."""

    def __init__(self, tally: SessionTally, receiver: PushSource) -> None:
        self.tally, self.receiver, self.name = tally, receiver, tally.name
        self.latest = tally.snapshot(SourceState(problem="not_polled"))

    def start(self) -> None:
        try:
            self.receiver.start()
        except OSError as error:
            raise SourceUnavailable(
                f"gateway log {self.name}: cannot listen for its {self.tally.source} source: "
                f"{error.strerror or error}"
            ) from None

    def poll(self) -> GatewayLogSnapshot:
        self.latest = self.tally.snapshot(SourceState())
        return self.latest

    def close(self) -> None:
        self.receiver.stop()
