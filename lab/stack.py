"""Start, inspect, break, heal and stop the lab: replicas behind nginx, Prometheus, Alertmanager and
background users, all on 127.0.0.1 and every process tracked by PID in the lab state.

A component is one entry in a group of `planned_processes`: its command line and the URL that answers
once it is ready. Adding one (the exporter, the dashboard) is adding an entry there and, if it has a
port, a property in `lab.state.Ports`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import yaml

from collectors.connections import request_sync
from lab.configs import (
    REPO,
    nginx_generation,
    render_alertmanager,
    render_kvwatch_config,
    render_nginx,
    render_prometheus,
    rule_files,
    write_webhook_token,
)
from lab.process import LabError, Process
from lab.process import kvwatch_command as _kvwatch
from lab.replicas import KINDS
from lab.state import LabState, ReplicaSpec

STOP_TIMEOUT_S = 10.0
# Old nginx workers finish their in-flight requests before a reload is done: a real engine's take seconds.
NGINX_RELOAD_TIMEOUT_S = 30.0
PROMETHEUS_RELOAD_TIMEOUT_S = 30.0
# Each poll of a waiting loop, the whole answer included: a server that trickles must not outlast the loop.
READY_POLL_TIMEOUT_S = 1.0
PROMETHEUS_STATUS_TIMEOUT_S = 5.0
# How long a command waits for another one changing the same lab: a real-vLLM restart takes minutes.
LOCK_TIMEOUT_S = 600.0
GATEWAY_FAULTS = ("break-affinity", "drop-session-header", "hash-request-id")
REPLICA_FAULTS = ("disable-prefix-cache", "kill-replica", "restart-replica")
FAULTS = (*GATEWAY_FAULTS, *REPLICA_FAULTS, "dynamic-prefix", "scale-out")


def _binary(name: str, fallback: str) -> str:
    found = shutil.which(name) or (fallback if Path(fallback).exists() else None)
    if not found:
        raise LabError(f"{name} is not installed (run `make bootstrap`, or apt-get install it)")
    return found


def replica_process(state: LabState, replica: ReplicaSpec) -> Process:
    return KINDS[state.engine].process(state, replica)


def nginx_process(state: LabState) -> Process:
    d = state.directory
    argv = [
        _binary("nginx", "/usr/sbin/nginx"),
        "-p",
        f"{d}/nginx/",
        "-c",
        f"{d}/nginx/nginx.conf",
        "-e",
        f"{d}/logs/nginx-error.log",
        "-g",
        "daemon off;",
    ]
    return Process("nginx", argv, f"http://127.0.0.1:{state.ports.affinity}/-/lab-config")


def prometheus_process(state: LabState) -> Process:
    """Without --web.enable-lifecycle, which would let anyone stop it (POST /-/quit): the lab reloads it
    with SIGHUP."""
    d, port = state.directory, state.ports.prometheus
    argv = [
        _binary("prometheus", "/usr/bin/prometheus"),
        f"--config.file={d}/prometheus.yml",
        f"--storage.tsdb.path={d}/prometheus-data",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--web.external-url=http://127.0.0.1:{port}",
        "--storage.tsdb.retention.time=2d",
    ]
    if state.rule_time_scale != 1:  # Prometheus re-sends firing alerts every minute by default
        argv.append(f"--rules.alert.resend-delay={max(1, round(60 * state.rule_time_scale))}s")
    return Process("prometheus", argv, f"http://127.0.0.1:{port}/-/ready")


def alertmanager_process(state: LabState) -> Process:
    port = state.ports.alertmanager
    argv = [
        _binary("prometheus-alertmanager", "/usr/bin/prometheus-alertmanager"),
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
    probes and the first alerts find them."""
    last = [prometheus_process(state), serve_process(state)]
    if state.dashboard:
        last.append(dashboard_process(state))
    if state.users:
        last.append(traffic_process(state))
    return [
        [replica_process(state, replica) for replica in state.replicas],
        [nginx_process(state), alertmanager_process(state)],
        last,
    ]


# --- processes ------------------------------------------------------------------------------------


