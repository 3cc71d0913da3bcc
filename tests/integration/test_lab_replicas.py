"""The kinds of lab replica: how a real vLLM replica is installed, built, started and pinned."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvwatch.lab import tiny_model
from kvwatch.lab.process import LabError
from kvwatch.lab.replicas import REPLICA_KINDS, vllm
from kvwatch.lab.state import LabState, ReplicaSpec
from paths import REPO
from processes import kvwatch


def lab_state(tmp_path: Path, replicas: int = 2, engine: str = "vllm") -> LabState:
    state = LabState(tmp_path, 20000, engine=engine)
    state.replicas = [ReplicaSpec(f"r{i + 1}", 20010 + i, "vllm") for i in range(replicas)]
    return state


def test_every_kind_is_registered_under_its_name():
    assert sorted(REPLICA_KINDS) == ["sim", "vllm"]
    assert all(name == kind.name for name, kind in REPLICA_KINDS.items())
    assert REPLICA_KINDS["sim"].live_prefix_caching and not REPLICA_KINDS["vllm"].live_prefix_caching


def test_a_vllm_replica_is_started_as_its_spec_says(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWATCH_VLLM_VENV", str(tmp_path / "venv"))
    state = lab_state(tmp_path)
    process = vllm.KIND.process(state, state.replicas[1])
    argv = process.argv
    assert str(tmp_path / "venv" / "bin" / "python") in argv
    assert argv[argv.index("--port") + 1] == "20011"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--served-model-name") + 1] == state.model
    # The model is linked into the lab's directory, so the lab finds its processes by their command line.
    assert argv[argv.index("--model") + 1] == str(tmp_path / "model")
    assert "--enable-prefix-caching" in argv and "--enable-prompt-tokens-details" in argv
    assert process.env["HF_HUB_OFFLINE"] == "1" and process.env["VLLM_NO_USAGE_STATS"] == "1"
    assert process.ready_url == "http://127.0.0.1:20011/health"

    state.replicas[1].prefix_caching = False
    argv = vllm.KIND.process(state, state.replicas[1]).argv
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv


def test_replicas_get_a_core_each_when_there_are_enough(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    two = lab_state(tmp_path, replicas=2)
    assert [vllm.core_of(two, r) for r in two.replicas] == [0, 1]
    three = lab_state(tmp_path, replicas=3)
    assert [vllm.core_of(three, r) for r in three.replicas] == [0, 1, 0]
    process = vllm.KIND.process(two, two.replicas[1])
    assert process.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert process.argv[:3] == [process.argv[0], "-c", "1"] and process.argv[0].endswith("taskset")


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        ("fpu avx2 f16c", "float32"),
        ("fpu avx2 avx512f avx512_bf16", "bfloat16"),
        ("amx_bf16 amx_tile", "bfloat16"),
    ],
)
def test_the_dtype_is_the_one_the_cpu_computes_natively(monkeypatch, flags, dtype):
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda p, *a, **k: flags if str(p) == "/proc/cpuinfo" else real(p))
    assert vllm.dtype() == dtype


def test_a_lab_without_the_vllm_virtualenv_names_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWATCH_VLLM_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(LabError, match="make vllm"):
        vllm.KIND.prepare(lab_state(tmp_path))


def test_lab_up_refuses_flavours_for_a_real_engine(tmp_path):
    result = kvwatch("lab", "up", "--engine", "vllm", "--flavours", "sglang", "--state-dir", str(tmp_path))
    assert result.returncode == 1
    assert "--flavours is for simulated replicas" in result.stderr


def test_the_makefile_installs_vllm_where_the_lab_looks_for_it():
    env = {
        k: v for k, v in os.environ.items() if k not in ("KVWATCH_VLLM_VENV", "XDG_CACHE_HOME", "VLLM_VENV")
    }
    dry = subprocess.run(
        ["make", "-n", "vllm"], cwd=REPO, capture_output=True, text=True, env=env, check=True
    )
    assert f"scripts/vllm-venv.sh {vllm.DEFAULT_VENV}" in dry.stdout


def test_the_install_script_keeps_a_finished_virtualenv(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / f".kvwatch-vllm-{vllm.VLLM_VERSION}").touch()
    done = subprocess.run(["sh", "scripts/vllm-venv.sh", str(venv)], cwd=REPO, capture_output=True, text=True)
    assert (
        done.returncode == 0
        and done.stdout == ""
        and sorted(p.name for p in venv.iterdir()) == [f".kvwatch-vllm-{vllm.VLLM_VERSION}"]
    )


def test_the_install_script_says_which_python_it_needs(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable if sys.version_info[:2] != (3, 11) else "false"}
    done = subprocess.run(
        ["sh", "scripts/vllm-venv.sh", str(tmp_path / "venv")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 1 and "needs Python 3.11" in done.stderr
    assert not (tmp_path / "venv").exists()


def _vllm_python() -> Path:
    python = vllm.venv() / "bin" / "python"
    assert python.exists(), f"no vLLM virtualenv at {vllm.venv()}: `make vllm` installs it (make test does)"
    return python


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.mark.integration
def test_the_tiny_model_builds_the_same_files_every_time(tmp_path):
    """Against the copy the lab cached when there is one (a build by another run), else a second build."""
    python = _vllm_python()
    cached = vllm.model_directory()
    builds = [tmp_path / "a"] if cached.exists() else [tmp_path / "a", tmp_path / "b"]
    for directory in builds:
        subprocess.run(
            [str(python), tiny_model.__file__, str(directory)],
            check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300,
        )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [b.name for b in builds]  # no partial build left
    assert _digests(builds[0]) == _digests(cached if cached.exists() else builds[1])
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(_digests(builds[0]))


@pytest.mark.integration
def test_the_tiny_models_answers_tokenize_back_to_what_it_generated(tmp_path):
    """Any sequence of the tokens its output head can pick decodes to text that encodes to the same
    tokens: the property that lets a pinned replica reuse a whole conversation, answers included."""
    python = _vllm_python()
    check = f"""
import random, sys
sys.path.insert(0, {str(REPO / "lab")!r})
import tiny_model
from pathlib import Path
tokenizer = tiny_model.build_tokenizer(Path({str(tmp_path)!r}))
allowed = tiny_model.answer_token_ids(tokenizer)
rng = random.Random(0)
bad = 0
for _ in range(500):
    ids = [rng.choice(allowed) for _ in range(rng.randint(1, 40))]
    bad += tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) != ids
print(len(allowed), bad)
"""
    done = subprocess.run([str(python), "-c", check], capture_output=True, text=True, timeout=300, check=True)
    allowed, mismatches = map(int, done.stdout.split())
    assert allowed > 1000 and mismatches == 0
