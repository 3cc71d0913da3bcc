"""The lab's commands: start, inspect, break, heal and stop the lab (replicas behind a gateway, nginx or
Envoy: lab/gateways/, Prometheus, Alertmanager and background users, all on 127.0.0.1). Its processes
are in `lab.components`, how they are run in `lab.supervisor`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import yaml

from kvwatch.core.connections import request_sync
from kvwatch.core.errors import UpstreamError
from kvwatch.core.promapi import PrometheusApi
from kvwatch.lab import rsyslog, sagemaker_faults
from kvwatch.lab.components import planned_processes, replica_process
from kvwatch.lab.configs import (
    render_alertmanager,
    render_kvwatch_config,
    render_prometheus,
    rule_files,
    write_webhook_token,
)
from kvwatch.lab.gateways import GATEWAYS
from kvwatch.lab.gateways.sagemaker import IGNORE_SESSIONS, STALL_INDEX, sagemaker_endpoint
from kvwatch.lab.metrics_stores import METRICS_STORES
from kvwatch.lab.process import LabError, is_ours, log_tail
from kvwatch.lab.replicas import REPLICA_KINDS
from kvwatch.lab.state import (
    CLUSTER_PORT_STRIDE,
    LabState,
    ReplicaSpec,
    cluster_names,
    forget_running,
    recorded_labs,
)
from kvwatch.lab.supervisor import check_ports_free, reap, running_processes, start_processes, stop_processes

PROMETHEUS_RELOAD_TIMEOUT_S = 30.0
PROMETHEUS_STATUS_TIMEOUT_S = 5.0
# How long a command waits for another one changing the same lab: a real-vLLM restart takes minutes.
LOCK_TIMEOUT_S = 600.0
GATEWAY_FAULTS = ("break-affinity", "drop-session-header", "hash-request-id")
REPLICA_FAULTS = ("disable-prefix-cache", "kill-replica", "restart-replica")
SAGEMAKER_FAULTS = (
    IGNORE_SESSIONS,
    STALL_INDEX,
    *sagemaker_faults.CONTAINER_FAULTS,
)  # behind --gateway sagemaker only
FAULTS = (*GATEWAY_FAULTS, *REPLICA_FAULTS, "dynamic-prefix", "scale-out", *SAGEMAKER_FAULTS)


def idle() -> None:
    """Wait a little while a foreground lab runs, collecting children that exited."""
    time.sleep(0.5)
    reap()


# --- configs --------------------------------------------------------------------------------------


def _write_configs(state: LabState) -> None:
    (state.directory / "prometheus.yml").write_text(render_prometheus(state))
    if write_store_configs := METRICS_STORES.lookup(state.metrics_store).write_configs:
        write_store_configs(state)
    if not state.cluster:  # the lab's alerting: with several clusters, the central lab's
        (state.directory / "alertmanager.yml").write_text(render_alertmanager(state))
        rules = state.directory / "rules"
        rules.mkdir(exist_ok=True)
        for name, text in rule_files(state).items():
            (rules / name).write_text(text)
    if state.clusters:
        return
    GATEWAYS.lookup(state.gateway).write_configs(state)
    if state.gateway_log_source == "syslog":
        rsyslog.write_config(state)
    (state.directory / "kvwatch.yaml").write_text(render_kvwatch_config(state))
    # Written whole and renamed: background users read it at any moment.
    control = state.directory / "traffic.json"
    control.with_suffix(".tmp").write_text(json.dumps({"dynamic_prefix": "dynamic-prefix" in state.faults}))
    control.with_suffix(".tmp").replace(control)


def _scrape_targets(config: dict) -> dict[str, list]:
    """Each scrape job's static targets and their labels: what the lab changes in Prometheus' config."""
    return {
        job["job_name"]: [(group["targets"], group.get("labels", {})) for group in job["static_configs"]]
        for job in config["scrape_configs"]
    }


def _reload_prometheus(state: LabState) -> None:
    """SIGHUP the lab's Prometheus (its metrics store's scraper, found by PID and command line) and
    return once it has loaded the targets just written, else raise LabError naming it."""
    url = f"http://127.0.0.1:{state.ports.prometheus}"
    scraper = METRICS_STORES.lookup(state.metrics_store).scraper
    pid = state.processes.get(scraper)
    if pid is None or not is_ours(state, pid):
        raise LabError(
            f"Prometheus ({url}) is not running, so it does not scrape the new set of replicas (the rest "
            "is done and in faults.log); restart the lab with `kvwatch lab down` and `kvwatch lab up`"
        )
    expected = _scrape_targets(yaml.safe_load((state.directory / "prometheus.yml").read_text()))
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + PROMETHEUS_RELOAD_TIMEOUT_S
    while True:
        with contextlib.suppress(UpstreamError, KeyError, TypeError):
            loaded = PrometheusApi(url, PROMETHEUS_STATUS_TIMEOUT_S).loaded_config()
            if _scrape_targets(yaml.safe_load(loaded)) == expected:
                return
        if time.monotonic() > deadline:
            raise LabError(
                f"Prometheus ({url}) did not load the new config within {PROMETHEUS_RELOAD_TIMEOUT_S:.0f} s; "
                f"logs/{scraper}.log ends:\n{log_tail(state, scraper)}"
            )
        time.sleep(0.1)


def _reconfigure(state: LabState) -> float:
    """Save the state, write its configs and make the gateway serve them: the saved state always says what
    the configs ask for, so that `kvwatch lab heal` undoes a change even when it did not take. Returns
    once the gateway serves them, with the wall time from which new requests got them."""
    state.save()
    _write_configs(state)
    return GATEWAYS.lookup(state.gateway).apply(state)


@contextlib.contextmanager
def locked(
    directory: Path, waiting: Callable[[str], None] | None = None, timeout_s: float = LOCK_TIMEOUT_S
) -> Iterator[None]:
    """Hold the lab's lock (an flock on lab.lock): commands that change one lab run one at a time, so
    that none acts on a state another is rewriting. A second one waits for the first, calling
    `waiting` with its PID once, and raises LabError after `timeout_s`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "lab.lock"
    with path.open("a+") as lock:
        deadline = time.monotonic() + timeout_s
        told = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = path.read_text().strip() or "unknown"
                if time.monotonic() > deadline:
                    raise LabError(
                        f"another `kvwatch lab` command (PID {holder}) has been changing the lab in "
                        f"{directory} for over {timeout_s:.0f} s; try again once it is done"
                    ) from None
                if waiting and not told:
                    waiting(holder)
                    told = True
                time.sleep(0.1)
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        yield


