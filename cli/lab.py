"""`kvwatch lab ...`: run the simulated cluster and its parts."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from kvwatch.cli.options import command, kvwatch_command, not_positive
from kvwatch.config.settings import LAB_DIRECTORY
from kvwatch.lab import stack
from kvwatch.lab.engine import ANSWER_STYLES, ReplicaSettings
from kvwatch.lab.flavours import SIMULATED_FLAVOURS
from kvwatch.lab.gateways import GATEWAYS
from kvwatch.lab.gateways.envoy import LOAD_BALANCERS
from kvwatch.lab.gateways.sagemaker.routing import DEFAULT_CONCURRENCY_THRESHOLD, DEFAULT_ROUTING, STRATEGIES
from kvwatch.lab.metrics_stores import METRICS_STORES
from kvwatch.lab.replicas import REPLICA_KINDS
from kvwatch.lab.replicas.base import ReplicaKind
from kvwatch.lab.stack import FAULTS
from kvwatch.lab.state import (
    CLUSTER_PORT_STRIDE,
    LOG_SOURCE_GATEWAYS,
    MAX_CLUSTER_REPLICAS,
    MAX_CLUSTERS,
    LabState,
    forget_running,
    record_running,
)

TRAFFIC_HELP = "simulate users holding multi-turn conversations through a gateway"
TRAFFIC_DESCRIPTION = (
    "Run concurrent simulated users, each holding one multi-turn conversation after "
    "another through an OpenAI-compatible gateway, until SIGINT or SIGTERM."
)

REPLICA_HELP = "serve one simulated vLLM / SGLang replica on 127.0.0.1"
REPLICA_DESCRIPTION = (
    "Serve one simulated inference replica on 127.0.0.1: an OpenAI-compatible API, "
    "a real prefix cache, engine metrics of the chosen flavour, ground truth and faults."
)

UP_HELP = "start the whole lab: replicas, a gateway, Prometheus, Alertmanager, background users"
UP_DESCRIPTION = (
    "Start the simulated cluster on 127.0.0.1 and print its URLs. In the foreground "
    "(the default) Ctrl-C stops everything; with --detach stop it with `kvwatch lab down`, from any "
    "directory."
)

# Strict round robin sends a probe run's request n to replica n mod R. With the lab's two sessions a run
# (interleaved) and six rounds, 5 replicas bring a session back to a replica holding its history only in
# round 6, so round robin's warm rounds pay the prefill; 4 replicas gave every round from 3 on round
# n - 2's cache, and round robin looked as warm as affinity. Real vLLM on CPU: two replicas, one core
# each on a 2-core machine, and lighter background traffic.
DEFAULT_REPLICAS = {"sim": 5, "vllm": 2}
DEFAULT_USERS = {"sim": 4, "vllm": 2}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    lab = subparsers.add_parser(
        "lab", help="run the simulated cluster (the lab)", description="Run the simulated cluster."
    )
    commands = lab.add_subparsers(dest="lab_command", metavar="COMMAND", required=True)
    _add_stack_commands(commands)
    _add_replica(commands)
    _add_traffic(commands)


def _add_replica(commands: argparse._SubParsersAction) -> None:
    defaults = ReplicaSettings(replica_id="")
    replica = command(commands, "replica", _run_replica, help=REPLICA_HELP, description=REPLICA_DESCRIPTION)
    replica.add_argument("--port", type=int, required=True, help="port on 127.0.0.1")
    replica.add_argument("--id", required=True, dest="replica_id", help="replica name, e.g. r1")
    replica.add_argument(
        "--flavour",
        choices=sorted(SIMULATED_FLAVOURS),
        default=defaults.flavour,
        help="engine whose metrics to expose (default %(default)s)",
    )
    replica.add_argument("--model", default=defaults.model, help="served model name")
    for flag, dest, kind, text in (
        ("--block-size", "block_size", int, "prefix-cache block size in tokens (default %(default)s)"),
        ("--cache-blocks", "cache_blocks", int, "prefix-cache capacity in blocks (default %(default)s)"),
        ("--prefill-rate", "prefill_tokens_per_s", float, "prefill tokens per second (default %(default)s)"),
        (
            "--decode-rate",
            "decode_tokens_per_s",
            float,
            "decode tokens per second per sequence (default %(default)s)",
        ),
        ("--overhead", "request_overhead_s", float, "fixed seconds per request (default %(default)s)"),
        (
            "--max-num-seqs",
            "max_num_seqs",
            int,
            "concurrent sequences before requests wait (default %(default)s)",
        ),
        (
            "--answer-tokens",
            "answer_tokens",
            int,
            "tokens per answer unless max_tokens is lower (default %(default)s)",
        ),
        ("--time-scale", "time_scale", float, "multiply every simulated delay, e.g. 0.1 for fast tests"),
    ):
        replica.add_argument(flag, type=kind, dest=dest, default=getattr(defaults, dest), help=text)
    replica.add_argument(
        "--answer-style",
        choices=ANSWER_STYLES,
        default=defaults.answer_style,
        help="content: answer text; reasoning: a reasoning model's thinking (delta.reasoning in the vllm "
        "flavour, else delta.reasoning_content) before the text; tool-call: delta.tool_calls and no "
        "text (default %(default)s)",
    )
    replica.add_argument(
        "--no-identity-header",
        action="store_false",
        dest="identity_header",
        help="do not send X-Worker-Id (like a real engine, which names no replica)",
    )
    replica.add_argument(
        "--ground-truth",
        type=Path,
        dest="ground_truth_path",
        help="also append every request's ground truth to this JSONL file",
    )
    replica.add_argument(
        "--ground-truth-max-bytes",
        type=int,
        default=defaults.ground_truth_max_bytes,
        metavar="BYTES",
        help="rename the ground-truth file to FILE.1 (replacing the one before) at this size "
        "(default %(default)s: 64 MiB)",
    )
    replica.add_argument("--seed", type=int, default=defaults.seed, help="seed of the error fault")


def _add_traffic(commands: argparse._SubParsersAction) -> None:
    from kvwatch.lab.traffic import add_arguments, run_cli

    traffic = command(commands, "traffic", run_cli, help=TRAFFIC_HELP, description=TRAFFIC_DESCRIPTION)
    add_arguments(traffic)


def _run_replica(args: argparse.Namespace) -> int:
    from kvwatch.lab.server import PortInUse, serve

    fields = ReplicaSettings.__dataclass_fields__
    settings = ReplicaSettings(**{k: v for k, v in vars(args).items() if k in fields})
    problems = not_positive(
        {
            "--block-size": settings.block_size,
            "--cache-blocks": settings.cache_blocks,
            "--max-num-seqs": settings.max_num_seqs,
            "--answer-tokens": settings.answer_tokens,
            "--ground-truth-max-bytes": settings.ground_truth_max_bytes,
            "--prefill-rate": settings.prefill_tokens_per_s,
            "--decode-rate": settings.decode_tokens_per_s,
            "--time-scale": settings.time_scale,
        }
    )
    if settings.request_overhead_s < 0:
        problems.append("--overhead must not be negative")
    if problems:
        print("kvwatch lab replica: " + "; ".join(problems), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        asyncio.run(serve(settings, args.port))
    except PortInUse as error:
        print(f"kvwatch lab replica: {error}", file=sys.stderr)
        return 1
    return 0


def _state_dir_argument(parser: argparse.ArgumentParser, default: Path | None = None) -> None:
    """--state-dir: for `up` where to start the lab; for the others, unset, the running lab (`_lab_dir`)."""
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=default,
        help="where the lab keeps configs, logs and PIDs (default %(default)s)"
        if default
        else f"the lab's directory (default: {LAB_DIRECTORY} when a lab runs there, else the one lab "
        "running for this user, from any directory)",
    )


def _lab_dir(args: argparse.Namespace) -> Path:
    """The lab a command acts on: the one named, else the running one (stack.find)."""
    return args.state_dir.resolve() if args.state_dir else stack.find(LAB_DIRECTORY)


def _how_to_reach() -> str:
    """How to run the lab's commands from a new shell, where `make up`'s virtualenv is not active."""
    kvwatch = kvwatch_command()
    if kvwatch == "kvwatch":
        return "Lab commands work from any directory: `kvwatch lab status`, `kvwatch lab fault ...`."
    venv = Path(kvwatch).parent.parent
    return (
        f"In a new shell, kvwatch is {kvwatch} (or run `. {venv}/bin/activate` first), e.g. "
        f"`{kvwatch} lab status`; lab commands work from any directory."
    )


def _family_argument(parser: argparse.ArgumentParser, flag: str, family: dict, default: str) -> None:
    """A choice of one member of a family (a registry of kinds), each member's help in the option's."""
    parser.add_argument(
        flag,
        choices=sorted(family),
        default=default,
        help="; ".join(f"{name}: {member.help}" for name, member in sorted(family.items()))
        + " (default %(default)s)",
    )


def _add_up_command(commands: argparse._SubParsersAction) -> None:
    up = command(commands, "up", _run_up, help=UP_HELP, description=UP_DESCRIPTION)
    _family_argument(up, "--engine", REPLICA_KINDS, "sim")
    _family_argument(up, "--gateway", GATEWAYS, "nginx")
    _family_argument(up, "--metrics-store", METRICS_STORES, "prometheus")
    up.add_argument(
        "--gateway-log-source",
        choices=["file", *LOG_SOURCE_GATEWAYS],
        default="file",
        help="how kvwatch gets the gateway's access logs: file (followed), syslog (with --gateway nginx: "
        "nginx sends the affinity log over UDP, the round_robin log through a real rsyslog relay as RFC "
        "5424 over TCP), or otlp (with --gateway envoy: Envoy's OpenTelemetry access logger sends both "
        "over OTLP/gRPC); the files stay as ground truth (default %(default)s)",
    )
    up.add_argument(
        "--envoy-lb",
        choices=sorted(LOAD_BALANCERS),
        help="the consistent hash of Envoy's affinity cluster: ring-hash (RING_HASH, Istio's default) or "
        "maglev (MAGLEV); with --gateway envoy (default ring-hash)",
    )
    up.add_argument(
        "--sagemaker-routing",
        choices=list(STRATEGIES),
        help="how the SageMaker endpoint's affinity listener routes requests without a session "
        "(its round_robin listener: RANDOM); with --gateway sagemaker (default LEAST_OUTSTANDING_REQUESTS)",
    )
    up.add_argument(
        "--session-ttl",
        type=float,
        metavar="S",
        help="with --gateway sagemaker: idle seconds a session lives in the front's session table and the "
        "containers (SAGEMAKER_SESSIONS_EXPIRATION); default theirs (1,200 s), unbounded in the front",
    )
    up.add_argument(
        "--session-table-size",
        type=int,
        metavar="N",
        help="with --gateway sagemaker: sessions the front's table holds at most; a new one beyond is "
        "refused with 503 (default unbounded)",
    )
    up.add_argument(
        "--sagemaker-concurrency-threshold",
        type=int,
        help="the requests in flight on the instance PREFIX_AWARE chose past which it sends one elsewhere "
        f"(SageMaker's ConcurrencyThreshold, 1-1024); with --gateway sagemaker (default "
        f"{DEFAULT_CONCURRENCY_THRESHOLD})",
    )
    _add_up_scale(up)
    _state_dir_argument(up, LAB_DIRECTORY)


def _add_up_scale(up: argparse.ArgumentParser) -> None:
    """`lab up`'s size, pace and what runs beside the cluster."""
    up.add_argument(
        "--replicas",
        type=int,
        help=f"number of replicas (default {DEFAULT_REPLICAS['sim']}, or {DEFAULT_REPLICAS['vllm']} "
        "with --engine vllm)",
    )
    up.add_argument(
        "--flavours",
        help="comma-separated metric flavours of simulated replicas, assigned in turn (default vllm)",
    )
    up.add_argument("--fast", action="store_true", help="1 s scrape and rule evaluation (for tests)")
    up.add_argument(
        "--base-port",
        type=int,
        default=18000,
        help="first of the lab's ports; replicas start at base + 10 (default %(default)s)",
    )
    up.add_argument("--time-scale", type=float, default=1.0, help="replica delay multiplier (default 1)")
    up.add_argument(
        "--users",
        type=int,
        help=f"concurrent background users through the affinity gateway; 0 for none (default "
        f"{DEFAULT_USERS['sim']}, or {DEFAULT_USERS['vllm']} with --engine vllm)",
    )
    up.add_argument(
        "--think",
        type=float,
        default=1.0,
        help="seconds a background user thinks between rounds (default %(default)s)",
    )
    up.add_argument(
        "--rule-time-scale",
        type=float,
        default=1.0,
        help="run rule windows, `for` and Alertmanager timers at this fraction of production, e.g. 0.1",
    )
    up.add_argument(
        "--no-probes",
        dest="probes",
        action="store_false",
        help="kvwatch serve runs without its scheduled probes (for measurements that want no extra traffic)",
    )
    up.add_argument(
        "--no-dashboard",
        dest="dashboard",
        action="store_false",
        help="do not start the Streamlit dashboard (Prometheus, Alertmanager and kvwatch serve still run)",
    )
    up.add_argument(
        "--clusters",
        type=int,
        default=1,
        metavar="N",
        help="run N clusters a, b, ... (each with its replicas, gateway, kvwatch and an agent Prometheus "
        "remote-writing with external label cluster) feeding one central Prometheus, which evaluates "
        "kvwatch's rules and alerts the lab's Alertmanager; cluster i takes the ports from base + "
        f"{CLUSTER_PORT_STRIDE} * (i + 1) (default %(default)s)",
    )
    up.add_argument("--detach", action="store_true", help="return once the lab is up")


