"""The lab's state: what runs where, which faults are on, and the PIDs of everything started.

It lives in one directory (default `.kvwatch/lab/`) as state.json, next to the generated configs and a
log per component, so `kvwatch lab status|fault|heal|down` can find a running lab.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvwatch.core.naming import replica_name

REPLICA_PORT_OFFSET = 10
# A lab of several clusters: the central part on the base port's block, cluster i (from 0) this many ports
# further on per cluster, each with room for ten replicas; four clusters stay inside a block of 100.
CLUSTER_PORT_STRIDE = 20
MAX_CLUSTERS = 4
MAX_CLUSTER_REPLICAS = CLUSTER_PORT_STRIDE - REPLICA_PORT_OFFSET


def cluster_names(count: int) -> list[str]:
    """The clusters of a lab of `count`: a, b, c, ..."""
    return [chr(ord("a") + i) for i in range(count)]


@dataclass(frozen=True)
class Ports:
    """Every lab port, derived from one base port."""

    base: int

    @property
    def affinity(self) -> int:
        return self.base

    @property
    def round_robin(self) -> int:
        return self.base + 1

    @property
    def prometheus(self) -> int:
        return self.base + 2

    @property
    def alertmanager(self) -> int:
        return self.base + 3

    @property
    def exporter(self) -> int:
        return self.base + 4

    @property
    def dashboard(self) -> int:
        return self.base + 5

    @property
    def gateway_admin(self) -> int:
        """A gateway's admin API and metrics (Envoy's); nginx has none."""
        return self.base + 6

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
    envoy_lb: str = "ring-hash"  # the consistent hash of Envoy's affinity cluster: ring-hash or maglev
    # How the sagemaker gateway's affinity listener routes requests without a session (its routing.py).
    sagemaker_routing: str = "LEAST_OUTSTANDING_REQUESTS"
    model: str = "lab-model"  # the model name every replica serves
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
