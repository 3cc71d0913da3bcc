"""The kvwatch config: one typed YAML file, defaults first, every mistake named by its path.

Each section is a frozen dataclass whose field defaults are the shipped defaults; `load_config` reads the
user's YAML over them. An unknown key, a value of the wrong type or out of range is one `ConfigError`
naming the key's full path, e.g.
`error in kvwatch.yaml: targets[1].session.hedaer: unknown key; known: header, mode`.
API keys never live in the file: a target names an environment variable or a file that holds its key.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, fields
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Literal

from kvwatch.collectors import gatewaylogs, identity, sessionkeys
from kvwatch.collectors.gatewaylogs.sources import SOURCES
from kvwatch.collectors.gatewaylogs.tally import INFERENCE_PATHS
from kvwatch.collectors.labels import label_names
from kvwatch.collectors.probe import blocksize, targets
from kvwatch.collectors.probe.targets.sagemaker import SageMakerEndpoint
from kvwatch.config.loading import SECRET_SOURCES, ConfigError, Invalid, check, describe, load_yaml
from kvwatch.core.connections import endpoint_problem, url_problem
from kvwatch.core.credentials import CredentialError, one_secret, read_secret_file
from kvwatch.core.labels import CLUSTER_LABEL, label_value_problem
from kvwatch.core.naming import RUNBOOK_URL
from kvwatch.core.redaction import redact
from kvwatch.core.registry import unknown
from kvwatch.core.schedule import longest_gap, time_zone
from kvwatch.store import databases, history

# Where `kvwatch lab up` keeps its state and writes its config: the dashboard's default config is there.
LAB_DIRECTORY = Path(".kvwatch/lab")

_NAME = re.compile(r"[a-z0-9_-]{1,64}")  # names become label values: short and tidy
_HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an HTTP token (RFC 9110)
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")
_ENV_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# How a route picks a replica. The first three pin a session to one replica, so its probe sessions are
# expected to stay there (`expect_sticky` defaults to it) and the affinity alerts watch it.
RouteMode = Literal["affinity", "consistent_hash", "manual", "cache_aware", "round_robin", "random"]
STICKY_ROUTE_MODES = frozenset({"affinity", "consistent_hash", "manual"})
HOUR, DAY = 3600, 86400
# A run builds every session's prompts before it sends them: ~60 MB of text at most.
MAX_RUN_TOKENS = 10_000_000


def _name(value: str, where: str) -> None:
    check(_NAME.fullmatch(value), where, f'must be 1-64 lowercase letters, digits, "_" or "-", got "{value}"')


def label_name_problem(name: str) -> str | None:
    """What keeps `name` from being a Prometheus label name of the user's (`__` names are Prometheus')."""
    if _LABEL_NAME.fullmatch(name) and not name.startswith("__"):
        return None
    return f'must be a Prometheus label name (letters, digits and _, not starting with "__"), got "{name}"'


# Labels Prometheus gives a meaning of its own: histogram buckets, summary quantiles, the scrape's target.
PROMETHEUS_LABELS = frozenset({"le", "quantile", "job", "instance"})


def cluster_label_problem(name: str) -> str | None:
    """What keeps `name` from telling clusters apart: it must be a label name of the user's, and not one
    that kvwatch's series or Prometheus already use, which it would overwrite on every sample."""
    if wrong := label_name_problem(name):
        return wrong
    taken = label_names() | PROMETHEUS_LABELS
    if name not in taken:
        return None
    listed = ", ".join(sorted(taken))
    return f'"{name}" is taken by kvwatch\'s own series or by Prometheus ({listed}): pick another'


def _url(value: str | None, where: str) -> None:
    """A URL the HTTP client can request: checked here, since the client takes a port of 99999 and fails
    only when it connects. Its password, if any, is not repeated."""
    if value is not None:
        shown = redact(value)
        ok = value.startswith(("http://", "https://"))
        check(ok, where, f'must be an http:// or https:// URL with a host, got "{shown}"')
        problem = url_problem(value)
        check(problem is None, where, f'"{shown}" is not a valid URL: {problem}')


def _header(value: str, where: str) -> None:
    check(_HEADER.fullmatch(value), where, f'must be an HTTP header name, got "{value}"')


