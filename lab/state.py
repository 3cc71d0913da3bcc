"""The lab's state: what runs where, which faults are on, and the PIDs of everything started.

It lives in one directory (default `.kvwatch/lab/`) as state.json, next to the generated configs and a
log per component, so `kvwatch lab status|fault|heal|down` can find a running lab. Each running lab is also
recorded for its user (`running_labs_directory`), so that those commands find it from any directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvwatch.core.naming import replica_name

REPLICA_PORT_OFFSET = 10
# A lab of several clusters: the central part on the base port's block, cluster i (from 0) this many ports
# further on per cluster, each with room for ten replicas; four clusters stay inside a block of 100.
CLUSTER_PORT_STRIDE = 20
MAX_CLUSTERS = 4
MAX_CLUSTER_REPLICAS = CLUSTER_PORT_STRIDE - REPLICA_PORT_OFFSET
# The lab's gateway-log sources other than the file, and the gateway that sends each.
LOG_SOURCE_GATEWAYS = {"syslog": "nginx", "otlp": "envoy"}


def cluster_names(count: int) -> list[str]:
    """The clusters of a lab of `count`: a, b, c, ..."""
    return [chr(ord("a") + i) for i in range(count)]


def _above_base(offset: int) -> property:
    """A port `offset` above the lab's base port."""
    return property(lambda ports: ports.base + offset)


@dataclass(frozen=True)
class Ports:
    """Every lab port, derived from one base port."""

    base: int

    affinity = _above_base(0)
    round_robin = _above_base(1)
    prometheus = _above_base(2)
    alertmanager = _above_base(3)
    exporter = _above_base(4)
    dashboard = _above_base(5)
    gateway_admin = _above_base(6)  # a gateway's admin API and metrics (Envoy's); nginx has none
    # With --gateway-log-source syslog or otlp: kvwatch's receivers of each listener's log; rsyslog's input.
    syslog_affinity = _above_base(7)
    syslog_round_robin = _above_base(8)
    syslog_relay = _above_base(9)
    # With --metrics-store victoriametrics: vmalert's rules and alerts API (a lab without a syslog relay).
    rule_engine = _above_base(9)

    def replica(self, index: int) -> int:
        return self.base + REPLICA_PORT_OFFSET + index


@dataclass
class ReplicaSpec:
    id: str
    port: int
    flavour: str
    prefix_caching: bool = True  # what a real engine is started with; the simulator's is a runtime fault

    @property
    def address(self) -> str:
        """As Prometheus' `instance` label and the gateway's upstream name it."""
        return f"127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return replica_name(self.address, self.id)


