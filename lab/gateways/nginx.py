"""nginx: the lab's config from lab/templates/, applied by a graceful reload (SIGHUP to the master)."""

from __future__ import annotations

import getpass
import os
import signal
import string
import subprocess
import time
from pathlib import Path

from kvwatch.lab.gateways.base import Gateway, await_serving, generation, listener_generations
from kvwatch.lab.process import LabError, Process, binary, is_ours
from kvwatch.lab.state import LabState

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
# Old nginx workers finish their in-flight requests before a reload is done: a real engine's take seconds.
RELOAD_TIMEOUT_S = 30.0

# How the affinity listener picks a replica, for each gateway fault.
BALANCERS = {
    "session": "        hash $kvwatch_session_id consistent;",
    "round_robin": "        # round robin (fault break-affinity)",
    "request_id": "        hash $request_id consistent;  # fault hash-request-id",
}


class _NginxTemplate(string.Template):
    delimiter = "@"  # nginx itself uses "$"


def render(state: LabState) -> dict[str, str]:
    """The config files for the current state (replicas, gateway faults), name -> text."""
    return _files(state, config_generation(state))


def config_generation(state: LabState) -> str:
    return generation(lambda stamp: _files(state, stamp))


def _files(state: LabState, stamp: str) -> dict[str, str]:
    servers = "\n".join(
        f"        server 127.0.0.1:{replica.port} max_fails=1 fail_timeout=10s;" for replica in state.replicas
    )
    user_line = f"user {getpass.getuser()};" if os.geteuid() == 0 else ""
    conf = _NginxTemplate((TEMPLATES / "nginx.conf").read_text()).substitute(
        user_line=user_line,
        state=state.directory,
        client_session_id='""' if "drop-session-header" in state.faults else "$http_x_session_id",
        affinity_balancer=BALANCERS[state.balancer],
        servers=servers,
        affinity_port=state.ports.affinity,
        round_robin_port=state.ports.round_robin,
        **_syslog_lines(state),
    )
    listener = _NginxTemplate((TEMPLATES / "listener.conf").read_text()).substitute(generation=stamp)
    proxy = (TEMPLATES / "proxy.conf").read_text()
    return {"nginx.conf": conf, "proxy.conf": proxy, "listener.conf": listener}


def _syslog_lines(state: LabState) -> dict[str, str]:
    """With the syslog source, each listener also sends its log over syslog (RFC 3164, UDP): the
    affinity one to kvwatch, the round_robin one to the lab's rsyslog, which relays it to kvwatch.
    The files stay: they are the ground truth."""
    if state.gateway_log_source != "syslog":
        return {"affinity_syslog": "", "round_robin_syslog": ""}
    line = "        access_log syslog:server=127.0.0.1:{},tag=nginx{} kvwatch_json;"
    return {
        "affinity_syslog": line.format(state.ports.syslog_affinity, ",nohostname"),
        "round_robin_syslog": line.format(state.ports.syslog_relay, ""),
    }


def write_configs(state: LabState) -> None:
    directory = state.directory / "nginx"
    (directory / "tmp").mkdir(parents=True, exist_ok=True)
    for name, text in render(state).items():
        (directory / name).write_text(text)


def process(state: LabState) -> Process:
    d = state.directory
    argv = [
        binary("nginx", "/usr/sbin/nginx"),
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


def _workers(master: int) -> set[int]:
    workers = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == master:
            workers.add(int(stat.parent.name))
    return workers


def apply(state: LabState) -> float:
    """Gracefully reload nginx with the written config, without dropping connections; return once only
    workers of that config serve, with the time of the SIGHUP (new workers take new requests from
    then on), else raise LabError saying what was seen."""
    check = subprocess.run([*process(state).argv, "-t", "-q"], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        raise LabError(f"generated nginx config is invalid:\n{check.stderr}")
    master = state.processes.get("nginx")
    if master is None or not is_ours(state, master):
        raise LabError("nginx is not running; start the lab with `kvwatch lab up`")
    expected = config_generation(state)
    before = _workers(master)
    reloaded = time.time()
    os.kill(master, signal.SIGHUP)

    def problem() -> str | None:
        """Done when both listeners answer the new generation and the old workers, which finish their
        in-flight requests on the old config, have exited."""
        old = _workers(master) & before
        answers = listener_generations(state)
        if not old and set(answers.values()) == {expected}:
            return None
        return (
            f"the listeners answer config generation {answers}, not {expected}; workers from before the "
            f"reload still running: {sorted(old) or 'none'}"
        )

    await_serving(state, problem, RELOAD_TIMEOUT_S, "nginx did not reload", "nginx-error")
    return reloaded


GATEWAY = Gateway(
    name="nginx",
    help="a consistent hash of the session id (`hash ... consistent`)",
    log_format="nginx",
    process=process,
    write_configs=write_configs,
    apply=apply,
)