def _bounded(default: float, low: float, high: float, *, low_excluded: bool = False) -> Any:
    """A number field with its default and its range, written next to it and checked by `_check_ranges`."""
    return dataclass_field(default=default, metadata={"range": (low, high, low_excluded)})


def _check_ranges(section: object) -> None:
    """Every number has a maximum, so one absurd value (a typo, `.inf`, a million sessions) is a config
    error, not a run that exhausts memory or never ends. NaN compares false, so it is in no range."""
    for number in fields(section):
        if "range" in number.metadata:
            low, high, low_excluded = number.metadata["range"]
            value = getattr(section, number.name)
            if value is None:  # an optional number left unset
                continue
            ok = (value > low if low_excluded else value >= low) and value <= high
            low_text = f"> {_show(low)}" if low_excluded else f">= {_show(low)}"
            check(ok, number.name, f"must be {low_text} and <= {_show(high)}, got {_show(value)}")


def _show(number: float) -> str:
    return f"{number:g}" if isinstance(number, float) else str(number)


def _secret_source(env: str | None, file: Path | None, env_key: str, file_key: str, secret: str) -> None:
    """A secret comes from an environment variable or a file, named in the config; the secret itself may
    have been pasted as the variable's name: say so without repeating it."""
    check(
        env is None or _ENV_VAR.fullmatch(env),
        env_key,
        f"must be the name of an environment variable (letters, digits and _), not the {secret} itself",
    )
    check(not (env and file), "", f"set {env_key} or {file_key}, not both")


@dataclass(frozen=True)
class SessionSettings:
    """How a probe session carries its id, which the gateway hashes on."""

    mode: Literal["client", "server", "none"] = "client"  # make a UUID / adopt the gateway's / send none
    # The router's or client's convention, one of collectors.sessionkeys.SESSION_KEYS (dynamo, litellm,
    # smg, olla...): its header carries the id. None: the kind's own (X-Session-Id; on sagemaker,
    # SessionId's X-Amzn-SageMaker-Session-Id).
    key: str | None = None
    # A header of the user's own instead of the key's, e.g. x-my-session.
    header: str | None = None

    def __post_init__(self):
        keys = sessionkeys.SESSION_KEYS
        check(self.key is None or self.key in keys, "key", unknown("session key", self.key, keys))
        check(self.key is None or self.header is None, "", "set key or header, not both")
        if self.header is not None:
            _header(self.header, "header")


@dataclass(frozen=True)
class BackendIdentity:
    """Where a response names the replica that served it; the first one present wins."""

    headers: tuple[str, ...] = identity.DEFAULT_HEADERS
    json_paths: tuple[str, ...] = identity.DEFAULT_JSON_PATHS

    def __post_init__(self):
        for i, header in enumerate(self.headers):
            _header(header, f"headers[{i}]")


@dataclass(frozen=True)
class Workload:
    """The probe's conversations, seeded so that runs are comparable."""

    system_tokens: int = _bounded(1000, 0, 1_000_000)
    turn_tokens: int = _bounded(200, 1, 1_000_000)
    # The probe takes answers of up to 50,000 tokens (probe.MAX_STREAM_LINES); a longer one fails the round.
    max_tokens: int = _bounded(32, 1, 50_000)
    seed: int = 0
    sharegpt: Path | None = None  # a ShareGPT-style JSON file instead of synthetic turns

    def __post_init__(self):
        _check_ranges(self)


@dataclass(frozen=True)
class Lifecycle:
    """A session's whole life (collectors.probe.lifecycle): idle `idle_seconds` after round
    `idle_after_round`, past the route's session TTL; check that a closed session is gone."""

    idle_after_round: int | None = _bounded(None, 1, 49)
    idle_seconds: float = _bounded(0.0, 0, DAY)
    check_close: bool = False

    def __post_init__(self):
        _check_ranges(self)
        idles = self.idle_after_round is None or self.idle_seconds > 0
        check(idles, "idle_seconds", "must be positive when idle_after_round is set")