def _is_ours(state: LabState, pid: int) -> bool:
    """True when `pid` is alive and still one of this lab's processes (not a recycled PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return status != "Z" and str(state.directory) in cmdline


def _reap() -> None:
    """Collect exited children so they do not linger as zombies while a foreground lab runs."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _log_tail(state: LabState, name: str, lines: int = 15) -> str:
    """The end of logs/<name>.log."""
    log = state.directory / "logs" / f"{name}.log"
    with contextlib.suppress(FileNotFoundError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


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
                    f"{_log_tail(state, process.name)}"
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
                    f"{process.ready_timeout_s:.0f} s; its log ends:\n{_log_tail(state, process.name)}"
                )
        time.sleep(0.1)


def _start(state: LabState, *processes: Process) -> None:
    """Start processes side by side and return once all of them serve."""
    _wait_ready(state, [(process, _spawn(state, process)) for process in processes])


def _signal_group(pid: int, signum: int) -> None:
    """Signal a process and its children (a real engine's workers), which share its process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def _stop(state: LabState, names: list[str]) -> None:
    """SIGTERM each named process that still runs, wait, then SIGKILL what is left; forget their PIDs.
    Returns once they are gone."""
    pids = {name: state.processes[name] for name in names if name in state.processes}
    running = [pid for pid in pids.values() if _is_ours(state, pid)]  # a dead one's PID may be reused
    for pid in running:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(_is_ours(state, pid) for pid in running) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    for pid in running:
        _signal_group(pid, signal.SIGKILL)  # the leader's stragglers too; the group is still ours
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (left := [pid for pid in running if _is_ours(state, pid)]) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    if left:
        raise LabError(f"processes {left} survived SIGKILL for {STOP_TIMEOUT_S:.0f} s")
    for name in pids:
        del state.processes[name]
    state.save()


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
    return {name: pid for name, pid in state.processes.items() if _is_ours(state, pid)}


# --- configs --------------------------------------------------------------------------------------


def _write_configs(state: LabState) -> None:
    for name, text in render_nginx(state).items():
        (state.directory / "nginx" / name).write_text(text)
    (state.directory / "prometheus.yml").write_text(render_prometheus(state))
    (state.directory / "kvwatch.yaml").write_text(render_kvwatch_config(state))
    (state.directory / "alertmanager.yml").write_text(render_alertmanager(state))
    rules = state.directory / "rules"
    rules.mkdir(exist_ok=True)
    for name, text in rule_files(state).items():
        (rules / name).write_text(text)
    # Written whole and renamed: background users read it at any moment.
    control = state.directory / "traffic.json"
    control.with_suffix(".tmp").write_text(json.dumps({"dynamic_prefix": "dynamic-prefix" in state.faults}))
    control.with_suffix(".tmp").replace(control)


def _nginx_workers(master: int) -> set[int]:
    workers = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == master:
            workers.add(int(stat.parent.name))
    return workers


def _listener_generations(state: LabState) -> dict[str, str]:
    """The config generation each listener's nginx worker answers at /-/lab-config."""
    answers = {}
    for listener, port in (("affinity", state.ports.affinity), ("round_robin", state.ports.round_robin)):
        try:
            answers[listener] = request_sync("GET", f"http://127.0.0.1:{port}/-/lab-config", 2).text.strip()
        except httpx.HTTPError as error:
            answers[listener] = f"no answer ({type(error).__name__})"
    return answers


