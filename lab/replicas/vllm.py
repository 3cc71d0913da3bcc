"""Real vLLM (the CPU build from PyPI) as a lab replica, serving the lab's tiny Llama.

vLLM runs from its own virtualenv (`make vllm` creates it: `scripts/vllm-venv.sh`), since its pins are not
kvwatch's. The model is built locally at first use (`lab/tiny_model.py`) into a cache directory keyed
by the builder's hash, and linked into the lab's state directory, so that every vLLM process names the
lab on its command line. With at least as many cores as replicas, each replica has a core of its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from kvwatch.lab import tiny_model
from kvwatch.lab.process import LabError, Process
from kvwatch.lab.replicas.base import ReplicaKind, container_environment
from kvwatch.lab.state import LabState, ReplicaSpec

VLLM_VERSION = "0.32.0"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvwatch"
# `make vllm` installs here by default; KVWATCH_VLLM_VENV names another place.
DEFAULT_VENV = CACHE / f"vllm-{VLLM_VERSION}"
MODEL_NAME = "lab-model"
READY_TIMEOUT_S = 300.0  # ~40 s on an idle 2-core machine, minutes when it is busy
KV_CACHE_GIB = 1
BUILD_TIMEOUT_S = 600


def venv() -> Path:
    return Path(os.environ.get("KVWATCH_VLLM_VENV") or DEFAULT_VENV)


def model_directory() -> Path:
    return CACHE / "models" / f"tiny-llama-{tiny_model.fingerprint()}"


def _prepare(state: LabState) -> None:
    """Check that vLLM is installed, build the model once, and link it into the lab's directory."""
    python = venv() / "bin" / "python"
    if not (venv() / f".kvwatch-vllm-{VLLM_VERSION}").exists():
        raise LabError(
            f"real vLLM {VLLM_VERSION} is not installed in {venv()}: run `make vllm` (about 3.4 GB, once), "
            "or set KVWATCH_VLLM_VENV to a virtualenv that `scripts/vllm-venv.sh` made"
        )
    model = model_directory()
    if not model.exists():
        built = subprocess.run(
            [str(python), str(Path(tiny_model.__file__)), str(model)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            env={**os.environ, **_offline()},
        )
        if built.returncode != 0:
            tail = "\n".join((built.stdout + built.stderr).splitlines()[-15:])
            raise LabError(f"building the lab's tiny model into {model} failed:\n{tail}")
    link = state.directory / "model"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(model, target_is_directory=True)


def _offline() -> dict[str, str]:
    """vLLM and Hugging Face must never reach out: no hub, no usage statistics."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def core_of(state: LabState, replica: ReplicaSpec) -> int:
    """The core this replica runs on: its own when there are enough, else shared in turn."""
    cores = sorted(os.sched_getaffinity(0))
    index = next(i for i, r in enumerate(state.replicas) if r.id == replica.id)
    return cores[index % len(cores)]


def dtype() -> str:
    """bfloat16 where the CPU computes it natively (AVX-512 BF16, AMX); float32 elsewhere, where
    bfloat16 falls back to a path several times slower (an AVX2-only CPU: a 2,000-token prefill took
    14 s in bfloat16 and 4.6 s in float32)."""
    flags = set()
    with contextlib.suppress(OSError):
        flags = set(Path("/proc/cpuinfo").read_text().split())
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def _process(state: LabState, replica: ReplicaSpec) -> Process:
    core = core_of(state, replica)
    taskset = shutil.which("taskset")
    argv = [taskset, "-c", str(core)] if taskset else []
    argv += [
        str(venv() / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(state.directory / "model"),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(replica.port),
        "--enable-prefix-caching" if replica.prefix_caching else "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        "8192",
        "--dtype",
        dtype(),
        # No torch.compile warm-up: it doubles the start-up time and buys a tiny model nothing.
        "--enforce-eager",
        # The model runs in the engine's process rather than in a worker process of its own, which would
        # import vLLM and torch once more at every start and restart (a third of the start-up on a core).
        "--distributed-executor-backend",
        "uni",
    ]
    env = {
        **_offline(),
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        # Else vLLM's CPU platform turns "uni" back into a worker process; the API server still runs the
        # engine in a process of its own.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        **container_environment(state, replica),
    }
    return Process(
        f"replica-{replica.id}",
        argv,
        f"http://127.0.0.1:{replica.port}/health",
        env=env,
        ready_timeout_s=READY_TIMEOUT_S,
    )


KIND = ReplicaKind(
    name="vllm",
    prepare=_prepare,
    process=_process,
    flavour="vllm",
    live_prefix_caching=False,
    help=f"real vLLM {VLLM_VERSION} on CPU serving a tiny local Llama (KV blocks of 128 tokens); "
    "`make vllm` installs it",
    # A cold 1,000-token prefill takes seconds on one CPU core: short conversations, runs far apart.
    fast_probe_interval_s=30,
    probe_workload={"system_tokens": 300, "turn_tokens": 100, "max_tokens": 16},
)
