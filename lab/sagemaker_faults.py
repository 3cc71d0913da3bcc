"""The faults of a lab behind the sagemaker gateway, on the containers' side: every session expiring,
and the containers without SAGEMAKER_ENABLE_STATEFUL_SESSIONS. (The front's own, `ignore-session-ids`,
is a gateway fault; an instance killed with its sessions is `kill-replica`.)"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx

from kvwatch.core.connections import request_sync
from kvwatch.lab.gateways.sagemaker import holding
from kvwatch.lab.process import LabError
from kvwatch.lab.replicas import REPLICA_KINDS
from kvwatch.lab.replicas.base import DISABLE_SESSIONS, sessions_directory
from kvwatch.lab.state import LabState, ReplicaSpec
from kvwatch.lab.supervisor import STOP_TIMEOUT_S

EXPIRE_SESSIONS = "expire-sessions"
CONTAINER_FAULTS = (EXPIRE_SESSIONS, DISABLE_SESSIONS)

Restart = Callable[[LabState, ReplicaSpec, Callable[[], None]], None]


def inject(state: LabState, name: str, restart: Restart) -> str:
    """Inject a container fault on every replica; return once it serves, saying what changed.
    `restart(state, replica, while_stopped)` restarts a replica, calling `while_stopped` in between."""
    if name == EXPIRE_SESSIONS:
        expired = sum(_expire(state, replica, restart) for replica in state.replicas)
        return f"every open session expired ({expired} in all)"
    state.faults.append(DISABLE_SESSIONS)
    state.save()
    for replica in state.replicas:
        restart(state, replica, lambda: None)
    return "every replica restarted without SAGEMAKER_ENABLE_STATEFUL_SESSIONS (caches and sessions lost)"


def heal(state: LabState, restart: Restart) -> None:
    """Restart the replicas with stateful sessions if the fault had them without."""
    if DISABLE_SESSIONS in state.faults:
        state.faults.remove(DISABLE_SESSIONS)
        state.save()
        for replica in state.replicas:
            restart(state, replica, lambda: None)


def _expire(state: LabState, replica: ReplicaSpec, restart: Restart) -> int:
    """Expire a replica's sessions: the simulator's through its admin API, a real engine's by dating
    their files in the past while it is stopped (the session manager restores them at start), the front
    holding its requests meanwhile: a round in flight finishes, the next one waits and meets the expiry."""
    if REPLICA_KINDS.lookup(state.engine).admin_api:
        return _expire_live(replica)
    dated = []
    started = REPLICA_KINDS.lookup(state.engine).process(state, replica)
    restart_s = 2 * STOP_TIMEOUT_S + started.ready_timeout_s  # stopped (SIGTERM, SIGKILL), then ready
    with holding(state, replica, restart_s):
        restart(state, replica, lambda: dated.extend(_date_files(state, replica, time.time() - 1)))
    return len(dated)


def _expire_live(replica: ReplicaSpec) -> int:
    try:
        answer = request_sync("POST", f"http://127.0.0.1:{replica.port}/lab/expire-sessions", 10)
    except httpx.HTTPError as error:
        raise LabError(f"replica {replica.name} did not answer its admin API: {error!r}") from None
    if answer.status_code != 200:
        raise LabError(f"replica {replica.name} could not expire its sessions: {answer.text}")
    return answer.json()["expired"]


def _date_files(state: LabState, replica: ReplicaSpec, expiry: float) -> list[str]:
    """Give every session file of the replica `expiry`; the sessions dated."""
    stamps = list(sessions_directory(state, replica).glob("*/.expiration_ts"))
    for stamp in stamps:
        stamp.write_text(json.dumps(expiry))
    return [stamp.parent.name for stamp in stamps]
