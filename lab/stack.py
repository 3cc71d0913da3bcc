"""Start, inspect, break, heal and stop the lab: replicas behind a gateway (nginx or Envoy: lab/gateways/),
Prometheus, Alertmanager and background users, all on 127.0.0.1 and every process tracked by PID in the
lab state.

A component is one entry in a group of `planned_processes`: its command line and the URL that answers
once it is ready. Adding one (the exporter, the dashboard) is adding an entry there and, if it has a
port, a property in `lab.state.Ports`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import yaml

from kvwatch.core.connections import request_sync
from kvwatch.core.errors import UpstreamError
from kvwatch.core.promapi import PrometheusApi
from kvwatch.lab.configs import (
    REPO,
    render_alertmanager,
    render_kvwatch_config,
    render_prometheus,
    rule_files,
    write_webhook_token,
)
from kvwatch.lab.gateways import GATEWAYS
from kvwatch.lab.process import LabError, Process, binary, is_ours, log_tail
from kvwatch.lab.process import kvwatch_command as _kvwatch
from kvwatch.lab.replicas import REPLICA_KINDS
from kvwatch.lab.state import CLUSTER_PORT_STRIDE, LabState, ReplicaSpec, cluster_names

STOP_TIMEOUT_S = 10.0
PROMETHEUS_RELOAD_TIMEOUT_S = 30.0
# Each poll of a waiting loop, the whole answer included: a server that trickles must not outlast the loop.
READY_POLL_TIMEOUT_S = 1.0
PROMETHEUS_STATUS_TIMEOUT_S = 5.0
# How long a command waits for another one changing the same lab: a real-vLLM restart takes minutes.
LOCK_TIMEOUT_S = 600.0
GATEWAY_FAULTS = ("break-affinity", "drop-session-header", "hash-request-id")
REPLICA_FAULTS = ("disable-prefix-cache", "kill-replica", "restart-replica")
FAULTS = (*GATEWAY_FAULTS, *REPLICA_FAULTS, "dynamic-prefix", "scale-out")


def replica_process(state: LabState, replica: ReplicaSpec) -> Process:
    return REPLICA_KINDS.lookup(state.engine).process(state, replica)


def prometheus_process(state: LabState) -> Process:
    """Without --web.enable-lifecycle, which would let anyone stop it (POST /-/quit): the lab reloads it
    with SIGHUP. A cluster's of a lab of several clusters is an agent; the central one receives theirs."""
    d, port = state.directory, state.ports.prometheus
    argv = [
        binary("prometheus", "/usr/bin/prometheus"),
        f"--config.file={d}/prometheus.yml",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--web.external-url=http://127.0.0.1:{port}",
    ]
    if state.cluster:
        return Process(
            "prometheus",
            [*argv, "--enable-feature=agent", f"--storage.agent.path={d}/prometheus-data"],
            f"http://127.0.0.1:{port}/-/ready",
        )
    argv += [f"--storage.tsdb.path={d}/prometheus-data", "--storage.tsdb.retention.time=2d"]
    if state.clusters:
        argv.append("--web.enable-remote-write-receiver")
    if state.rule_time_scale != 1:  # Prometheus re-sends firing alerts every minute by default
        argv.append(f"--rules.alert.resend-delay={max(1, round(60 * state.rule_time_scale))}s")
    return Process("prometheus", argv, f"http://127.0.0.1:{port}/-/ready")