@dataclass(frozen=True)
class Target:
    """One route to probe: its kind and where it is, the model, and how to run its sessions."""

    name: str
    base_url: str = ""  # required for kind openai; a sagemaker target's is set to its endpoint's
    model: str = ""  # required
    route_mode: RouteMode = "affinity"
    expect_sticky: bool | None = None  # None: whether route_mode pins sessions (set on construction)
    api_key_env: str | None = None
    api_key_file: Path | None = None
    session: SessionSettings = SessionSettings()
    backend: BackendIdentity = BackendIdentity()
    router: str | None = None  # a router that names the replica only when asked (identity.ROUTERS)
    interval_seconds: float = _bounded(None, 1, DAY)  # None: 60, or the longest gap of `schedule`
    schedule: str | None = None  # cron instead of an interval (core.schedule), in `timezone`
    timezone: str = "UTC"
    sessions_per_run: int = _bounded(2, 1, 1000)
    # Round 1 is the cold baseline, so a session needs a second round to say anything.
    rounds: int = _bounded(6, 2, 50)
    workload: Workload = Workload()
    timeout_seconds: float = _bounded(60.0, 0, HOUR, low_excluded=True)
    block_size: int | None = None  # the engine's KV block in tokens; None: learn it (collectors.blocksize)
    kind: str = "openai"  # how rounds reach the route, one of collectors.probe.targets.KINDS
    sagemaker: SageMakerEndpoint | None = None  # a sagemaker target's endpoint (docs/probing.md)
    lifecycle: Lifecycle = Lifecycle()

    def __post_init__(self):
        _name(self.name, "name")
        if wrong := targets.target_problem(self.kind, self.base_url, self.model, self.sagemaker):
            raise Invalid(*wrong)
        object.__setattr__(self, "base_url", self.sagemaker.base_url if self.sagemaker else self.base_url)
        _url(self.base_url, "base_url")
        pasted = endpoint_problem(self.base_url)  # a pasted …/v1/chat/completions
        check(pasted is None, "base_url", pasted or "")
        if self.expect_sticky is None:
            object.__setattr__(self, "expect_sticky", self.route_mode in STICKY_ROUTE_MODES)
        _secret_source(self.api_key_env, self.api_key_file, "api_key_env", "api_key_file", "key")
        routers = identity.ROUTERS
        check(
            self.router is None or self.router in routers, "router", unknown("router", self.router, routers)
        )
        both = "set interval_seconds or schedule, not both"
        check(self.schedule is None or self.interval_seconds is None, "", both)
        if self.schedule is None and self.interval_seconds is None:
            object.__setattr__(self, "interval_seconds", 60.0)
        _check_ranges(self)
        if self.schedule is not None:
            self._interval_of_schedule()
        spec = self.workload
        if spec.sharegpt is None:  # synthetic: every session has a system prompt of its own
            tokens = self.sessions_per_run * (spec.system_tokens + self.rounds * spec.turn_tokens)
            check(
                tokens <= MAX_RUN_TOKENS,
                "",
                "a run's prompts, sessions_per_run x (workload.system_tokens + rounds x "
                f"workload.turn_tokens), are {tokens} tokens, more than {MAX_RUN_TOKENS}; lower one of them",
            )
        idle_after = self.lifecycle.idle_after_round
        check(
            idle_after is None or idle_after < self.rounds,
            "lifecycle",
            "idle_after_round must be below rounds",
        )
        if self.block_size is not None and (wrong := blocksize.problem(self.block_size)):
            raise Invalid("block_size", wrong)

    def _interval_of_schedule(self) -> None:
        """The schedule checked, and the interval it stands for where one is assumed: its longest gap."""
        try:
            time_zone(self.timezone)
        except ValueError as error:
            raise Invalid("timezone", str(error)) from None
        try:
            gap = longest_gap(self.schedule, self.timezone)
        except ValueError as error:
            raise Invalid("schedule", str(error)) from None
        check(gap, "schedule", f'"{self.schedule}" never fires')
        object.__setattr__(self, "interval_seconds", gap)


def _names(value: object, where: str) -> tuple[str, ...]:
    """One name or a list of them (`session_keys: dynamo`, `session_keys: [dynamo, litellm]`)."""
    names = [value] if isinstance(value, str) else value
    check(
        isinstance(names, list) and all(isinstance(name, str) for name in names),
        where,
        f"expected a name or a list of names, got {describe(value)}",
    )
    return tuple(names)