def _reload_nginx(state: LabState) -> None:
    """Gracefully reload nginx with the written config, without dropping connections; return once only
    workers of that config serve, else raise LabError saying what was seen."""
    check = subprocess.run(
        [*nginx_process(state).argv, "-t", "-q"], capture_output=True, text=True, timeout=30
    )
    if check.returncode != 0:
        raise LabError(f"generated nginx config is invalid:\n{check.stderr}")
    master = state.processes.get("nginx")
    if master is None or not _is_ours(state, master):
        raise LabError("nginx is not running; start the lab with `kvwatch lab up`")
    expected = nginx_generation(state)
    before = _nginx_workers(master)
    os.kill(master, signal.SIGHUP)
    # Done when both listeners answer the new generation and the old workers, which finish their
    # in-flight requests on the old config, have exited.
    deadline = time.monotonic() + NGINX_RELOAD_TIMEOUT_S
    while True:
        old = _nginx_workers(master) & before
        answers = _listener_generations(state)
        if not old and set(answers.values()) == {expected}:
            return
        if time.monotonic() > deadline:
            raise LabError(
                f"nginx did not reload within {NGINX_RELOAD_TIMEOUT_S:.0f} s: the listeners answer config "
                f"generation {answers}, not {expected}; workers from before the reload still running: "
                f"{sorted(old) or 'none'}; logs/nginx-error.log ends:\n{_log_tail(state, 'nginx-error')}"
            )
        time.sleep(0.05)


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
    if pid is None or not _is_ours(state, pid):
        raise LabError(
            f"Prometheus ({url}) is not running, so it does not scrape the new set of replicas (the rest "
            "is done and in faults.log); restart the lab with `kvwatch lab down` and `kvwatch lab up`"
        )
    expected = _scrape_targets(yaml.safe_load((state.directory / "prometheus.yml").read_text()))
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + PROMETHEUS_RELOAD_TIMEOUT_S
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            status = request_sync("GET", f"{url}/api/v1/status/config", PROMETHEUS_STATUS_TIMEOUT_S)
            loaded = status.json()["data"]["yaml"]
            if _scrape_targets(yaml.safe_load(loaded)) == expected:
                return
        if time.monotonic() > deadline:
            raise LabError(
                f"Prometheus ({url}) did not load the new config within {PROMETHEUS_RELOAD_TIMEOUT_S:.0f} s; "
                f"logs/prometheus.log ends:\n{_log_tail(state, 'prometheus')}"
            )
        time.sleep(0.1)


def _reconfigure(state: LabState) -> None:
    """Save the state, write its configs and reload nginx: the saved state always says what the configs
    ask for, so that `kvwatch lab heal` undoes a change even when its reload failed."""
    state.save()
    _write_configs(state)
    _reload_nginx(state)


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


