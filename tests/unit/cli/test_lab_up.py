"""`kvwatch lab up` refuses options that cannot run together before it starts anything: exit 1 and one
line naming what is wrong."""

from __future__ import annotations

import pytest

from kvwatch.cli.main import main


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--engine", "vllm", "--flavours", "sglang"], "--flavours is for simulated replicas"),
        (["--gateway-log-source", "otlp"], "--gateway-log-source otlp is for --gateway envoy, not nginx"),
        (
            ["--metrics-store", "victoriametrics", "--clusters", "2"],
            "--metrics-store victoriametrics runs one",
        ),
        (["--envoy-lb", "maglev"], "--envoy-lb is for --gateway envoy"),
        (["--sagemaker-routing", "RANDOM"], "--sagemaker-routing is for --gateway sagemaker, not nginx"),
        (["--gateway", "sagemaker", "--sagemaker-concurrency-threshold", "0"], "is from 1 to 1024"),
        (["--session-ttl", "5"], "--session-ttl and --session-table-size are for --gateway sagemaker"),
        (["--gateway", "sagemaker", "--session-ttl", "0"], "--session-ttl must be positive"),
        (["--gateway", "sagemaker", "--users", "2"], "the background users speak OpenAI's API"),
        (["--flavours", "vllm,triton"], "unknown flavour(s) triton; known: "),
        (["--replicas", "0"], "--replicas must be at least 1"),
        (["--rule-time-scale", "0"], "the time scales positive"),
        (["--clusters", "0"], "--clusters must be from 1 to"),
        (["--clusters", "2", "--replicas", "99"], "--replicas must be at most"),
    ],
)
def test_options_that_cannot_run_together_are_refused_before_anything_starts(
    flags, message, tmp_path, capsys
):
    state_dir = tmp_path / "lab"
    assert main(["lab", "up", "--state-dir", str(state_dir), *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvwatch lab: ") and message in err, err
    assert not state_dir.exists()