def _listen(value: object, where: str) -> str:
    """The exporter's address as YAML gives it: host:port, or a bare port (`listen: 9464`), which YAML
    reads as a number."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"127.0.0.1:{value}"
    check(
        isinstance(value, str),
        where,
        f"expected host:port (e.g. 127.0.0.1:9464) or a port, got {describe(value)}",
    )
    return value


@dataclass(frozen=True)
class GatewayLog:
    """A gateway's JSON access log to follow or receive (docs/gateway-logs.md)."""

    name: str  # the `log` label
    path: Path | None = None  # the file the gateway writes, for source file
    spread_window_seconds: float = _bounded(600.0, 0, DAY, low_excluded=True)
    # The source article recycles idle session ids after 30 min.
    session_ttl_seconds: float = _bounded(1800.0, 0, 7 * DAY, low_excluded=True)
    max_sessions: int = _bounded(100_000, 1, 1_000_000)  # about 500 bytes each
    expect_sticky: bool = True  # false for a round-robin listener's log: its sessions are meant to spread
    format: str = "nginx"  # the gateway that writes it, one of gatewaylogs.LOG_FORMATS
    source: str = "file"  # how it arrives, one of gatewaylogs.sources.SOURCES
    # Where a push source (syslog, otlp) listens, host:port or a port; default 127.0.0.1:<its port>.
    listen: str | None = dataclass_field(default=None, metadata={"read": _listen})
    max_records_per_second: float = _bounded(50_000.0, 0, 10_000_000, low_excluded=True)  # per sender
    inference_paths: tuple[str, ...] = INFERENCE_PATHS  # other requests are counted apart
    # Session-key conventions (collectors.sessionkeys: dynamo, litellm...), one or a list: a line's session
    # id is the first of their headers it carries (docs/gateway-logs.md), before the format's own field.
    session_keys: tuple[str, ...] = dataclass_field(default=(), metadata={"read": _names})
    # source otlp: where OTLP/HTTP (protobuf or JSON, POST /v1/logs) is received too, host:port or a port;
    # none: OTLP/gRPC alone, on `listen`
    http_listen: str | None = dataclass_field(default=None, metadata={"read": _listen})
    # source otlp: the file holding the bearer token senders must present, and TLS's certificate and key
    token_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    def __post_init__(self):
        _name(self.name, "name")
        _check_ranges(self)
        check(
            self.format in gatewaylogs.LOG_FORMATS,
            "format",
            unknown("format", self.format, gatewaylogs.LOG_FORMATS),
        )
        check(self.source in SOURCES, "source", unknown("source", self.source, SOURCES))
        port = SOURCES[self.source].default_port
        if port is None:
            check(self.path is not None, "path", f"required for source {self.source}")
            check(self.listen is None, "listen", "a file is read, not received: drop listen or set source")
        else:
            object.__setattr__(self, "listen", _check_listen(self.listen or f"127.0.0.1:{port}", "listen"))
        if self.source != "otlp":
            for key in ("http_listen", "token_file", "tls_cert_file", "tls_key_file"):
                check(getattr(self, key) is None, key, "only for source otlp")
        else:
            check(self.format == "envoy", "format", "source otlp receives Envoy's records: set format envoy")
            if self.http_listen is not None:
                object.__setattr__(self, "http_listen", _check_listen(self.http_listen, "http_listen"))
            check(
                (self.tls_cert_file is None) == (self.tls_key_file is None),
                "tls_key_file",
                "tls_cert_file and tls_key_file go together",
            )
        keys = sessionkeys.SESSION_KEYS
        for i, key in enumerate(self.session_keys):
            check(key in keys, f"session_keys[{i}]", unknown("session key", key, keys))
        for i, path in enumerate(self.inference_paths):
            check(
                path.startswith("/"),
                f"inference_paths[{i}]",
                'must be a path such as "/v1/chat/completions"',
            )


