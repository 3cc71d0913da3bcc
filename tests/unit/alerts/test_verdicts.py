"""Every verdict the pages and boards show is the state of the alert that watches it: promtool evaluates
each verdict's query beside the real alert rules, on series that break and heal, and at every evaluation
the verdict is FIRING exactly where the alert fires (kept firing included) and PENDING exactly where it is
pending; what the alert does not watch gets no verdict."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from kvwatch.alerts import verdicts
from kvwatch.alerts.verdicts import FIRING, OK, PENDING, Verdict
from kvwatch.prometheus import queries
from paths import REPO

EXPORTER = 'job="kvwatch", instance="127.0.0.1:9464"'
ENGINE = 'job="replicas", instance="127.0.0.1:18010"'
CHAT = f'{EXPORTER}, target="chat", route_mode="affinity"'  # a sticky route
RR = f'{EXPORTER}, target="rr", route_mode="round_robin"'  # and one that is not
ROUTER = 'job="epp", instance="127.0.0.1:9090"'
MODEST_ROUTER = 'job="epp", instance="127.0.0.1:9091"'


@dataclass(frozen=True)
class Scenario:
    verdict: Verdict
    series: dict[str, str]  # input series -> promtool values, one a minute
    minutes: range  # when to compare the verdict with the alert
    expected: dict[int, int]  # minute -> the judged subject's state, to prove the alert really moves
    subject: str  # the judged series' labels
    never: list[str] = field(default_factory=list)  # queries of verdicts that must never have a sample


SCENARIOS = {
    "route stickiness": Scenario(
        verdicts.ROUTE_STICKY,
        {
            f'kvwatch_probe_sticky_ratio{{{CHAT}}}':
                "1 1 0.2 0.2 1 1 1 1 1 1",
            f'kvwatch_probe_route_info{{{CHAT}, expect_sticky="true"}}':
                "1x9",
            f'kvwatch_probe_sticky_ratio{{{RR}}}': "0x9",
            f'kvwatch_probe_route_info{{{RR}, expect_sticky="false"}}':
                "1x9",
        },
        range(10),
        {1: OK, 2: FIRING, 3: FIRING, 9: OK},
        'target="chat", route_mode="affinity"',
        ['kvwatch_verdict{target="rr"}'],  # not expected sticky: not judged
    ),
    "warm rounds": Scenario(
        verdicts.ROUTE_WARM_ROUNDS,
        {
            f'kvwatch_probe_warm_cold_ttft_ratio{{{CHAT}}}':
                "0.3 0.3 0.9 0.9 0.9 0.9 0.9 0.3 0.3 0.3",
            f'kvwatch_probe_route_info{{{CHAT}, expect_sticky="true"}}':
                "1x9",
            f'kvwatch_probe_warm_cold_ttft_ratio{{{RR}}}': "1.5x9",
            f'kvwatch_probe_route_info{{{RR}, expect_sticky="false"}}':
                "1x9",
        },
        range(10),
        {1: OK, 2: PENDING, 3: PENDING, 5: FIRING, 9: OK},
        'target="chat", route_mode="affinity"',
        ['kvwatch_verdict{target="rr"}'],
    ),
    "gateway spread": Scenario(
        verdicts.LISTENER_SPREAD,
        {
            f'{queries.GATEWAY_SPREAD_SHARE}{{log="gw", listener="chat", failover="false"}}':
                "0 0 0.8 0.8 0.8 0.8 0.1 0.1 0.1 0.1",
            f'{queries.GATEWAY_SPREAD_SHARE}{{log="gw", listener="chat", failover="true"}}': "0.9x9",
            f'kvwatch_gateway_returning_sessions{{{EXPORTER}, log="gw", listener="chat"}}': "10x9",
            # too few sessions came back to judge: never more than OK
            f'{queries.GATEWAY_SPREAD_SHARE}{{log="gw", listener="quiet", failover="false"}}': "1x9",
            f'kvwatch_gateway_returning_sessions{{{EXPORTER}, log="gw", listener="quiet"}}': "3x9",
            f'kvwatch_gateway_log_info{{{EXPORTER}, log="gw", expect_sticky="true"}}': "1x9",
            f'{queries.GATEWAY_SPREAD_SHARE}{{log="rr", listener="rr", failover="false"}}': "1x9",
            f'kvwatch_gateway_returning_sessions{{{EXPORTER}, log="rr", listener="rr"}}': "10x9",
            f'kvwatch_gateway_log_info{{{EXPORTER}, log="rr", expect_sticky="false"}}': "1x9",
        },
        range(10),
        {1: OK, 2: PENDING, 4: FIRING, 9: OK},
        'log="gw", listener="chat"',
        ['kvwatch_verdict{log="rr"}', 'kvwatch_verdict{listener="quiet"} != 0'],
    ),
    "cluster hit ratio": Scenario(
        verdicts.CLUSTER_HIT_RATIO_DROP,
        {
            queries.CLUSTER_HIT_RATIO: "0.8x80 0.05x9 0.8x9",
            f"{queries.INSTANCE_PROMPT_TOKENS}{{{ENGINE}}}": "100x98",
        },
        range(76, 98),
        {80: OK, 82: PENDING, 88: FIRING, 97: OK},
        "",
    ),
    "router prediction": Scenario(
        verdicts.ROUTER_PREDICTION_MISS,
        {
            f"{queries.INSTANCE_ROUTER_DELIVERED_PER_PREDICTED}{{{ROUTER}}}": "1 1 0.1x7 1x6",
            f"{queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO}{{{ROUTER}}}": "0.8x15",
            f"{queries.INSTANCE_ROUTER_PREDICTIONS}{{{ROUTER}}}": "5x15",
            # predicts little reuse: its shortfall is no miss, never more than OK
            f"{queries.INSTANCE_ROUTER_DELIVERED_PER_PREDICTED}{{{MODEST_ROUTER}}}": "0.1x15",
            f"{queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO}{{{MODEST_ROUTER}}}": "0.2x15",
            f"{queries.INSTANCE_ROUTER_PREDICTIONS}{{{MODEST_ROUTER}}}": "5x15",
            f"{queries.INSTANCE_PROMPT_TOKENS}{{{ENGINE}}}": "100x15",
        },
        range(16),
        {1: OK, 2: PENDING, 6: PENDING, 7: FIRING, 9: FIRING, 10: OK},
        ROUTER,
        ['kvwatch_verdict{instance="127.0.0.1:9091"} != 0'],
    ),
    "load imbalance": Scenario(
        verdicts.LOAD_IMBALANCE,
        {queries.CLUSTER_LOAD_IMBALANCE: "1 1 3x20 1x5"},
        range(28),
        {1: OK, 5: PENDING, 20: FIRING, 27: OK},
        "",
    ),
}  # fmt: skip


def promql_test(expr: str, minute: int, samples: list[dict]) -> dict:
    return {"expr": expr, "eval_time": f"{minute}m", "exp_samples": samples}


def comparisons(scenario: Scenario) -> list[dict]:
    """At every minute, the verdict's FIRING and PENDING series are exactly the alert's."""
    verdict = scenario.verdict
    on = f"on({verdict.by})"
    alert = {FIRING: verdict.alerts("firing"), PENDING: verdict.alerts("pending")}
    tests = []
    for minute in scenario.minutes:
        for state, alerts in alert.items():
            tests.append(promql_test(f"kvwatch_verdict == {state} unless {on} {alerts}", minute, []))
            tests.append(promql_test(f"{alerts} unless {on} kvwatch_verdict == {state}", minute, []))
        tests += [promql_test(never, minute, []) for never in scenario.never]
    return tests


def spot_checks(scenario: Scenario) -> list[dict]:
    """The judged subject's state at chosen minutes: the alert does go pending, fire and resolve."""
    labels = f"kvwatch_verdict{{{scenario.subject}}}"
    return [
        promql_test(labels, minute, [{"labels": labels, "value": state}])
        for minute, state in scenario.expected.items()
    ]


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.integration  # runs promtool
def test_a_verdict_is_its_alerts_state(tmp_path: Path, name: str):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make bootstrap` installs Debian's prometheus package"
    scenario = SCENARIOS[name]
    # The verdict is recorded in the alert's own group, after it: rules of one group are evaluated in
    # order, each seeing the ALERTS of that evaluation, while separate groups run in no fixed order.
    alerts = yaml.safe_load((REPO / "alerts" / "kvwatch.rules.yml").read_text())
    (group,) = (
        g for g in alerts["groups"] if any(r.get("alert") == scenario.verdict.alert.name for r in g["rules"])
    )
    group["rules"].append({"record": "kvwatch_verdict", "expr": scenario.verdict.state})
    rules = tmp_path / "kvwatch-with-verdict.rules.yml"
    rules.write_text(yaml.safe_dump(alerts, sort_keys=False))
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in scenario.series.items()],
                "promql_expr_test": spot_checks(scenario) + comparisons(scenario),
            }
        ],
    }
    path = tmp_path / "verdict-test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    done = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
