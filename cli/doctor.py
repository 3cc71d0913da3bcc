"""Walk the troubleshooting checklist against one route: reachability and the base URL, auth, the response's
shape, whether the session id reaches the router and is its hash key, prefix caching in the engines and,
from a sample of request payloads, dynamic content at the front of the prompts; or, with
--sagemaker-endpoint, a few sessions through a SageMaker endpoint's runtime API. Each check prints its
evidence and fix. With --setup --config FILE, check kvwatch's own pipeline instead: serve, Prometheus'
scrapes, rules and Alertmanager, Alertmanager's route to kvwatch's webhook, the store."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from kvwatch.cli import options
from kvwatch.collectors.probe.models import chosen_model
from kvwatch.collectors.probe.session import api_url, resolve_api_key
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import load_config
from kvwatch.core.labels import CLUSTER_LABEL
from kvwatch.core.progress import Progress
from kvwatch.core.redaction import redact
from kvwatch.doctor import affinity
from kvwatch.doctor.caching import Cluster
from kvwatch.doctor.checks import CHECKS, diagnose
from kvwatch.doctor.findings import Diagnosis
from kvwatch.doctor.report import format_diagnosis, format_links
from kvwatch.doctor.sagemaker import diagnose_sagemaker
from kvwatch.doctor.setup import check_setup
from kvwatch.prometheus.pipeline import OK

HELP = "find why session affinity or the prefix cache does not work, and say how to fix it"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = options.command(subparsers, "doctor", run_cli, help=HELP, description=__doc__)
    parser.add_argument(
        "--setup",
        action="store_true",
        help="check kvwatch's own pipeline as --config sets it up, one line per link with its fix "
        "(1 when a link is broken or could not be judged)",
    )
    parser.add_argument("--config", type=Path, metavar="FILE", help="kvwatch YAML config, for --setup")
    options.add_route_arguments(parser, required=False, sagemaker=True)
    options.add_session_arguments(parser, "session id header, e.g. x-smg-routing-key for SMG")
    parser.add_argument(
        "--no-session",
        action="store_true",
        help="with --sagemaker-endpoint: probe as an application that opens no stateful session (no "
        "SessionId), to see what the endpoint's routing does without one",
    )
    parser.add_argument(
        "--gateway",
        choices=list(affinity.SYSTEMS),
        help="the gateway or router in front of the replicas, whose settings the fixes name "
        "(envoy: Envoy and Istio); by default the one an answer's headers show, else every one",
    )
    options.add_block_size_arguments(parser)
    parser.add_argument(
        "--requests-sample",
        metavar="FILE",
        help='JSONL file of real request payloads, one {"messages": [...]} per line',
    )
    parser.add_argument(
        "--timeout", type=float, default=15.0, metavar="S", help="seconds per request (default %(default)g)"
    )
    parser.add_argument(
        "--cluster",
        metavar="NAME",
        help="in a --prometheus of several clusters, read this cluster's engines only (default: every "
        "cluster, each instance named with its own)",
    )
    parser.add_argument(
        "--cluster-label",
        default=CLUSTER_LABEL,
        metavar="LABEL",
        help="the label that tells clusters apart, as cluster_label in kvwatch.yaml (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help='print {"checks": [...], "causes": [...]}')


def run_cli(args: argparse.Namespace) -> int:
    """`kvwatch doctor`: 1 when a check fails, 2 on bad arguments."""
    if args.setup:
        return run_setup(args)
    if args.sagemaker_endpoint:
        return _sagemaker(args)
    try:
        if args.no_session:
            raise ValueError("--no-session is for a --sagemaker-endpoint")
        if not args.base_url:
            raise ValueError(
                "the following arguments are required: --base-url or --sagemaker-endpoint "
                "(or --setup --config FILE)"
            )
        block_sources = options.block_size_sources(args, [args.base_url])
        if args.requests_sample and not Path(args.requests_sample).is_file():
            raise ValueError(f"--requests-sample {args.requests_sample}: no such file")
        if args.cluster is not None and not args.prometheus:
            raise ValueError("--cluster names a cluster in --prometheus: give --prometheus too")
        cluster = Cluster(args.cluster, args.cluster_label)
        api_key = resolve_api_key(args.api_key_env, args.api_key_file)
        probe = options.route_settings(
            args,
            base_url=args.base_url,
            model=chosen_model(args.model, args.base_url, api_key, args.timeout, "doctor"),
            api_key=api_key,
            timeout_seconds=args.timeout,
        )
    except ValueError as error:
        print(f"kvwatch doctor: {error}", file=sys.stderr)
        return 2
    with Progress.on_terminal("doctor", "checks", json=args.json) as progress:
        progress.start(CHECKS)
        diagnosis = diagnose(
            probe,
            args.prometheus,
            args.requests_sample,
            block_sources,
            progress.advance,
            args.gateway,
            cluster,
        )
    return _print(
        args, diagnosis, f"{redact(api_url(probe.base_url, 'chat/completions'))}, model {probe.model}"
    )


def _sagemaker(args: argparse.Namespace) -> int:
    """The doctor on a SageMaker endpoint: a few sessions through its runtime API (doctor.sagemaker)."""
    try:
        endpoint = options.sagemaker_endpoint(args)
        probe = options.route_settings(
            args,
            base_url=endpoint.base_url,
            model=args.model,
            timeout_seconds=args.timeout,
            kind="sagemaker",
            sagemaker=endpoint,
            session_mode="none" if args.no_session else "client",
        )
    except ValueError as error:
        print(f"kvwatch doctor: {error}", file=sys.stderr)
        return 2
    return _print(
        args, diagnose_sagemaker(probe), f"SageMaker endpoint {endpoint.endpoint_name}, model {args.model}"
    )


def _print(args: argparse.Namespace, diagnosis: Diagnosis, route: str) -> int:
    if args.json:
        print(json.dumps(diagnosis.as_json(), indent=2))
    else:
        print(f"kvwatch doctor: {route}\n")
        print(format_diagnosis(diagnosis))
    return 1 if diagnosis.failed else 0


def run_setup(args: argparse.Namespace) -> int:
    """`kvwatch doctor --setup`: one line per link of kvwatch's pipeline; 1 unless every link holds."""
    if args.config is None or args.base_url or args.sagemaker_endpoint:
        print(
            "kvwatch doctor: --setup checks the pipeline --config FILE sets up: give --config, "
            "not --base-url or --sagemaker-endpoint",
            file=sys.stderr,
        )
        return 2
    try:
        config = load_config(args.config)
    except ConfigError as error:
        print(f"kvwatch doctor: {error}", file=sys.stderr)
        return 2
    found = check_setup(config, args.timeout)
    if args.json:
        print(json.dumps({"links": [asdict(link) for link in found]}, indent=2))
    else:
        print(f"kvwatch doctor --setup: the pipeline {args.config} sets up\n")
        print(format_links(found))
    return 0 if all(link.status == OK for link in found) else 1