def alertmanager_process(state: LabState) -> Process:
    port = state.ports.alertmanager
    argv = [
        binary("prometheus-alertmanager", "/usr/bin/prometheus-alertmanager"),
        f"--config.file={state.directory}/alertmanager.yml",
        f"--storage.path={state.directory}/alertmanager",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--web.external-url=http://127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]
    return Process("alertmanager", argv, f"http://127.0.0.1:{port}/-/ready")


def serve_process(state: LabState) -> Process:
    """kvwatch itself: probes through both gateways, the gateway logs, /metrics and the webhook."""
    argv = _kvwatch("serve", "--config", str(state.directory / "kvwatch.yaml"))
    return Process("serve", argv, f"http://127.0.0.1:{state.ports.exporter}/-/healthy")


def dashboard_process(state: LabState) -> Process:
    port = state.ports.dashboard
    argv = _kvwatch("dashboard", "--config", str(state.directory / "kvwatch.yaml"), "--port", str(port))
    if state.fast:  # as often as the probes run
        argv += ["--refresh-seconds", str(round(REPLICA_KINDS.lookup(state.engine).fast_probe_interval_s))]
    return Process("dashboard", argv, f"http://127.0.0.1:{port}/_stcore/health")


def traffic_process(state: LabState) -> Process:
    argv = _kvwatch(
        "lab",
        "traffic",
        "--url",
        f"http://127.0.0.1:{state.ports.affinity}",
        "--users",
        str(state.users),
        "--think",
        str(state.think_seconds),
        "--control",
        str(state.directory / "traffic.json"),
    )
    return Process("traffic", argv, None)


def planned_processes(state: LabState) -> list[list[Process]]:
    """Every process of the lab, in groups started one after the other; a group starts side by side.
    The gateways and Alertmanager come before Prometheus, kvwatch serve and the users, so that the first
    probes and the first alerts find them. In a lab of several clusters the central lab runs Alertmanager
    and Prometheus, each cluster the rest."""
    if state.clusters:
        return [[alertmanager_process(state)], [prometheus_process(state)]]
    last = [prometheus_process(state), serve_process(state)]
    if state.dashboard:
        last.append(dashboard_process(state))
    if state.users:
        last.append(traffic_process(state))
    alerting = [] if state.cluster else [alertmanager_process(state)]
    return [
        [replica_process(state, replica) for replica in state.replicas],
        [GATEWAYS.lookup(state.gateway).process(state), *alerting],
        last,
    ]


# --- processes ------------------------------------------------------------------------------------


def _reap() -> None:
    """Collect exited children so they do not linger as zombies while a foreground lab runs."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _spawn(state: LabState, process: Process) -> subprocess.Popen:
    """Start one process in a session of its own (its children share its process group)."""
    log = state.directory / "logs" / f"{process.name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            process.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env={**os.environ, **process.env},
            start_new_session=True,
        )
    state.processes[process.name] = popen.pid
    state.save()
    return popen


def _wait_ready(state: LabState, started: list[tuple[Process, subprocess.Popen]]) -> None:
    """Wait until every started process serves; the first that exits or times out raises LabError."""
    began = time.monotonic()
    waiting = dict(enumerate(started))
    while waiting:
        for key, (process, popen) in list(waiting.items()):
            if popen.poll() is not None:
                raise LabError(
                    f"{process.name} exited with code {popen.returncode} while starting:\n"
                    f"{log_tail(state, process.name)}"
                )
            if process.ready_url is None:
                if time.monotonic() - began > 0.3:
                    del waiting[key]
                continue
            try:
                if request_sync("GET", process.ready_url, READY_POLL_TIMEOUT_S).status_code == 200:
                    del waiting[key]
                    continue
            except httpx.HTTPError:
                pass
            if time.monotonic() - began > process.ready_timeout_s:
                raise LabError(
                    f"{process.name} did not become ready at {process.ready_url} in "
                    f"{process.ready_timeout_s:.0f} s; its log ends:\n{log_tail(state, process.name)}"
                )
        time.sleep(0.1)


def _start(state: LabState, *processes: Process) -> None:
    """Start processes side by side and return once all of them serve."""
    _wait_ready(state, [(process, _spawn(state, process)) for process in processes])


def _signal_group(pid: int, signum: int) -> None:
    """Signal a process and its children (a real engine's workers), which share its process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def _stop(state: LabState, names: list[str]) -> float:
    """SIGTERM each named process that still runs, wait, then SIGKILL what is left; forget their PIDs.
    Returns once they are gone, with the wall time of the SIGTERM: a server stops listening at it but
    exits only once its in-flight requests are done, seconds later."""
    pids = {name: state.processes[name] for name in names if name in state.processes}
    running = [pid for pid in pids.values() if is_ours(state, pid)]  # a dead one's PID may be reused
    signalled = time.time()
    for pid in running:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(is_ours(state, pid) for pid in running) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    for pid in running:
        _signal_group(pid, signal.SIGKILL)  # the leader's stragglers too; the group is still ours
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (left := [pid for pid in running if is_ours(state, pid)]) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    if left:
        raise LabError(f"processes {left} survived SIGKILL for {STOP_TIMEOUT_S:.0f} s")
    for name in pids:
        del state.processes[name]
    state.save()
    return signalled


def _check_ports_free(ports: dict[str, int]) -> None:
    for name, port in ports.items():
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                raise LabError(
                    f"port {port} on 127.0.0.1 ({name}) is already in use; choose another --base-port"
                ) from None


def idle() -> None:
    """Wait a little while a foreground lab runs, collecting children that exited."""
    time.sleep(0.5)
    _reap()


def running_processes(state: LabState) -> dict[str, int]:
    return {name: pid for name, pid in state.processes.items() if is_ours(state, pid)}


# --- configs --------------------------------------------------------------------------------------


def _write_configs(state: LabState) -> None:
    (state.directory / "prometheus.yml").write_text(render_prometheus(state))
    if not state.cluster:  # the lab's alerting: with several clusters, the central lab's
        (state.directory / "alertmanager.yml").write_text(render_alertmanager(state))
        rules = state.directory / "rules"
        rules.mkdir(exist_ok=True)
        for name, text in rule_files(state).items():
            (rules / name).write_text(text)
    if state.clusters:
        return
    GATEWAYS.lookup(state.gateway).write_configs(state)
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
    """SIGHUP the lab's Prometheus (found by PID and command line) and return once it has loaded the
    targets just written, else raise LabError naming Prometheus."""
    url = f"http://127.0.0.1:{state.ports.prometheus}"
    pid = state.processes.get("prometheus")
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
                f"logs/prometheus.log ends:\n{log_tail(state, 'prometheus')}"
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
    named = {"prometheus": ports.prometheus}
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
    if (directory / "state.json").exists():
        with contextlib.suppress(FileNotFoundError):  # a cluster's state of an earlier lab may be gone
            if any(running_processes(lab) for lab in labs(LabState.load(directory))):
                raise LabError(f"a lab is already running from {directory}; run `kvwatch lab down` first")
    planned = plan(directory, base_port, replicas, flavours, clusters, **options)
    _check_ports_free(listening_ports(planned))
    try:
        for lab in planned:  # every config first: the central ones name the clusters' webhook tokens
            if not lab.clusters:
                write_webhook_token(lab)
            _write_configs(lab)
        for lab in planned:
            if lab.replicas:
                REPLICA_KINDS.lookup(lab.engine).prepare(lab)
            for group in planned_processes(lab):
                _start(lab, *group)
    except BaseException:
        down(planned[0])
        raise
    return planned[0]


def down(state: LabState) -> None:
    """Stop every process of the lab, each cluster's before the central ones."""
    for lab in reversed(labs(state)):
        _stop(lab, list(reversed(lab.processes)))


def status(state: LabState) -> dict:
    """Every URL of the lab; null for a part that is not running. A lab of several clusters: the central
    URLs and each cluster's status under `clusters`."""
    alive = running_processes(state)

    def url(name: str, port: int) -> str | None:
        return f"http://127.0.0.1:{port}" if name in alive else None

    ports = state.ports
    info = {
        "state_dir": str(state.directory),
        "prometheus": url("prometheus", ports.prometheus),
        "alertmanager": url("alertmanager", ports.alertmanager),
    }
    if state.clusters:
        return info | {
            "clusters": {name: status(state.member(name)) for name in state.clusters},
            "processes": alive,
        }
    return info | {
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
        _start(state, replica_process(state, replica))
    return time.time()


def _stop_replica(state: LabState, replica: ReplicaSpec) -> float:
    """Stop a replica; return once the gateway has let go of it too, so the next request fails over,
    with the wall time it stopped listening (its SIGTERM)."""
    stopped = _stop(state, [f"replica-{replica.id}"])
    if forget := GATEWAYS.lookup(state.gateway).forget_replica:
        forget(state, replica.port)
    return stopped


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
    if name in ("disable-prefix-cache", "kill-replica") and not _serves(state, replica):
        raise LabError(
            f"replica {replica.name} is not running; start it with "
            f"`kvwatch lab fault restart-replica {replica.id}`"
        )
    if name in GATEWAY_FAULTS:
        state.faults = [f for f in state.faults if f not in GATEWAY_FAULTS] + [name]
        began = _reconfigure(state)
        done = f"affinity gateway now: {name}"
    elif name == "disable-prefix-cache":
        began = _switch_prefix_caching(state, replica, enabled=False)
        state.faults.append(f"{name}:{replica.id}")
        done = f"prefix caching off on {replica.name}"
        if not REPLICA_KINDS.lookup(state.engine).live_prefix_caching:
            done += " (restarted with --no-enable-prefix-caching; its counters start from zero)"
    elif name == "dynamic-prefix":
        state.faults.append(name)
        began = time.time()  # the users read their control file, written now, before each conversation
        _write_configs(state)
        done = "background users now put a timestamp at the top of their system prompt"
    elif name == "kill-replica":
        began = _stop_replica(state, replica)
        state.faults.append(f"{name}:{replica.id}")
        done = f"replica {replica.name} killed"
    elif name == "restart-replica":
        began = _stop_replica(state, replica)
        _start(state, replica_process(state, replica))
        state.faults = [f for f in state.faults if f != f"kill-replica:{replica.id}"]
        done = f"replica {replica.name} restarted (its counters start from zero)"
    elif name == "scale-out":
        index = len(state.replicas)
        replica = ReplicaSpec(f"r{index + 1}", state.ports.replica(index), state.replicas[0].flavour)
        _check_ports_free({f"replica {replica.name}": replica.port})
        state.replicas.append(replica)
        state.faults.append(f"{name}:{replica.id}")
        state.save()
        _start(state, replica_process(state, replica))
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
    extra = state.replicas[state.initial_replicas :]
    if extra:
        _stop(state, [f"replica-{r.id}" for r in extra])
        state.replicas = state.replicas[: state.initial_replicas]
    stopped = [r for r in state.replicas if not _serves(state, r)]
    for replica in stopped:
        replica.prefix_caching = True
    _start(state, *(replica_process(state, r) for r in stopped))
    for replica in state.replicas:
        _switch_prefix_caching(state, replica, enabled=True)
    healed = list(state.faults)
    state.faults = []
    healed_at = _reconfigure(state)  # the last step to take effect: the replicas serve already
    _log_fault(state, "heal", ",".join(healed) or "none", at=healed_at)
    _reload_prometheus(state)  # after the entry: the gateways and replicas are healed either way
    return f"healed: {', '.join(described) or 'nothing was broken'}"
