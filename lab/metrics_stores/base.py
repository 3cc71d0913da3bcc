"""The interface every kind of lab metrics store implements: what scrapes the lab's targets, evaluates
kvwatch's rules and sends the alerts to the lab's Alertmanager, answering the Prometheus API at the
lab's Prometheus port (lab.state.Ports.prometheus)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvwatch.lab.process import Process
from kvwatch.lab.state import LabState


@dataclass(frozen=True)
class MetricsStore:
    name: str
    help: str
    # Its processes, started side by side with kvwatch serve once the gateways and Alertmanager serve.
    processes: Callable[[LabState], list[Process]]
    # The process that scrapes: SIGHUP makes it read the scrape config the lab rewrote (scale-out, heal).
    scraper: str
    # The process that evaluates the rules; one apart from the scraper answers the rules and alerts API on
    # Ports.rule_engine (kvwatch's prometheus.rules_url).
    rule_engine: str
    # Whether its rule engine takes the alerts' keep_firing_for; else the lab loads alerts without it.
    keeps_firing: bool = True
    # Writes the config files of its own beside prometheus.yml; None: it reads prometheus.yml.
    write_configs: Callable[[LabState], None] | None = None
    # Its processes the others read from, started before them, beside the gateways and Alertmanager.
    started_first: Callable[[LabState], list[Process]] = lambda state: []

    @property
    def rules_apart(self) -> bool:
        """Whether its rule engine is a process of its own, on Ports.rule_engine."""
        return self.rule_engine != self.scraper

    def rules_url(self, state: LabState) -> str | None:
        """Where its rules and alerts API answers, when not at the store's own URL."""
        return f"http://127.0.0.1:{state.ports.rule_engine}" if self.rules_apart else None
