"""`sagemaker`: the lab's stand-in for Amazon SageMaker's runtime (front.py), one endpoint whose instances
are the replicas, run as SageMaker containers with stateful sessions. The affinity listener routes
requests without a session by the lab's `--sagemaker-routing`, the round_robin listener by `RANDOM`;
both pin sessions. The config is front.json in the state directory's sagemaker/, applied by SIGHUP.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping

import httpx

from kvwatch.core.connections import request_sync
from kvwatch.lab.gateways.base import Gateway, await_serving, generation, listener_generations
from kvwatch.lab.gateways.sagemaker.index import STALL_INDEX
from kvwatch.lab.gateways.sagemaker.routing import DEFAULT_PREFIX_LENGTH
from kvwatch.lab.process import LabError, Process, is_ours
from kvwatch.lab.state import LabState, ReplicaSpec

# The front fault: it passes no session id to the containers and pins nothing (`kvwatch lab fault`).
IGNORE_SESSIONS = "ignore-session-ids"
ENDPOINT = "lab-endpoint"
VARIANT = "AllTraffic"
LAB_REGION = "us-east-1"  # any region name: the front answers for every one, and the SigV4 is not verified
# kvwatch serve's AWS credentials in the lab: the front requires a signature but checks none of it.
LAB_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "AKIDKVWATCHLAB", "AWS_SECRET_ACCESS_KEY": "kvwatch-lab-not-a-secret"}
FRONT_FAULTS = (IGNORE_SESSIONS, STALL_INDEX)
LOAD_PATH = "/-/lab-load"  # the front's requests in flight per instance
RELOAD_TIMEOUT_S = 10.0
# Real vLLM on a CPU core takes seconds for a cold prefill; SageMaker allows a container 60 s.
CONTAINER_TIMEOUT_S = 120.0


def _config(state: LabState, stamp: str, held: Mapping[str, float] | None) -> dict:
    ports = state.ports
    return {
        "generation": stamp,
        "endpoint": ENDPOINT,
        "variant": VARIANT,
        "instances": [{"id": r.id, "url": f"http://{r.address}"} for r in state.replicas],
        "listeners": {
            "affinity": {"port": ports.affinity, "routing": state.sagemaker_routing},
            "round_robin": {"port": ports.round_robin, "routing": "RANDOM"},
        },
        "faults": [f for f in state.faults if f in FRONT_FAULTS],
        "log_directory": str(state.directory / "logs"),
        "prefix_length": DEFAULT_PREFIX_LENGTH,
        "concurrency_threshold": state.sagemaker_concurrency_threshold,
        "container_timeout_s": CONTAINER_TIMEOUT_S,
        "held": dict(held or {}),
        "session_ttl_s": state.session_ttl_s,
        "max_sessions": state.session_table_size,
        "admin_port": ports.gateway_admin,
    }


def sagemaker_endpoint(state: LabState) -> dict:
    """What a SageMaker client of the lab needs besides the listeners' URLs (`lab status --json`)."""
    return {"endpoint": ENDPOINT, "variant": VARIANT, "routing": state.sagemaker_routing}


def config_generation(state: LabState, held: Mapping[str, float] | None = None) -> str:
    return generation(lambda stamp: {"front.json": json.dumps(_config(state, stamp, held), sort_keys=True)})


def config_path(state: LabState):
    return state.directory / "sagemaker" / "front.json"


def write_configs(state: LabState, held: Mapping[str, float] | None = None) -> None:
    """front.json; `held`: the instances whose new requests wait for a config without them, and for how
    long at most."""
    path = config_path(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_config(state, config_generation(state, held), held), indent=2))
    tmp.replace(path)


def process(state: LabState) -> Process:
    argv = [sys.executable, "-m", "kvwatch.lab.gateways.sagemaker.front", str(config_path(state))]
    return Process("sagemaker", argv, f"http://127.0.0.1:{state.ports.affinity}/-/lab-config")


def apply(state: LabState, held: Mapping[str, float] | None = None) -> float:
    """SIGHUP the front; return once both listeners answer the written config's generation."""
    pid = state.processes.get("sagemaker")
    if pid is None or not is_ours(state, pid):
        raise LabError("the SageMaker front is not running; start the lab with `kvwatch lab up`")
    expected = config_generation(state, held)
    reloaded = time.time()
    os.kill(pid, signal.SIGHUP)

    def problem() -> str | None:
        answers = listener_generations(state)
        return None if set(answers.values()) == {expected} else f"answers {answers}, not {expected}"

    await_serving(
        state, problem, RELOAD_TIMEOUT_S, "the SageMaker front did not load its config", "sagemaker"
    )
    return reloaded


@contextlib.contextmanager
def holding(state: LabState, replica: ReplicaSpec, restart_s: float) -> Iterator[None]:
    """While the lab restarts a container to change it (its sessions expired), the front holds the new
    requests for it (up to `restart_s`, the restart's bound) and lets those in flight finish first: its
    clients see the change, never the restart, as a SageMaker endpoint's never see a container's
    internals. Released on the way out, whatever happened inside."""
    held = {replica.id: CONTAINER_TIMEOUT_S + restart_s}
    write_configs(state, held)
    apply(state, held)
    try:
        url = f"http://127.0.0.1:{state.ports.affinity}{LOAD_PATH}"

        def in_flight() -> str | None:
            try:
                count = request_sync("GET", url, 2).json().get(replica.id, 0)
            except (httpx.HTTPError, ValueError) as error:
                return f"no answer from {url}: {error!r}"
            return f"{count} requests in flight to {replica.id}" if count else None

        failure = "the front's requests did not finish"
        await_serving(state, in_flight, CONTAINER_TIMEOUT_S, failure, "sagemaker")
        yield
    finally:
        write_configs(state)
        apply(state)


GATEWAY = Gateway(
    name="sagemaker",
    help="Amazon SageMaker's runtime API (InvokeEndpoint, the response stream) with stateful sessions "
    "pinned to the instance that opened them; clients use the AWS SDK (botocore)",
    log_format="nginx",
    process=process,
    write_configs=write_configs,
    apply=apply,
    metrics_path="/metrics",  # the front's session table, on the admin port
)