# --- commands -------------------------------------------------------------------------------------


def _plan(directory: Path, base_port: int, replicas: int, flavours: list[str], **options) -> LabState:
    """The saved state of a lab about to start in `directory`."""
    for sub in ("logs", "ground-truth", "prometheus-data", "alertmanager"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    state = LabState(directory, base_port, **options)
    if fixed := REPLICA_KINDS.lookup(state.engine).flavour:  # a real engine exports its own
        flavours = [fixed]
    state.replicas = [
        ReplicaSpec(f"r{i + 1}", state.ports.replica(i), flavours[i % len(flavours)]) for i in range(replicas)
    ]
    state.initial_replicas = replicas
    state.save()
    return state


def _listening_ports(state: LabState) -> dict[str, int]:
    """The ports the lab's processes listen on, by what listens there."""
    ports = state.ports
    named = {METRICS_STORES.lookup(state.metrics_store).scraper: ports.prometheus}
    if not state.cluster:
        named["alertmanager"] = ports.alertmanager
    if state.clusters:
        return named
    named |= {
        "affinity gateway": ports.affinity,
        "round_robin gateway": ports.round_robin,
        "kvwatch exporter": ports.exporter,
        "dashboard": ports.dashboard,
    }
    if GATEWAYS.lookup(state.gateway).metrics_path:
        named["gateway admin"] = ports.gateway_admin
    if METRICS_STORES.lookup(state.metrics_store).rules_url(state):
        named["rule engine"] = ports.rule_engine
    return named | {f"replica {r.id}": r.port for r in state.replicas}


def plan(
    directory: Path, base_port: int, replicas: int, flavours: list[str], clusters: int = 1, **options
) -> list[LabState]:
    """The saved states of a lab about to start: one, or a central lab and its clusters."""
    if clusters == 1:
        return [_plan(directory, base_port, replicas, flavours, **options)]
    names = cluster_names(clusters)
    return [_plan(directory, base_port, 0, flavours, **options, clusters=names)] + [
        _plan(
            directory / name,
            base_port + CLUSTER_PORT_STRIDE * (index + 1),
            replicas,
            flavours,
            **options,
            cluster=name,
            central_port=base_port,
        )
        for index, name in enumerate(names)
    ]


def listening_ports(planned: list[LabState]) -> dict[str, int]:
    """Every port the planned labs listen on, by what listens there."""
    return {
        f"cluster {lab.cluster}'s {name}" if lab.cluster else name: port
        for lab in planned
        for name, port in _listening_ports(lab).items()
    }


def labs(state: LabState) -> list[LabState]:
    """The lab and, in a lab of several clusters, each cluster's."""
    return [state, *(state.member(name) for name in state.clusters)]


def up(
    directory: Path, base_port: int, replicas: int, flavours: list[str], clusters: int = 1, **options
) -> LabState:
    """Start the whole lab, with `clusters` > 1 a central lab and that many clusters feeding it; on any
    failure stop what was started and raise LabError."""
    directory = directory.resolve()
    if is_running(directory):
        raise LabError(f"a lab is already running from {directory}; run `kvwatch lab down` first")
    planned = plan(directory, base_port, replicas, flavours, clusters, **options)
    check_ports_free(listening_ports(planned))
    try:
        for lab in planned:  # every config first: the central ones name the clusters' webhook tokens
            if not lab.clusters:
                write_webhook_token(lab)
            _write_configs(lab)
        for lab in planned:
            if lab.replicas:
                REPLICA_KINDS.lookup(lab.engine).prepare(lab)
            for group in planned_processes(lab):
                start_processes(lab, *group)
    except BaseException:
        down(planned[0])
        raise
    return planned[0]


def is_running(directory: Path) -> bool:
    """Whether a process of the lab in `directory` (or of one of its clusters) still runs."""
    with contextlib.suppress(FileNotFoundError):  # no lab there, or a cluster's state of an earlier lab
        return any(running_processes(lab) for lab in labs(LabState.load(directory)))
    return False


def find(default: Path) -> Path:
    """The lab the commands act on when none is named: the one in `default` when it runs, else the one
    lab recorded as running for this user, from any directory (the records of labs that died are
    dropped), else `default`, where loading says how to start one. LabError when several run elsewhere."""
    default = default.resolve()
    if is_running(default):
        return default
    running = []
    for directory in recorded_labs():
        if is_running(directory):
            running.append(directory)
        else:
            forget_running(directory)
    if len(running) > 1:
        where = ", ".join(str(directory) for directory in running)
        raise LabError(
            f"no lab runs from {default}, and {len(running)} run elsewhere ({where}): name one with "
            "--state-dir"
        )
    return running[0] if running else default


def down(state: LabState) -> None:
    """Stop every process of the lab, each cluster's before the central ones."""
    for lab in reversed(labs(state)):
        stop_processes(lab, list(reversed(lab.processes)))


def status(state: LabState) -> dict:
    """Every URL of the lab; null for a part that is not running. A lab of several clusters: the central
    URLs and each cluster's status under `clusters`."""
    alive = running_processes(state)

    def url(name: str, port: int) -> str | None:
        return f"http://127.0.0.1:{port}" if name in alive else None

    ports, store = state.ports, METRICS_STORES.lookup(state.metrics_store)
    info = {
        "state_dir": str(state.directory),
        "prometheus": url(store.scraper, ports.prometheus),
        "alertmanager": url("alertmanager", ports.alertmanager),
    }
    if state.clusters:
        return info | {
            "clusters": {name: status(state.member(name)) for name in state.clusters},
            "processes": alive,
        }
    return info | {
        "metrics_store": state.metrics_store,
        "rules": url(store.rule_engine, ports.rule_engine) if store.rules_url(state) else info["prometheus"],
        "exporter": url("serve", ports.exporter),
        "dashboard": url("dashboard", ports.dashboard),
        "cluster": state.cluster or None,
        "engine": state.engine,
        "model": state.model,
        "gateway": state.gateway,
        "gateways": {
            "affinity": url(state.gateway, ports.affinity),
            "round_robin": url(state.gateway, ports.round_robin),
        },
        "replicas": [
            {
                "id": r.id,
                "name": r.name,
                "url": url(f"replica-{r.id}", r.port),
                "flavour": r.flavour,
                "prefix_caching": r.prefix_caching,
            }
            for r in state.replicas
        ],
        "traffic_users": state.users if "traffic" in alive else 0,
        "sagemaker": sagemaker_endpoint(state) if state.gateway == "sagemaker" else None,
        "faults": list(state.faults),
        "faults_described": [describe_fault(state, entry) for entry in state.faults],
        "processes": alive,
    }


def cluster(state: LabState, name: str | None) -> LabState:
    """The lab a fault acts on: a single cluster's own, or in a lab of several the cluster named."""
    if not state.clusters:
        if name is not None:
            raise LabError(
                f"--cluster {name}: this lab runs one cluster (several: `kvwatch lab up --clusters N`)"
            )
        return state
    if name is None:
        raise LabError(f"this lab runs clusters {', '.join(state.clusters)}: name one with --cluster NAME")
    if name not in state.clusters:
        raise LabError(f"no cluster {name!r} in this lab (clusters: {', '.join(state.clusters)})")
    return state.member(name)


def _log_fault(
    state: LabState, action: str, name: str, replica: ReplicaSpec | None = None, at: float | None = None
) -> None:
    """Append to faults.log: the ground truth of when each fault started and ended, and on which replica
    (its id and its address, as the dashboard names it). `at` is the wall time the change took effect
    for clients, which a command that waits for it to serve learns before it is done; by default now."""
    at = time.time() if at is None else at
    entry = {
        "time": datetime.fromtimestamp(at, UTC).isoformat(),
        "unix": at,
        "action": action,
        "fault": name,
        "replica": replica.id if replica else None,
        "address": replica.address if replica else None,
    }
    with (state.directory / "faults.log").open("a") as out:
        out.write(json.dumps(entry) + "\n")


def _serves(state: LabState, replica: ReplicaSpec) -> bool:
    return f"replica-{replica.id}" in running_processes(state)


def _switch_prefix_caching(state: LabState, replica: ReplicaSpec, enabled: bool) -> float:
    """At runtime where the replica can (the simulator), else by restarting it with other flags. Returns
    the wall time from which it answers so: as it is asked, or once it serves again restarted."""
    if REPLICA_KINDS.lookup(state.engine).live_prefix_caching:
        replica.prefix_caching = enabled
        asked = time.time()
        _set_replica_faults(replica, prefix_caching=enabled)
        return asked
    if replica.prefix_caching != enabled:
        replica.prefix_caching = enabled
        state.save()
        _stop_replica(state, replica)
        start_processes(state, replica_process(state, replica))
    return time.time()


def _stop_replica(state: LabState, replica: ReplicaSpec) -> float:
    """Stop a replica; return once the gateway has let go of it too, so the next request fails over,
    with the wall time it stopped listening (its SIGTERM)."""
    stopped = stop_processes(state, [f"replica-{replica.id}"])
    if forget := GATEWAYS.lookup(state.gateway).forget_replica:
        forget(state, replica.port)
    return stopped


def _restart_replica(state: LabState, replica: ReplicaSpec, while_stopped=lambda: None) -> float:
    """Stop a replica (if it runs), call `while_stopped`, start it again; returns once it serves, with
    the wall time it stopped listening."""
    stopped = _stop_replica(state, replica)
    while_stopped()
    start_processes(state, replica_process(state, replica))
    return stopped


def _check_gateway_has(state: LabState, name: str) -> None:
    """Refuse a fault the lab's gateway has no part in."""
    sagemaker = state.gateway == "sagemaker"
    if name in SAGEMAKER_FAULTS and not sagemaker:
        raise LabError(f"fault {name} is for a lab behind --gateway sagemaker; this one runs {state.gateway}")
    if name in GATEWAY_FAULTS and sagemaker:
        raise LabError(f"fault {name} is for nginx and Envoy; the sagemaker gateway's is {IGNORE_SESSIONS}")


def _set_replica_faults(replica: ReplicaSpec, **faults) -> None:
    try:
        response = request_sync("POST", f"http://127.0.0.1:{replica.port}/lab/faults", 10, json=faults)
    except httpx.HTTPError as error:
        raise LabError(f"replica {replica.name} did not answer its admin API: {error!r}") from None
    if response.status_code != 200:
        raise LabError(f"replica {replica.name} refused the fault: {response.text}")


def fault(state: LabState, name: str, replica_id: str | None = None) -> str:
    """Inject one fault and return, once it serves, a sentence saying what changed. faults.log dates it
    when it took effect for clients: a gateway's reload, a replica's SIGTERM, else once it serves."""
    if name in REPLICA_FAULTS and replica_id is None:
        raise LabError(f"fault {name} needs a replica: --replica ID")
    replica = state.replica(replica_id) if replica_id else None
    _check_gateway_has(state, name)
    if name in ("disable-prefix-cache", "kill-replica") and not _serves(state, replica):
        raise LabError(
            f"replica {replica.name} is not running; start it with "
            f"`kvwatch lab fault restart-replica {replica.id}`"
        )
    if name in (*GATEWAY_FAULTS, IGNORE_SESSIONS):
        state.faults = [f for f in state.faults if f not in (*GATEWAY_FAULTS, IGNORE_SESSIONS)] + [name]
        began = _reconfigure(state)
        done = f"affinity gateway now: {name}"
    elif name == "disable-prefix-cache":
        began = _switch_prefix_caching(state, replica, enabled=False)
        state.faults.append(f"{name}:{replica.id}")
        done = f"prefix caching off on {replica.name}"
        if not REPLICA_KINDS.lookup(state.engine).live_prefix_caching:
            done += " (restarted with --no-enable-prefix-caching; its counters start from zero)"
    elif name == STALL_INDEX:
        state.faults = [f for f in state.faults if f != name] + [name]
        began = _reconfigure(state)
        done = "the SageMaker front's KV-event index stalled: its lag grows, each request a gap"
    elif name == "dynamic-prefix":
        state.faults.append(name)
        began = time.time()  # the users read their control file, written now, before each conversation
        _write_configs(state)
        done = "background users now put a timestamp at the top of their system prompt"
    elif name == "kill-replica":
        began = _stop_replica(state, replica)
        state.faults.append(f"{name}:{replica.id}")
        done = f"replica {replica.name} killed"
    elif name in sagemaker_faults.CONTAINER_FAULTS:
        began = time.time()
        done = sagemaker_faults.inject(state, name, _restart_replica)
        if name not in state.faults:
            state.faults.append(name)
    elif name == "restart-replica":
        began = _restart_replica(state, replica)
        state.faults = [f for f in state.faults if f != f"kill-replica:{replica.id}"]
        done = f"replica {replica.name} restarted (its counters start from zero)"
    elif name == "scale-out":
        index = len(state.replicas)
        replica = ReplicaSpec(f"r{index + 1}", state.ports.replica(index), state.replicas[0].flavour)
        check_ports_free({f"replica {replica.name}": replica.port})
        state.replicas.append(replica)
        state.faults.append(f"{name}:{replica.id}")
        state.save()
        start_processes(state, replica_process(state, replica))
        began = _reconfigure(state)
        done = f"replica {replica.name} added"
    else:
        raise LabError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    state.save()
    _log_fault(state, "fault", name, replica, began)
    if name == "scale-out":  # after the entry: the new replica serves, whether Prometheus scrapes it or not
        _reload_prometheus(state)
    return done


def describe_fault(state: LabState, entry: str) -> str:
    """A fault of the state's list (`kill-replica:r2`) as the lab's messages name it: `kill-replica on
    r2 (127.0.0.1:20812)`."""
    name, _, replica_id = entry.partition(":")
    return f"{name} on {state.replica(replica_id).name}" if replica_id else name


def heal(state: LabState) -> str:
    """Undo every fault: affinity back, caches on, killed replicas restarted, added ones removed."""
    described = [describe_fault(state, entry) for entry in state.faults]  # before scale-out's replicas go
    sagemaker_faults.heal(state, _restart_replica)
    extra = state.replicas[state.initial_replicas :]
    if extra:
        stop_processes(state, [f"replica-{r.id}" for r in extra])
        state.replicas = state.replicas[: state.initial_replicas]
    stopped = [r for r in state.replicas if not _serves(state, r)]
    for replica in stopped:
        replica.prefix_caching = True
    start_processes(state, *(replica_process(state, r) for r in stopped))
    for replica in state.replicas:
        _switch_prefix_caching(state, replica, enabled=True)
    healed = list(state.faults)
    state.faults = []
    healed_at = _reconfigure(state)  # the last step to take effect: the replicas serve already
    _log_fault(state, "heal", ",".join(healed) or "none", at=healed_at)
    _reload_prometheus(state)  # after the entry: the gateways and replicas are healed either way
    return f"healed: {', '.join(described) or 'nothing was broken'}"