def up(directory: Path, base_port: int, replicas: int, flavours: list[str], **options) -> LabState:
    """Start the whole lab; on any failure stop what was started and raise LabError."""
    directory = directory.resolve()
    if (directory / "state.json").exists():
        previous = LabState.load(directory)
        if running_processes(previous):
            raise LabError(f"a lab is already running from {directory}; run `kvwatch lab down` first")
    for sub in ("logs", "nginx/tmp", "ground-truth", "prometheus-data", "alertmanager"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    state = LabState(directory, base_port, **options)
    flavours = [KINDS[state.engine].flavour] if KINDS[state.engine].flavour else flavours
    state.replicas = [
        ReplicaSpec(f"r{i + 1}", state.ports.replica(i), flavours[i % len(flavours)]) for i in range(replicas)
    ]
    state.initial_replicas = replicas
    state.save()
    ports = {
        "affinity gateway": state.ports.affinity,
        "round_robin gateway": state.ports.round_robin,
        "prometheus": state.ports.prometheus,
        "alertmanager": state.ports.alertmanager,
        "kvwatch exporter": state.ports.exporter,
        "dashboard": state.ports.dashboard,
    }
    ports.update({f"replica {r.id}": r.port for r in state.replicas})
    _check_ports_free(ports)
    write_webhook_token(state)
    _write_configs(state)
    try:
        KINDS[state.engine].prepare(state)
        for group in planned_processes(state):
            _start(state, *group)
    except BaseException:
        down(state)
        raise
    return state


def down(state: LabState) -> None:
    _stop(state, list(reversed(state.processes)))


def status(state: LabState) -> dict:
    """Every URL of the lab; null for a part that is not running."""
    alive = running_processes(state)

    def url(name: str, port: int) -> str | None:
        return f"http://127.0.0.1:{port}" if name in alive else None

    ports = state.ports
    return {
        "state_dir": str(state.directory),
        "engine": state.engine,
        "model": state.model,
        "gateways": {
            "affinity": url("nginx", ports.affinity),
            "round_robin": url("nginx", ports.round_robin),
        },
        "prometheus": url("prometheus", ports.prometheus),
        "alertmanager": url("alertmanager", ports.alertmanager),
        "exporter": url("serve", ports.exporter),
        "dashboard": url("dashboard", ports.dashboard),
        "replicas": [
            {
                "id": r.id,
                "url": url(f"replica-{r.id}", r.port),
                "flavour": r.flavour,
                "prefix_caching": r.prefix_caching,
            }
            for r in state.replicas
        ],
        "traffic_users": state.users if "traffic" in alive else 0,
        "faults": list(state.faults),
        "processes": alive,
    }


def _log_fault(state: LabState, action: str, name: str, replica: str | None = None) -> None:
    """Append to faults.log: the ground truth of when each fault started and ended."""
    now = time.time()
    entry = {
        "time": datetime.fromtimestamp(now, UTC).isoformat(),
        "unix": now,
        "action": action,
        "fault": name,
        "replica": replica,
    }
    with (state.directory / "faults.log").open("a") as out:
        out.write(json.dumps(entry) + "\n")


def _serves(state: LabState, replica: ReplicaSpec) -> bool:
    return f"replica-{replica.id}" in running_processes(state)


def _switch_prefix_caching(state: LabState, replica: ReplicaSpec, enabled: bool) -> None:
    """At runtime where the replica can (the simulator), else by restarting it with other flags."""
    if KINDS[state.engine].live_prefix_caching:
        replica.prefix_caching = enabled
        _set_replica_faults(replica, prefix_caching=enabled)
    elif replica.prefix_caching != enabled:
        replica.prefix_caching = enabled
        state.save()
        _stop(state, [f"replica-{replica.id}"])
        _start(state, replica_process(state, replica))


def _set_replica_faults(replica: ReplicaSpec, **faults) -> None:
    try:
        response = request_sync("POST", f"http://127.0.0.1:{replica.port}/lab/faults", 10, json=faults)
    except httpx.HTTPError as error:
        raise LabError(f"replica {replica.id} did not answer its admin API: {error!r}") from None
    if response.status_code != 200:
        raise LabError(f"replica {replica.id} refused the fault: {response.text}")


def fault(state: LabState, name: str, replica_id: str | None = None) -> str:
    """Inject one fault and return, once it serves, a sentence saying what changed."""
    if name in REPLICA_FAULTS and replica_id is None:
        raise LabError(f"fault {name} needs a replica: --replica ID")
    replica = state.replica(replica_id) if replica_id else None
    if name in ("disable-prefix-cache", "kill-replica") and not _serves(state, replica):
        raise LabError(
            f"replica {replica.id} is not running; start it with "
            f"`kvwatch lab fault restart-replica {replica.id}`"
        )
    if name in GATEWAY_FAULTS:
        state.faults = [f for f in state.faults if f not in GATEWAY_FAULTS] + [name]
        _reconfigure(state)
        done = f"affinity gateway now: {name}"
    elif name == "disable-prefix-cache":
        _switch_prefix_caching(state, replica, enabled=False)
        state.faults.append(f"{name}:{replica.id}")
        done = f"prefix caching off on {replica.id}"
        if not KINDS[state.engine].live_prefix_caching:
            done += " (restarted with --no-enable-prefix-caching; its counters start from zero)"
    elif name == "dynamic-prefix":
        state.faults.append(name)
        _write_configs(state)
        done = "background users now put a timestamp at the top of their system prompt"
    elif name == "kill-replica":
        _stop(state, [f"replica-{replica.id}"])
        state.faults.append(f"{name}:{replica.id}")
        done = f"replica {replica.id} killed"
    elif name == "restart-replica":
        _stop(state, [f"replica-{replica.id}"])
        _start(state, replica_process(state, replica))
        state.faults = [f for f in state.faults if f != f"kill-replica:{replica.id}"]
        done = f"replica {replica.id} restarted (its counters start from zero)"
    elif name == "scale-out":
        index = len(state.replicas)
        replica = ReplicaSpec(f"r{index + 1}", state.ports.replica(index), state.replicas[0].flavour)
        _check_ports_free({f"replica {replica.id}": replica.port})
        state.replicas.append(replica)
        state.faults.append(f"{name}:{replica.id}")
        state.save()
        _start(state, replica_process(state, replica))
        _reconfigure(state)
        done = f"replica {replica.id} added on port {replica.port}"
    else:
        raise LabError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    state.save()
    _log_fault(state, "fault", name, replica.id if replica else None)
    if name == "scale-out":  # after the entry: the new replica serves, whether Prometheus scrapes it or not
        _reload_prometheus(state)
    return done


def heal(state: LabState) -> str:
    """Undo every fault: affinity back, caches on, killed replicas restarted, added ones removed."""
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
    _reconfigure(state)
    _log_fault(state, "heal", ",".join(healed) or "none")
    _reload_prometheus(state)  # after the entry: the gateways and replicas are healed either way
    return f"healed: {', '.join(healed) or 'nothing was broken'}"