def _add_stack_commands(commands: argparse._SubParsersAction) -> None:
    _add_up_command(commands)

    down = command(commands, "down", _run_down, help="stop every process of the lab, by PID")
    _state_dir_argument(down)

    status = command(commands, "status", _run_status, help="print every URL of the running lab")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _state_dir_argument(status)

    fault = command(
        commands,
        "fault",
        _run_fault,
        help="break the lab on purpose",
        description="Inject a fault; `kvwatch lab heal` undoes all.",
    )
    fault.add_argument("name", choices=FAULTS, metavar="NAME", help=", ".join(FAULTS))
    fault.add_argument("replica_id", nargs="?", help="replica for kill-replica / restart-replica")
    fault.add_argument("--replica", help="replica id, e.g. r2")
    fault.add_argument("--cluster", help="the cluster to break, in a lab of several (lab up --clusters)")
    _state_dir_argument(fault)

    heal = command(commands, "heal", _run_heal, help="undo every fault")
    heal.add_argument("--cluster", help="heal only this cluster, in a lab of several (default: every one)")
    _state_dir_argument(heal)


def _fail(message: str) -> int:
    print(f"kvwatch lab: {message}", file=sys.stderr)
    return 1


def _print_status(info: dict) -> None:
    if "clusters" in info:
        for name in ("prometheus", "alertmanager"):
            print(f"central {name:<12} {info[name] or '-'}")
        print(f"state and logs       {info['state_dir']}")
        for name, cluster in info["clusters"].items():
            print(f"\ncluster {name}")
            _print_status(cluster)
        return
    print(f"engine               {info['engine']}, model {info['model']}")
    print(f"gateway              {info['gateway']}")
    if endpoint := info.get("sagemaker"):
        routed = f"variant {endpoint['variant']}, {endpoint['routing']}"
        print(f"sagemaker endpoint   {endpoint['endpoint']} ({routed})")
    print(f"affinity gateway     {info['gateways']['affinity']}")
    print(f"round-robin gateway  {info['gateways']['round_robin']}")
    print(f"{info['metrics_store']:<20} {info['prometheus'] or '-'}")
    if info["rules"] != info["prometheus"]:
        print(f"{'rules and alerts':<20} {info['rules'] or '-'}")
    for name in ("alertmanager", "exporter", "dashboard"):
        print(f"{name:<20} {info[name] or '-'}")
    for replica in info["replicas"]:
        caching = "" if replica["prefix_caching"] else ", prefix caching off"
        print(f"replica {replica['name']:<28} {replica['url'] or 'down'} ({replica['flavour']}{caching})")
    print(f"background users     {info['traffic_users']}")
    print(f"faults               {', '.join(info['faults_described']) or 'none'}")
    print(f"state and logs       {info['state_dir']}")