def _check_listen(listen: str, where: str) -> str:
    """A listen address, host:port (a port alone: 127.0.0.1); an empty host means every interface to most
    servers, so exposing a listener must be explicit."""
    if listen.isdecimal():  # a port alone, given as a string
        listen = f"127.0.0.1:{listen}"
    check(":" in listen, where, f'expected host:port (e.g. 127.0.0.1:9464) or a port, got "{listen}"')
    host, _, port = listen.rpartition(":")
    check(
        port.isdecimal() and 1 <= int(port) <= 65535,
        where,
        f'must be host:port with a port from 1 to 65535, got "{listen}"',
    )
    check(
        host, where, f'name the host (127.0.0.1: this machine only, 0.0.0.0: every interface), got "{listen}"'
    )
    check(_is_host(host.strip("[]")), where, f'"{host}" is not an IP address or host name')
    return listen


@dataclass(frozen=True)
class ExporterSettings:
    """Where /metrics and the Alertmanager webhook listen, the bearer token the webhook requires, and
    the cluster its series name, for a Prometheus that scrapes several clusters' kvwatch without
    external_labels to tell them apart."""

    # host:port, or a port alone for this machine only (127.0.0.1), the safe default
    listen: str = dataclass_field(default="127.0.0.1:9464", metadata={"read": _listen})
    webhook_token_env: str | None = None  # None (and no file): POST /alerts takes alerts from anyone
    webhook_token_file: Path | None = None
    cluster: str | None = None  # the value of the cluster label on every exported series; None: no label

    def __post_init__(self):
        token_env, token_file = SECRET_SOURCES[ExporterSettings]
        _secret_source(self.webhook_token_env, self.webhook_token_file, token_env, token_file, "token")
        object.__setattr__(self, "listen", _check_listen(self.listen, "listen"))
        wrong = label_value_problem(self.cluster or "")  # on every series: bounded as every label value is
        check(wrong is None, "cluster", wrong)

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


SECRET_SOURCES[ExporterSettings] = ("webhook_token_env", "webhook_token_file")


def _is_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return _HOST_NAME.fullmatch(host) is not None
    return True


@dataclass(frozen=True)
class StoreSettings:
    """The history of probe sessions and received alerts, and how hard `kvwatch serve` tries to write it
    (collectors.store.StoreWriter): an SQLite file at `path`, or the PostgreSQL database at `url` that
    every shard writes and every dashboard reads, its password from `password_env` or `password_file`
    (or libpq's PGPASSFILE)."""

    path: Path = Path(".kvwatch/kvwatch.db")
    url: str | None = None  # e.g. postgresql://kvwatch@db.example.net:5432/kvwatch; path is then unused
    password_env: str | None = None
    password_file: Path | None = None
    retention_days: float = _bounded(14.0, 0, 3650, low_excluded=True)
    # Writes waiting for the writer thread; one holds a session (up to ~25 KB with 50 rounds) or a post.
    queue_capacity: int = _bounded(history.QUEUE_CAPACITY, 1, 10_000)
    retry_seconds: float = _bounded(history.RETRY_SECONDS, 0, HOUR)  # per write; 0: never retried
    flush_seconds: float = _bounded(history.FLUSH_SECONDS, 0, 300)  # at a stop, for the queued writes

    def __post_init__(self):
        _check_ranges(self)
        # `kvwatch serve` creates the missing directories; a path in which none can be made is refused here.
        example = self.path / "kvwatch.db"
        check(
            not os.path.isdir(self.path),
            "path",
            f'"{self.path}" is a directory; name the database file in it, e.g. "{example}"',
        )
        existing = next(parent for parent in self.path.parents if os.path.exists(parent))
        check(os.path.isdir(existing), "path", f'cannot be created: "{existing}" is not a directory')
        password_env, password_file = SECRET_SOURCES[StoreSettings]
        _secret_source(self.password_env, self.password_file, password_env, password_file, "password")
        check(
            self.url or not (self.password_env or self.password_file),
            "",
            "a password is for a PostgreSQL store: set url too, or leave out password_env and password_file",
        )
        if self.url is not None:
            _store_url(self.url)

    @property
    def location(self) -> Path | str:
        """Where Store opens the history: the URL when there is one, else the SQLite file."""
        return self.url or self.path


SECRET_SOURCES[StoreSettings] = ("password_env", "password_file")


