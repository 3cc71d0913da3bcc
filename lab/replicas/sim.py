"""The simulated replica: `kvwatch lab replica`, with ground truth of every request."""

from __future__ import annotations

from kvwatch.lab.process import Process, kvwatch_command
from kvwatch.lab.replicas.base import ReplicaKind, container_environment
from kvwatch.lab.state import LabState, ReplicaSpec


def _prepare(state: LabState) -> None:
    """Nothing to install: the simulator is part of kvwatch."""


def _process(state: LabState, replica: ReplicaSpec) -> Process:
    truth = state.directory / "ground-truth" / f"{replica.id}.jsonl"
    argv = kvwatch_command(
        "lab",
        "replica",
        "--port",
        str(replica.port),
        "--id",
        replica.id,
        "--flavour",
        replica.flavour,
        "--time-scale",
        str(state.time_scale),
        "--ground-truth",
        str(truth),
    )
    return Process(
        f"replica-{replica.id}",
        argv,
        f"http://127.0.0.1:{replica.port}/health",
        env=container_environment(state, replica),
    )


KIND = ReplicaKind(
    name="sim",
    prepare=_prepare,
    process=_process,
    flavour=None,
    live_prefix_caching=True,
    help="simulated replicas with vLLM- or SGLang-flavoured metrics and ground truth",
    fast_probe_interval_s=5,
    admin_api=True,
)