def _parts_refusal(args: argparse.Namespace, kind: ReplicaKind, flavours: list[str]) -> str | None:
    """Why `lab up` cannot run these parts together (engine, gateway, log source, store), or None."""
    wanted_gateway = LOG_SOURCE_GATEWAYS.get(args.gateway_log_source, args.gateway)
    sagemaker_only = args.session_ttl is not None or args.session_table_size is not None
    unknown = sorted(set(flavours) - set(SIMULATED_FLAVOURS))
    refusals = (
        (
            kind.flavour and args.flavours is not None,
            f"--flavours is for simulated replicas; --engine {kind.name} exports {kind.flavour} metrics",
        ),
        (
            args.gateway != wanted_gateway,
            f"--gateway-log-source {args.gateway_log_source} is for --gateway {wanted_gateway}, "
            f"not {args.gateway}",
        ),
        (
            METRICS_STORES[args.metrics_store].rules_apart
            and (args.clusters > 1 or args.gateway_log_source == "syslog"),
            f"--metrics-store {args.metrics_store} runs one cluster, with its rule engine on the port of "
            "the syslog relay: no --clusters or --gateway-log-source syslog",
        ),
        (
            args.envoy_lb and args.gateway != "envoy",
            f"--envoy-lb is for --gateway envoy; the {args.gateway} gateway has its own balancing",
        ),
        (
            args.sagemaker_routing and args.gateway != "sagemaker",
            f"--sagemaker-routing is for --gateway sagemaker, not {args.gateway}",
        ),
        (
            args.sagemaker_concurrency_threshold is not None
            and (args.gateway != "sagemaker" or not 1 <= args.sagemaker_concurrency_threshold <= 1024),
            "--sagemaker-concurrency-threshold is from 1 to 1024, for --gateway sagemaker",
        ),
        (
            sagemaker_only and args.gateway != "sagemaker",
            f"--session-ttl and --session-table-size are for --gateway sagemaker, not {args.gateway}",
        ),
        (
            (args.session_ttl is not None and args.session_ttl <= 0) or (args.session_table_size or 1) < 1,
            "--session-ttl must be positive, --session-table-size at least 1",
        ),
        (
            args.gateway == "sagemaker" and args.users,
            "the background users speak OpenAI's API, which the SageMaker runtime does not: --users 0",
        ),
        (
            unknown or not flavours,
            f"unknown flavour(s) {', '.join(unknown) or '(none given)'}; "
            f"known: {', '.join(sorted(SIMULATED_FLAVOURS))}",
        ),
    )
    return next((message for refused, message in refusals if refused), None)