def _store_url(url: str) -> None:
    shown = redact(url)
    scheme = databases.scheme_of(url)
    known = ", ".join(f"{name}://" for name in databases.SCHEMES)
    check(scheme in databases.SCHEMES, "url", f'must be a URL of {known}, got "{shown}"; a file goes in path')
    check(
        shown == url,
        "url",
        "the password does not belong in the URL; name an environment variable (password_env) "
        "or a file (password_file) that holds it",
    )


@dataclass(frozen=True)
class Service:
    """A service the dashboard and the doctor read; unset when there is none."""

    url: str | None = None

    def __post_init__(self):
        _url(self.url, "url")


@dataclass(frozen=True)
class PrometheusService(Service):
    """The Prometheus-compatible store the dashboard and the doctor query, and where its rules and alerts
    are answered: a store that evaluates no rules itself (VictoriaMetrics) has them at its rule engine
    (vmalert); unset, at `url`, as Prometheus, Thanos Query and Mimir answer both."""

    rules_url: str | None = None

    def __post_init__(self):
        super().__post_init__()
        _url(self.rules_url, "rules_url")


@dataclass(frozen=True)
class DashboardSettings:
    """What the dashboard may do for its viewers (it writes experiment reports only under
    report_directory), and where the runbook is published: the alerts that link into it get its
    section shown in place."""

    report_directory: Path = Path(".kvwatch/experiment")
    runbook_url: str = RUNBOOK_URL  # as `make generate RUNBOOK_URL=...` links the alerts

    def __post_init__(self):
        _url(self.runbook_url, "runbook_url")
        check("#" not in self.runbook_url, "runbook_url", "must have no #fragment: each alert's is added")


@dataclass(frozen=True)
class Config:
    """Everything `kvwatch serve` runs and the dashboard reads."""

    targets: tuple[Target, ...] = ()
    gateway_logs: tuple[GatewayLog, ...] = ()
    exporter: ExporterSettings = ExporterSettings()
    store: StoreSettings = StoreSettings()
    prometheus: PrometheusService = PrometheusService()
    alertmanager: Service = Service()
    dashboard: DashboardSettings = DashboardSettings()
    cluster_label: str = CLUSTER_LABEL  # the label that tells clusters apart

    def __post_init__(self):
        wrong = cluster_label_problem(self.cluster_label)
        check(wrong is None, "cluster_label", wrong)
        check(self.targets or self.gateway_logs, "", "nothing to watch: add a target or a gateway log")
        for section, items in (("targets", self.targets), ("gateway_logs", self.gateway_logs)):
            first: dict[str, int] = {}
            for i, item in enumerate(items):
                if item.name in first:
                    raise Invalid(
                        f"{section}[{i}].name", f'"{item.name}" is taken by {section}[{first[item.name]}]'
                    )
                first[item.name] = i


def load_config(path: str | os.PathLike) -> Config:
    """Read and check a config file; any problem is one `ConfigError` naming the file."""
    return load_yaml(Config, path)


def resolve_api_key(target: Target) -> str | None:
    """The target's API key, read now from its environment variable or file; None when it names neither.

    Read at use rather than at load, so a rotated key is picked up; messages never contain the key.
    """
    return _read_secret(target.api_key_env, target.api_key_file, f"target {target.name}", "API key")


def resolve_webhook_token(exporter: ExporterSettings) -> str | None:
    """The bearer token POST /alerts requires, from its environment variable or file; None when unset."""
    return _read_secret(exporter.webhook_token_env, exporter.webhook_token_file, "exporter", "webhook token")


def resolve_store_password(settings: StoreSettings) -> str | None:
    """The PostgreSQL store's password, from its environment variable or file; None: libpq finds one
    (PGPASSFILE, ~/.pgpass) or the server asks none."""
    return _read_secret(settings.password_env, settings.password_file, "store", "password")


def _read_secret(env: str | None, file: Path | None, owner: str, secret: str) -> str | None:
    try:
        if env:
            value = os.environ.get(env)
            if value is None:
                raise CredentialError(f"environment variable {env} is not set")
            return one_secret(value, f"environment variable {env}", secret)
        return read_secret_file(file, secret) if file else None
    except CredentialError as error:
        raise ConfigError(f"{owner}: {error}") from None