@dataclass
class LabState:
    directory: Path
    base_port: int
    fast: bool = False
    time_scale: float = 1.0
    users: int = 4
    think_seconds: float = 1.0
    probes: bool = True  # kvwatch serve's scheduled probes through both gateways
    dashboard: bool = True  # the Streamlit app; tests that never open it save its start and its CPU
    engine: str = "sim"  # the kind of replica: lab.replicas.REPLICA_KINDS
    gateway: str = "nginx"  # what the replicas sit behind: lab.gateways.GATEWAYS
    # How kvwatch gets the gateway's access logs: "file", "syslog" (nginx sends the affinity log
    # straight to kvwatch over UDP, the round_robin log through rsyslog, RFC 5424 over TCP), or "otlp"
    # (Envoy sends its access log to kvwatch over OTLP/gRPC, its file log kept beside as ground truth)
    gateway_log_source: str = "file"
    envoy_lb: str = "ring-hash"  # the consistent hash of Envoy's affinity cluster: ring-hash or maglev
    # host:port of an OTLP/gRPC logs receiver Envoy also sends its access log to, beside the file ("": none).
    gateway_log_otlp: str = ""
    # How the sagemaker gateway's affinity listener routes requests without a session (its routing.py).
    sagemaker_routing: str = "LEAST_OUTSTANDING_REQUESTS"
    # In-flight requests on its instance past which PREFIX_AWARE overflows (SageMaker's ConcurrencyThreshold).
    sagemaker_concurrency_threshold: int = 8
    # The sagemaker gateway's session table: idle seconds a session lives (the front's pin and the
    # containers' SAGEMAKER_SESSIONS_EXPIRATION; None: their defaults) and the sessions it holds at most.
    session_ttl_s: float | None = None
    session_table_size: int | None = None
    model: str = "lab-model"  # the model name every replica serves
    metrics_store: str = "prometheus"  # what scrapes and evaluates the rules: lab.metrics_stores
    # Rule windows, `for` and Alertmanager timers at this fraction of production (alert tests use 0.1).
    rule_time_scale: float = 1.0
    replicas: list[ReplicaSpec] = field(default_factory=list)
    initial_replicas: int = 0
    faults: list[str] = field(default_factory=list)
    processes: dict[str, int] = field(default_factory=dict)
    # A lab of several clusters is a central lab (a Prometheus receiving remote_write, Alertmanager) naming
    # its `clusters`, each a lab of its own in the subdirectory of its name, whose `cluster` is that name
    # and whose Prometheus, an agent, remote-writes to the central lab's on the block of `central_port`.
    clusters: list[str] = field(default_factory=list)
    cluster: str = ""
    central_port: int = 0

    @property
    def ports(self) -> Ports:
        return Ports(self.base_port)

    @property
    def scrape_interval(self) -> str:
        """How often the lab's targets are scraped and its rules evaluated."""
        return "1s" if self.fast else "5s"

    @property
    def central(self) -> Ports:
        """The ports of the lab's Prometheus and Alertmanager: a cluster's central lab's, else its own."""
        return Ports(self.central_port or self.base_port)

    def member(self, name: str) -> LabState:
        """One cluster of a central lab, as its own state directory holds it."""
        return LabState.load(self.directory / name)

    @property
    def balancer(self) -> str:
        """How the affinity listener balances, given the active gateway faults."""
        if "break-affinity" in self.faults:
            return "round_robin"
        if "hash-request-id" in self.faults:
            return "request_id"
        return "session"

    def replica(self, replica_id: str) -> ReplicaSpec:
        for replica in self.replicas:
            if replica.id == replica_id:
                return replica
        known = ", ".join(r.id for r in self.replicas)
        raise LookupError(f"no replica {replica_id!r} in this lab (replicas: {known})")

    @property
    def path(self) -> Path:
        return self.directory / "state.json"

    def save(self) -> None:
        data = asdict(self)
        data["directory"] = str(self.directory)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.path)

    @classmethod
    def load(cls, directory: Path) -> LabState:
        path = directory / "state.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no lab state in {directory} (start one with `kvwatch lab up`)"
            ) from None
        data["directory"] = Path(data["directory"])
        data["replicas"] = [ReplicaSpec(**r) for r in data["replicas"]]
        return cls(**data)


def running_labs_directory() -> Path:
    """Where this user's running labs are recorded, one file each holding its state directory: under
    $XDG_RUNTIME_DIR (per login, cleared at logout), else the user's cache directory."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvwatch" / "running-labs"


def _record(directory: Path) -> Path:
    return running_labs_directory() / hashlib.sha256(str(directory).encode()).hexdigest()[:16]


def record_running(directory: Path) -> None:
    """Note that the lab of `directory` (absolute) runs, for commands started from elsewhere."""
    record = _record(directory)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(str(directory))


def forget_running(directory: Path) -> None:
    _record(directory).unlink(missing_ok=True)


def recorded_labs() -> list[Path]:
    """The state directories of the labs recorded as running, in order (some may have died since)."""
    try:
        records = list(running_labs_directory().iterdir())
    except FileNotFoundError:
        return []
    return sorted(Path(record.read_text()) for record in records if record.is_file())