def _size_refusal(args: argparse.Namespace) -> str | None:
    """Why `lab up` cannot run at this size or these time scales, or None."""
    scales = (args.time_scale, args.rule_time_scale)
    if args.replicas < 1 or args.users < 0 or args.think < 0 or min(scales) <= 0:
        return "--replicas must be at least 1, --users and --think at least 0, the time scales positive"
    if not 1 <= args.clusters <= MAX_CLUSTERS:
        return f"--clusters must be from 1 to {MAX_CLUSTERS}: their ports share one block of 100"
    if args.clusters > 1 and args.replicas > MAX_CLUSTER_REPLICAS:
        return f"--replicas must be at most {MAX_CLUSTER_REPLICAS} a cluster with --clusters"
    return None


def _run_up(args: argparse.Namespace) -> int:
    kind = REPLICA_KINDS[args.engine]
    flavours = [f.strip() for f in (args.flavours or "vllm").split(",") if f.strip()]
    if refusal := _parts_refusal(args, kind, flavours):
        return _fail(refusal)
    args.replicas = DEFAULT_REPLICAS[kind.name] if args.replicas is None else args.replicas
    args.users = 0 if args.gateway == "sagemaker" else args.users
    args.users = DEFAULT_USERS[kind.name] if args.users is None else args.users
    if refusal := _size_refusal(args):
        return _fail(refusal)
    try:
        with stack.locked(args.state_dir.resolve(), _say_waiting):
            state = _start(args, kind.name, flavours)
    except stack.LabError as error:
        return _fail(str(error))
    except KeyboardInterrupt:
        print("Interrupted while starting; everything started was stopped.", file=sys.stderr)
        return 130
    record_running(state.directory)
    _print_status(stack.status(state))
    print(_how_to_reach())
    if args.detach:
        print(f"The lab runs in the background; stop it with `{kvwatch_command()} lab down`.")
        return 0
    return _stay_up(state)


