"""Which lab the lab commands act on when none is named: the one running here, else the one this user
runs elsewhere (lab.state's records, lab.stack.find)."""

from __future__ import annotations

import pytest

from kvwatch.lab import stack
from kvwatch.lab.process import LabError
from kvwatch.lab.state import LabState, forget_running, record_running, recorded_labs, running_labs_directory


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))


def lab_in(directory) -> None:
    """A lab's state in `directory`, recorded as running (whether it runs, the test's is_running says)."""
    directory.mkdir(parents=True)
    LabState(directory=directory, base_port=18000).save()
    record_running(directory)


def test_records_live_in_the_user_s_runtime_directory(tmp_path):
    record_running(tmp_path / "a")
    record_running(tmp_path / "b")
    assert running_labs_directory() == tmp_path / "runtime" / "kvwatch" / "running-labs"
    assert recorded_labs() == [tmp_path / "a", tmp_path / "b"]
    forget_running(tmp_path / "a")
    assert recorded_labs() == [tmp_path / "b"]


def test_the_lab_here_comes_first_then_the_one_running_elsewhere(tmp_path, monkeypatch):
    running = set()
    monkeypatch.setattr(stack, "is_running", lambda directory: directory in running)
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    lab_in(elsewhere)
    assert stack.find(here) == here  # nothing runs: here, whose absence says how to start one
    assert recorded_labs() == []  # the record of a lab that died is dropped
    record_running(elsewhere)
    running.add(elsewhere)
    assert stack.find(here) == elsewhere
    running.add(here)
    assert stack.find(here) == here


def test_several_labs_elsewhere_are_named(tmp_path, monkeypatch):
    first, second = tmp_path / "one", tmp_path / "two"
    running = {first, second}
    monkeypatch.setattr(stack, "is_running", lambda directory: directory in running)
    lab_in(first)
    lab_in(second)
    with pytest.raises(LabError) as error:
        stack.find(tmp_path / "here")
    assert str(error.value) == (
        f"no lab runs from {tmp_path / 'here'}, and 2 run elsewhere ({first}, {second}): name one with "
        "--state-dir"
    )


def test_a_lab_whose_processes_are_gone_is_not_running(tmp_path):
    directory = tmp_path / "lab"
    directory.mkdir()
    LabState(directory=directory, base_port=18000, processes={"serve": 2**22 + 12345}).save()
    assert not stack.is_running(directory)
    assert not stack.is_running(tmp_path / "nothing")
