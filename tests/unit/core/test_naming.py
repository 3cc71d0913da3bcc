"""A replica is named the same way by the lab's faults, its status and the dashboard's marks: its id and
its address together."""

from __future__ import annotations

import json
import time

import pandas as pd

from kvwatch.cli.lab import _print_status
from kvwatch.config.settings import Config, GatewayLog, StoreSettings
from kvwatch.core.naming import replica_name
from kvwatch.dashboard import data, ui
from kvwatch.dashboard.data import Result
from kvwatch.lab import stack
from kvwatch.lab.state import LabState, ReplicaSpec


def test_a_replica_is_named_by_id_and_address_or_whichever_is_known():
    assert replica_name("127.0.0.1:20812", "r2") == "r2 (127.0.0.1:20812)"
    assert replica_name("127.0.0.1:20812") == "127.0.0.1:20812"
    assert replica_name(None, "r2") == "r2"


def lab_state(tmp_path) -> LabState:
    state = LabState(tmp_path, 20800)
    state.replicas = [ReplicaSpec(f"r{i + 1}", state.ports.replica(i), "vllm") for i in range(3)]
    state.faults = ["break-affinity", "kill-replica:r2"]
    return state


def test_lab_status_names_each_replica_and_each_fault_by_id_and_address(tmp_path, capsys):
    state = lab_state(tmp_path)
    info = stack.status(state)
    assert [r["name"] for r in info["replicas"]] == [f"r{i} (127.0.0.1:2081{i - 1})" for i in (1, 2, 3)]
    assert info["faults"] == ["break-affinity", "kill-replica:r2"]  # as the state keeps them
    _print_status(info)
    printed = capsys.readouterr().out
    assert "replica r2 (127.0.0.1:20811)" in printed
    assert "faults               break-affinity, kill-replica on r2 (127.0.0.1:20811)\n" in printed


def test_the_dashboard_marks_a_logged_fault_with_the_replica_the_lab_named(tmp_path, monkeypatch):
    state = lab_state(tmp_path)
    stack._log_fault(state, "fault", "kill-replica", state.replica("r2"))
    stack._log_fault(state, "heal", "kill-replica:r2")
    with (tmp_path / "faults.log").open("a") as log:  # as a lab logged it before it logged addresses
        log.write(
            json.dumps({"unix": time.time(), "action": "fault", "fault": "kill-replica", "replica": "r3"})
            + "\n"
        )
    config = Config(
        gateway_logs=(GatewayLog("affinity", tmp_path / "a.jsonl"),),
        store=StoreSettings(tmp_path / "kvwatch.db"),
    )
    monkeypatch.setattr(data, "settings", lambda: Result(config))
    logged = data.faults(0)
    assert logged.error is None
    assert [ui.fault_text(row) for _, row in logged.value.iterrows()] == [
        "fault kill-replica r2 (127.0.0.1:20811)",
        "heal kill-replica:r2",
        "fault kill-replica r3",
    ]


def test_a_mark_without_a_replica_names_the_fault_alone():
    fault = pd.Series({"action": "fault", "fault": "break-affinity", "replica": None})
    assert ui.fault_text(fault) == "fault break-affinity"
