"""`kvwatch generate`: write kvwatch's generated files (recording and alerting rules, the Kubernetes
PrometheusRule, Grafana boards and their copies for the Kubernetes ConfigMaps) from prometheus/, alerts/
and grafana/.

`--config FILE` reads a thresholds file (prometheus/thresholds.py; docs/alerts.md "Thresholds file"),
without it the defaults, which the committed files are; `--out DIR` writes under DIR, without it the
repository's own files; `--check` exits 1 and names the stale files instead; `--runbook-url URL` links the
alerts and boards to a runbook published elsewhere; `--cluster-label NAME` makes the rules aggregate by
another label than `cluster` (e.g. `region`). Output is deterministic, so the committed files are checked
for drift by the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from kvwatch.alerts.alerts import alerts
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import cluster_label_problem
from kvwatch.core.connections import url_problem
from kvwatch.core.labels import CLUSTER_LABEL
from kvwatch.core.naming import RUNBOOK_URL
from kvwatch.grafana import boards
from kvwatch.prometheus.queries import Grouping
from kvwatch.prometheus.rules import (
    RULE_GROUPS,
    RuleEntry,
    gateway_rules,
    probe_share_rules,
    prometheus_rule,
    recording_rules,
    router_rules,
    rule_file,
)
from kvwatch.prometheus.thresholds import THRESHOLDS, Thresholds, load_thresholds

REPO = Path(__file__).resolve().parent.parent
K8S_DASHBOARDS = "deploy/k8s/dashboards"  # the boards the Grafana sidecar loads from ConfigMaps
_PLAIN_URL = re.compile(r"[^\s\"'\\#]+")


def rule_files(
    cluster_label: str = CLUSTER_LABEL, t: Thresholds = THRESHOLDS
) -> dict[str, tuple[str, tuple[RuleEntry, ...]]]:
    """Repository path -> (group, rules) of every rule file, aggregating by `cluster_label`, the alerts
    judging by `t`: the committed files use the defaults, `kvwatch generate` writes them for others."""
    by = Grouping(cluster_label)
    rules = {
        "kvwatch-engines": recording_rules(by, t),
        "kvwatch-gateway": gateway_rules(by),
        "kvwatch-routers": router_rules(by),
        "kvwatch-probe-share": probe_share_rules(by),
        "kvwatch-alerts": alerts(t, by),
    }
    return {RULE_GROUPS[group]: (group, entries) for group, entries in rules.items()}


RULE_FILES = rule_files()


def rule_file_texts(cluster_label: str = CLUSTER_LABEL, t: Thresholds = THRESHOLDS) -> dict[str, str]:
    """Repository path -> text of every rule file and of the Kubernetes PrometheusRule holding them all."""
    files = rule_files(cluster_label, t)
    texts = {path: rule_file(group, rules) for path, (group, rules) in files.items()}
    texts["deploy/k8s/prometheusrule.yaml"] = prometheus_rule(files)
    return texts


def generated_files(
    runbook_url: str = RUNBOOK_URL, cluster_label: str | None = None, thresholds: Thresholds = THRESHOLDS
) -> dict[str, str]:
    """Repository path -> text of every generated file, each link to the runbook at `runbook_url`, judging
    by `thresholds` and aggregating by `cluster_label` (default: the thresholds').

    The rules and boards are built against RUNBOOK_URL, a string nothing else contains, and that is moved
    as a whole: the one way every alert annotation and board link follows the setting.
    """
    t = dataclasses.replace(thresholds, cluster_label=cluster_label) if cluster_label else thresholds
    files = rule_file_texts(t.cluster_label, t) | kubernetes_boards(boards.dashboard_files(t))
    return {path: text.replace(RUNBOOK_URL, runbook_url) for path, text in files.items()}


def kubernetes_boards(files: dict[str, str]) -> dict[str, str]:
    """The boards and, for deploy/k8s's ConfigMaps, a copy of each provisioned one beside its
    kustomization, which reads no file above its own directory."""
    copies = {
        f"{K8S_DASHBOARDS}/{Path(path).name}": text
        for path, text in files.items()
        if path.startswith("grafana/dashboards/")
    }
    return files | copies


def runbook_url(text: str) -> str:
    """An http(s) URL with no #fragment (each alert's section is appended as one), and nothing that YAML
    or JSON would have to quote."""
    plain = _PLAIN_URL.fullmatch(text) and text.startswith(("http://", "https://"))
    if not plain or url_problem(text):
        raise argparse.ArgumentTypeError(
            f"must be an http:// or https:// URL with a host, no #fragment, spaces or quotes, got {text!r}"
        )
    return text


def label_name(text: str) -> str:
    """A label name that may tell clusters apart, as the config's cluster_label."""
    if wrong := cluster_label_problem(text):
        raise argparse.ArgumentTypeError(wrong)
    return text


def add_parser(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser(
        "generate",
        help="write the recording rules, alerts and Grafana boards",
        description="Write the recording rules, the alerts, the Kubernetes PrometheusRule and the Grafana "
        "boards, from a thresholds file or the defaults.",
    )
    add_arguments(generate)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a thresholds file: windows, floors and the cluster label (default: the built-in thresholds)",
    )
    parser.add_argument("--check", action="store_true", help="name the stale files, exit 1 if any")
    parser.add_argument(
        "--runbook-url",
        type=runbook_url,
        default=RUNBOOK_URL,
        metavar="URL",
        help="where the alerts and boards link the runbook (default %(default)s)",
    )
    parser.add_argument(
        "--cluster-label",
        type=label_name,
        metavar="NAME",
        help="the label that tells clusters apart, which every rule keeps (default: the thresholds file's, "
        f"else {THRESHOLDS.cluster_label})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO,
        metavar="DIR",
        help="where to write the files, under their repository paths (default: the repository)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        thresholds = load_thresholds(args.config) if args.config else THRESHOLDS
    except ConfigError as error:
        print(f"kvwatch generate: {error}", file=sys.stderr)
        return 1
    stale = []
    for relative, text in generated_files(args.runbook_url, args.cluster_label, thresholds).items():
        path = args.out / relative
        if path.exists() and path.read_text() == text:
            continue
        stale.append(relative)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print("stale generated files (run `make generate`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvwatch.cli.generate`, as `kvwatch generate`."""
    parser = argparse.ArgumentParser(prog="kvwatch generate", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
