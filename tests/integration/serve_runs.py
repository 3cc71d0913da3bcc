"""What the `kvwatch serve` integration tests share: a real `kvwatch serve` started on a free port and
stopped as Kubernetes stops a pod, its /metrics read, and an engine that can hold a run in flight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from paths import REPO
from processes import free_port, http_get, launch


def samples(url: str) -> dict[tuple, float]:
    text = http_get(f"{url}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(found: dict, name: str, **labels) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def start_serve(
    tmp_path: Path, target: dict | list[dict], *options: str, store: dict | None = None, **sections
) -> tuple[subprocess.Popen, str, Path]:
    """A real `kvwatch serve` of a target or several on a free loopback port: its process, its URL and its
    log. Its store is an SQLite file in `tmp_path` unless `store` says otherwise; `sections` are more of
    the config (`exporter` adds to the listen address)."""
    port = free_port()
    config = tmp_path / "kvwatch.yaml"
    config.write_text(
        yaml.safe_dump({
            "targets": target if isinstance(target, list) else [target],
            **sections,
            "exporter": {"listen": f"127.0.0.1:{port}", **sections.get("exporter", {})},
            "store": store or {"path": str(tmp_path / "kvwatch.db")},
        })
    )  # fmt: skip
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "kvwatch.cli.main", "serve", "--config", str(config), *options]
    process = launch(argv, log, f"http://127.0.0.1:{port}/-/healthy", cwd=REPO)
    return process, f"http://127.0.0.1:{port}", log


def terminate(process: subprocess.Popen, log: Path) -> None:
    """SIGTERM, as Kubernetes stops a pod, and a clean exit after it."""
    os.kill(process.pid, signal.SIGTERM)
    assert process.wait(timeout=15) == 0, log.read_text()


USAGE = {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
ANSWER = [{"choices": [{"delta": {"role": "assistant", "content": "hi"}}]}, {"choices": [], "usage": USAGE}]


class StallingEngine:
    """An OpenAI-compatible server that answers every round at once until `stall()`; from then on no
    round 2 gets an answer (it hangs until the engine closes), so a run stays in flight with round 1
    finished. It counts the rounds asked of each path."""

    def __init__(self) -> None:
        self.stalling = False
        self.stalled = 0  # requests hanging now
        self.asked: Counter[str] = Counter()
        self._closed = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.asked[self.path] += 1
                if engine.stalling and len(body["messages"]) > 2:  # system, user: round 1
                    engine.stalled += 1
                    engine._closed.wait(30)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for event in [*map(json.dumps, ANSWER), "[DONE]"]:
                    self.wfile.write(f"data: {event}\n\n".encode())

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stall(self) -> None:
        self.stalling = True

    def close(self) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()


def stalling_target(engine: StallingEngine) -> dict:
    """One session a run, each second, of two rounds: round 2 is the one a stalling engine holds."""
    return {"name": "direct", "base_url": engine.url, "model": "m", "interval_seconds": 1,
            "sessions_per_run": 1, "rounds": 2, "block_size": 16,
            "workload": {"system_tokens": 20, "turn_tokens": 5, "max_tokens": 1}}  # fmt: skip


def probed_targets(url: str, timeout: float = 15) -> set[str]:
    """The targets an exporter exports, once each has a successful session."""
    deadline = time.monotonic() + timeout
    while True:
        sessions = [(dict(labels), n) for (name, labels), n in samples(url).items()
                    if name == "kvwatch_probe_sessions_total"]  # fmt: skip
        succeeded = {labels["target"]: n for labels, n in sessions if labels["outcome"] == "success"}
        if (succeeded and all(succeeded.values())) or time.monotonic() > deadline:
            return set(succeeded)
        time.sleep(0.2)
