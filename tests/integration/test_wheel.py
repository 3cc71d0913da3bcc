"""kvwatch as a user installs it: the built wheel in a fresh virtualenv, run outside the repository.

The wheel is built from a copy of the working tree (so that the build leaves nothing in the repository)
with the suite's own setuptools, and installed without its dependencies, which the fresh virtualenv reads
from the suite's (a .pth line): nothing is fetched. What it must hold is only what the wheel carries:
the kvwatch namespace packages and the rule files, Prometheus config, examples and templates the lab reads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvwatch.lab.configs import RULE_PATTERNS
from labs import kill_lab_processes
from paths import REPO
from processes import free_base_port, http_get

pytestmark = pytest.mark.integration

NOT_BUILT = shutil.ignore_patterns(".git", ".venv", "node_modules", "test-artifacts", "build", "*.egg-info",
                                   "__pycache__", ".pytest_cache", ".ruff_cache")  # fmt: skip


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin directory of a fresh virtualenv holding only the built wheel."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=NOT_BUILT)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(root / "dist"), str(source)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (root / "dist").glob("kvwatch-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.strip()  # fmt: skip
    dependencies = [path for path in sys.path if path.endswith("site-packages")]  # the suite's
    Path(purelib, "kvwatch-test-dependencies.pth").write_text("".join(f"{path}\n" for path in dependencies))
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    return venv / "bin"


def run(installed: Path, cwd: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """A command of the fresh virtualenv, run where there is no kvwatch source."""
    return subprocess.run(argv if "/" in argv[0] else [str(installed / argv[0]), *argv[1:]],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_the_wheel_installs_the_kvwatch_namespace_only(installed, tmp_path):
    version = run(installed, tmp_path, "kvwatch", "--version")
    assert version.returncode == 0 and version.stdout.startswith("kvwatch "), version.stderr
    imports = run(
        installed, tmp_path, "python", "-c", "import kvwatch.cli.main, kvwatch.lab, kvwatch.dashboard"
    )
    assert imports.returncode == 0, imports.stderr
    for package in ("collectors", "lab", "dashboard"):
        bare = run(installed, tmp_path, "python", "-c", f"import {package}")
        assert f"No module named '{package}'" in bare.stderr


def test_the_installed_kvwatch_runs_a_lab_and_probes_it(installed, tmp_path):
    state = tmp_path / "state"
    lab = ("--state-dir", str(state))
    try:
        up = run(installed, tmp_path, "kvwatch", "lab", "up", "--detach", "--fast", "--no-dashboard",
                 "--users", "0", "--base-port", str(free_base_port()), *lab)  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        status = json.loads(run(installed, tmp_path, "kvwatch", "lab", "status", "--json", *lab).stdout)
        assert all(replica["url"] for replica in status["replicas"])
        # Prometheus runs every rule file of the repository, as the wheel installed it.
        groups = http_get(f"{status['prometheus']}/api/v1/rules").json()["data"]["groups"]
        wanted = {path.name for pattern in RULE_PATTERNS for path in REPO.glob(pattern)}
        assert {Path(group["file"]).name for group in groups} == wanted
        probe = run(installed, tmp_path, "kvwatch", "probe", "--base-url", status["gateways"]["affinity"],
                    "--sessions", "2", "--rounds", "2", "--json")  # fmt: skip
        assert probe.returncode == 0, probe.stderr
        sessions = json.loads(probe.stdout)["sessions"]
        assert len(sessions) == 2 and all(len(set(s["backends"])) == 1 for s in sessions), sessions
        down = run(installed, tmp_path, "kvwatch", "lab", "down", *lab)
        assert down.returncode == 0, down.stderr
    finally:
        kill_lab_processes(state)
