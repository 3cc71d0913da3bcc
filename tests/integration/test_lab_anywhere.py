"""The lab as a new user meets it: the command `kvwatch lab up` prints works in a new shell, where the
virtualenv is not active, and the lab commands find the running lab from any directory. And `kvwatch config
check --online` against the lab's real gateway, Prometheus and Alertmanager."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from labs import Lab, kill_lab_processes
from processes import free_base_port, free_port, kvwatch

VENV_KVWATCH = Path(sys.executable).parent / "kvwatch"


def new_shell_env(runtime_dir: Path) -> dict[str, str]:
    """What a new login shell has: no virtualenv on PATH; the lab's records under `runtime_dir`."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ["HOME"],
        "XDG_RUNTIME_DIR": str(runtime_dir),
    }


def in_new_shell(command: str, cwd: Path, runtime_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["/bin/sh", "-c", command],
        cwd=cwd,
        env=new_shell_env(runtime_dir),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Iterator[Lab]:
    """A lab started as `make up` starts it (the virtualenv's kvwatch, not on PATH), detached."""
    runtime_dir = tmp_path_factory.mktemp("runtime")
    state_dir = tmp_path_factory.mktemp("lab") / "state"
    base = free_base_port()
    env = new_shell_env(runtime_dir)
    options = (
        "--detach",
        "--fast",
        "--no-dashboard",
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
    )
    up = kvwatch("lab", "up", *options, env=env)
    if up.returncode != 0:
        kill_lab_processes(state_dir)
        raise RuntimeError(f"kvwatch lab up failed:\n{up.stdout}\n{up.stderr}")
    started = Lab(state_dir, base, up.stdout)
    started.runtime_dir = runtime_dir
    yield started
    started.stop()


def test_up_ends_with_a_command_that_works_in_a_new_shell_from_any_directory(lab, tmp_path):
    *_, reach, stop = lab.up_output.splitlines()
    assert reach == (
        f"In a new shell, kvwatch is {VENV_KVWATCH} (or run `. {VENV_KVWATCH.parent.parent}/bin/activate` "
        f"first), e.g. `{VENV_KVWATCH} lab status`; lab commands work from any directory."
    )
    assert stop == f"The lab runs in the background; stop it with `{VENV_KVWATCH} lab down`."
    (status_command,) = re.findall(r"e\.g\. `([^`]+)`", reach)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    status = in_new_shell(status_command, elsewhere, lab.runtime_dir)
    assert status.returncode == 0, status.stderr
    assert f"state and logs       {lab.state_dir.resolve()}" in status.stdout.splitlines()
    assert f"affinity gateway     {lab.affinity}" in status.stdout.splitlines()
    # Activating the virtualenv, as the line offers, gives the bare command.
    activated = in_new_shell(
        f". {VENV_KVWATCH.parent}/activate && kvwatch lab status --json", elsewhere, lab.runtime_dir
    )
    assert activated.returncode == 0, activated.stderr
    assert yaml.safe_load(activated.stdout)["state_dir"] == str(lab.state_dir.resolve())


def test_fault_and_heal_from_another_directory_act_on_the_running_lab(lab, tmp_path):
    faulted = in_new_shell(f"{VENV_KVWATCH} lab fault break-affinity", tmp_path, lab.runtime_dir)
    assert faulted.returncode == 0, faulted.stderr
    assert lab.cli("status", "--json").json["faults"] == ["break-affinity"]
    healed = in_new_shell(f"{VENV_KVWATCH} lab heal", tmp_path, lab.runtime_dir)
    assert healed.returncode == 0, healed.stderr
    assert lab.cli("status", "--json").json["faults"] == []


def lab_config(lab: Lab, tmp_path: Path, model: str = "lab-model") -> Path:
    """The lab's gateway, Prometheus and Alertmanager, with an exporter and a store of the test's own (the
    lab's serve holds its)."""
    status = lab.cli("status", "--json").json
    config = {
        "targets": [{"name": "lab", "base_url": status["gateways"]["affinity"], "model": model}],
        "exporter": {"listen": f"127.0.0.1:{free_port()}"},
        "store": {"path": str(tmp_path / "kvwatch.db")},
        "prometheus": {"url": status["prometheus"]},
        "alertmanager": {"url": status["alertmanager"]},
    }
    path = tmp_path / "kvwatch.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_config_check_online_asks_the_lab_s_real_services(lab, tmp_path):
    good = lab_config(lab, tmp_path)
    checked = kvwatch("config", "check", "--online", str(good))
    assert (checked.returncode, checked.stdout, checked.stderr) == (
        0,
        f"{good}: OK (1 target, 0 gateway logs; every service answers)\n",
        "",
    )
    wrong = lab_config(lab, tmp_path, model="llama-3")
    checked = kvwatch("config", "check", "--online", str(wrong))
    models_url = f"{lab.affinity}/v1/models"
    assert (checked.returncode, checked.stderr) == (
        1,
        f"target lab: GET {models_url} does not list model llama-3 (it lists: lab-model)\n",
    )
    # The lab's own config: its serve holds the exporter's address and the store, as a second serve would
    # find them.
    own = kvwatch("config", "check", str(lab.state_dir / "kvwatch.yaml"))
    listen = f"127.0.0.1:{lab.base_port + 4}"
    assert (own.returncode, own.stderr) == (1, f"cannot listen on {listen}: Address already in use\n")


def test_down_from_another_directory_stops_the_lab_and_forgets_it(lab, tmp_path):
    """Last in the module: it stops the lab."""
    down = in_new_shell(f"{VENV_KVWATCH} lab down", tmp_path, lab.runtime_dir)
    assert (down.returncode, down.stdout) == (0, "The lab is down.\n"), down.stderr
    assert lab.cli("status", "--json").json["processes"] == {}
    assert list((lab.runtime_dir / "kvwatch" / "running-labs").iterdir()) == []
    status = in_new_shell(f"{VENV_KVWATCH} lab status", tmp_path, lab.runtime_dir)
    assert (status.returncode, status.stderr) == (
        1,
        f"kvwatch lab: no lab state in {tmp_path / '.kvwatch' / 'lab'} (start one with `kvwatch lab up`)\n",
    )
