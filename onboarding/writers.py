"""The files `kvwatch init` writes from a survey, each matched to the others: the kvwatch config, the
webhook token both `kvwatch serve` and Alertmanager read, a Prometheus config scraping the engines (with
the `replica` label the pages name replicas by), the routers and kvwatch's exporter and loading kvwatch's
rules, and an Alertmanager config whose receiver is kvwatch's webhook with that token."""

from __future__ import annotations

import re
import socket
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvwatch.config.settings import load_config
from kvwatch.core.credentials import write_new_token
from kvwatch.core.errors import KVWatchError
from kvwatch.onboarding.survey import Survey, Target

PACKAGE = Path(__file__).resolve().parent.parent
RULE_FILES = ("prometheus/rules/*.yml", "alerts/*.rules.yml")
ALERTMANAGER_TEMPLATE = PACKAGE / "alerts" / "alertmanager.yml"
CONFIG, TOKEN, PROMETHEUS, ALERTMANAGER, RULES = (
    "kvwatch.yaml",
    "webhook-token",
    "prometheus.yml",
    "alertmanager.yml",
    "rules",
)
SCRAPE_INTERVAL = "15s"
EVERY_INTERFACE = ("0.0.0.0", "::", "[::]")


class ExistingFiles(KVWatchError, ValueError):
    """Files init would write exist already; it overwrites none without --force."""


@dataclass(frozen=True)
class Layout:
    """Where kvwatch and its neighbours run, as the user gave it: the pieces must agree on these."""

    directory: Path  # absolute: every path the pieces name is inside it
    listen: str = "0.0.0.0:9464"  # kvwatch serve's /metrics and webhook
    prometheus_url: str = "http://127.0.0.1:9090"
    alertmanager_url: str = "http://127.0.0.1:9093"
    target_name: str = "chat"
    route_mode: str = "affinity"
    interval_seconds: int = 60
    api_key_env: str | None = None
    api_key_file: str | None = None

    @property
    def exporter_address(self) -> str:
        """The address Prometheus and Alertmanager reach kvwatch at: the listen address, or this host's
        name where it listens on every interface."""
        host, _, port = self.listen.rpartition(":")
        return f"{socket.gethostname() if host in EVERY_INTERFACE else host}:{port}"


def target_name(base_url: str) -> str:
    """A target name from the gateway's host: `llm.example.com` -> `llm-example-com`."""
    host = re.sub(r"[^a-z0-9]+", "-", (re.sub(r"^\w+://", "", base_url).split("/")[0]).lower()).strip("-")
    return host[:64] or "chat"


def kvwatch_config(found: Survey, layout: Layout) -> str:
    """The config `kvwatch serve` and the dashboard read: one target with what the survey found."""
    target: dict = {
        "name": layout.target_name,
        "base_url": found.request.base_url,
        "model": found.model,
        "route_mode": layout.route_mode,
    }
    if layout.api_key_env:
        target["api_key_env"] = layout.api_key_env
    if layout.api_key_file:
        target["api_key_file"] = layout.api_key_file
    target["session"] = {"mode": found.session_mode, "header": found.request.session_header}
    if found.identity_header:
        target["backend"] = {"headers": [found.identity_header]}
    target["interval_seconds"] = layout.interval_seconds  # block_size unset: each run learns it again
    config = {
        "targets": [target],
        "exporter": {"listen": layout.listen, "webhook_token_file": str(layout.directory / TOKEN)},
        "store": {"path": str(layout.directory / "kvwatch.db")},
        "prometheus": {"url": layout.prometheus_url},
        "alertmanager": {"url": layout.alertmanager_url},
    }
    head = (
        f"# Written by `kvwatch init {found.request.base_url}`: what it found there. Every key not written\n"
        "# here takes its default (docs/configuration.md). Check it with `kvwatch config check`.\n"
    )
    return head + yaml.safe_dump(config, sort_keys=False)