def _start(args: argparse.Namespace, engine: str, flavours: list[str]) -> LabState:
    return stack.up(
        args.state_dir,
        args.base_port,
        args.replicas,
        flavours,
        args.clusters,
        fast=args.fast,
        time_scale=args.time_scale,
        users=args.users,
        think_seconds=args.think,
        rule_time_scale=args.rule_time_scale,
        probes=args.probes,
        dashboard=args.dashboard,
        engine=engine,
        gateway=args.gateway,
        metrics_store=args.metrics_store,
        gateway_log_source=args.gateway_log_source,
        envoy_lb=args.envoy_lb or "ring-hash",
        sagemaker_routing=args.sagemaker_routing or DEFAULT_ROUTING,
        sagemaker_concurrency_threshold=args.sagemaker_concurrency_threshold or DEFAULT_CONCURRENCY_THRESHOLD,
        session_ttl_s=args.session_ttl,
        session_table_size=args.session_table_size,
    )


def _stay_up(state: LabState) -> int:
    """In the foreground: serve until SIGINT or SIGTERM, then stop the lab as other commands left it."""
    print("The lab is up. Press Ctrl-C to stop it.")
    stop = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.append(True))
    while not stop:
        stack.idle()
    try:
        with stack.locked(state.directory, _say_waiting):
            stack.down(LabState.load(state.directory))  # as other commands left it: scale-out adds replicas
    except stack.LabError as error:
        return _fail(str(error))
    forget_running(state.directory)
    print("The lab is down.")
    return 0