def prometheus_config(found: Survey, layout: Layout) -> str:
    """A Prometheus config with kvwatch's pieces: merge its scrape_configs, rule_files and alerting into
    yours, or run a Prometheus of its own with it (`prometheus --config.file=prometheus.yml`)."""
    jobs = [_engines_job(found.engines, found.request.engines)]
    if found.routers:
        jobs.append(_job("llm-routers", (r.instance for r in found.routers)))
    jobs.append(_job("kvwatch", [layout.exporter_address]))
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [f"{RULES}/*.yml"],
        "alerting": {
            "alertmanagers": [{"static_configs": [{"targets": [_host_port(layout.alertmanager_url)]}]}]
        },
        "scrape_configs": jobs,
    }
    head = (
        "# kvwatch's part of a Prometheus config (`kvwatch init`). Merge scrape_configs, rule_files and\n"
        "# alerting into your prometheus.yml (rule_files are relative to that file: copy rules/ beside it),\n"
        "# and drop your own job for these engines: scraped twice, every rate counts twice. The `replica`\n"
        "# label names each engine on the pages and in the alerts: set it to your pods' names.\n"
    )
    return head + yaml.safe_dump(config, sort_keys=False)


def _engines_job(engines: list[Target], given: Iterable[str]) -> dict:
    """The engines, each with its `replica` label: its own where Prometheus had one, else engine-N."""
    known = {e.instance: e for e in engines}
    for address in given:
        known.setdefault(address, Target(address, "llm-engines"))
    groups = [
        {"targets": [instance], "labels": {"replica": target.replica or f"engine-{number}"}}
        for number, (instance, target) in enumerate(sorted(known.items()), start=1)
    ]
    return {"job_name": "llm-engines", "static_configs": groups}


def _job(name: str, addresses: Iterable[str]) -> dict:
    return {"job_name": name, "static_configs": [{"targets": sorted(set(addresses))}]}


def _host_port(url: str) -> str:
    return re.sub(r"^\w+://", "", url).split("/")[0]


def alertmanager_config(layout: Layout) -> str:
    """alerts/alertmanager.yml with its kvwatch receiver sending to this kvwatch, with this token file."""
    config = yaml.safe_load(ALERTMANAGER_TEMPLATE.read_text())
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = f"http://{layout.exporter_address}/alerts"
            webhook["http_config"]["authorization"]["credentials_file"] = str(layout.directory / TOKEN)
    head = (
        "# Alertmanager for kvwatch (`kvwatch init`): its receiver `kvwatch` is kvwatch serve's webhook,\n"
        f"# sending the token in {layout.directory / TOKEN}\n"
        "# (copy that file where Alertmanager runs, at that path). Merge the route and receiver into yours,\n"
        "# or run it as is; alerts/alertmanager.yml explains each part. `amtool check-config` checks it.\n"
    )
    return head + yaml.safe_dump(config, sort_keys=False)


def rule_files() -> dict[str, str]:
    """kvwatch's recording rules and alerts, by file name: the ones this kvwatch's pages read."""
    return {p.name: p.read_text() for pattern in RULE_FILES for p in sorted(PACKAGE.glob(pattern))}


def checked(config_text: str) -> str:
    """The config text, once it loads as `kvwatch serve` loads it: ConfigError (naming the key, e.g. a
    `--listen` that is no host:port) before anything is written."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        file.write(config_text)
        file.flush()
        load_config(file.name)
    return config_text


def planned(found: Survey, layout: Layout) -> dict[Path, str]:
    """Every file init writes, by path, the token last (it is written apart, readable by its owner only)."""
    files = {
        layout.directory / CONFIG: checked(kvwatch_config(found, layout)),
        layout.directory / PROMETHEUS: prometheus_config(found, layout),
        layout.directory / ALERTMANAGER: alertmanager_config(layout),
    }
    files |= {layout.directory / RULES / name: text for name, text in rule_files().items()}
    return files


def write(files: dict[Path, str], token_file: Path, force: bool) -> None:
    """Write the files and a fresh token; ExistingFiles naming them when one exists and not `force`."""
    if not force and (there := [str(p) for p in (*files, token_file) if p.exists()]):
        raise ExistingFiles(f"would overwrite {', '.join(there)}: move them away or pass --force")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    write_new_token(token_file)