def _say_waiting(holder: str) -> None:
    print(f"kvwatch lab: waiting for process {holder}, which is changing this lab", file=sys.stderr)


@contextlib.contextmanager
def _changing(args: argparse.Namespace) -> Iterator[LabState]:
    """The lab's state, loaded under the lab's lock and changed before it is released."""
    directory = _lab_dir(args)
    LabState.load(directory)  # no lab here: say how to start one, before a lock file is made
    with stack.locked(directory, _say_waiting):
        yield LabState.load(directory)


def _run_down(args: argparse.Namespace) -> int:
    try:
        with _changing(args) as state:
            stack.down(state)
    except (FileNotFoundError, stack.LabError) as error:
        return _fail(str(error))
    forget_running(state.directory)
    print("The lab is down.")
    return 0


def _run_status(args: argparse.Namespace) -> int:
    try:
        info = stack.status(LabState.load(_lab_dir(args)))
    except (FileNotFoundError, stack.LabError) as error:
        return _fail(str(error))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_status(info)
    return 0


def _run_fault(args: argparse.Namespace) -> int:
    try:
        with _changing(args) as state:
            print(stack.fault(stack.cluster(state, args.cluster), args.name, args.replica or args.replica_id))
    except (FileNotFoundError, LookupError, stack.LabError) as error:
        return _fail(str(error))
    return 0


def _run_heal(args: argparse.Namespace) -> int:
    try:
        with _changing(args) as state:
            every = args.cluster is None and state.clusters  # heal every cluster unless one is named
            for lab in stack.labs(state)[1:] if every else [stack.cluster(state, args.cluster)]:
                print(f"cluster {lab.cluster}: {stack.heal(lab)}" if lab.cluster else stack.heal(lab))
    except (FileNotFoundError, stack.LabError) as error:
        return _fail(str(error))
    return 0
