"""The simulated `vllm` flavour against real vLLM 0.32: names, types, labels, buckets and answer shapes.

First the comparator (tests/contract.py) on small hand-written texts, so that an empty list of
differences means agreement and not a blind comparator. Then the flavour against a /metrics recorded
from vLLM 0.32.0, on every run. Last the live contract, where the lab can run real vLLM: a simulated
replica and a real engine get the same traffic, and their metrics and answers must agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest
from contract import (
    CONFIG_LABELS,
    chunk_kind,
    counter_problems,
    families,
    metric_differences,
    shape,
    shape_differences,
    stream_shapes,
    usage_problems,
)
from prometheus_client import generate_latest

from kvwatch.lab.engine import ReplicaSettings
from kvwatch.lab.flavours import SIMULATED_FLAVOURS, CacheConfig, Finished, Prefill
from paths import REPO
from processes import http_get, http_post

RECORDED = REPO / "tests" / "testdata" / "vllm-0.32.0-cpu-metrics.prom"

INFO = ",".join(f'{label}="{value}"' for label, value in sorted({
    "block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True", "engine": "0",
    "kv_cache_size_tokens": "1600", "kv_offloading_backend": "native", "kv_offloading_size": "None",
    "num_gpu_blocks": "100", "mamba_block_size": "None",
}.items()))  # fmt: skip
REAL = f"""\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} 64.0
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{{engine="0",model_name="m",source="local_compute"}} 36.0
vllm:prompt_tokens_by_source_total{{engine="0",model_name="m",source="local_cache_hit"}} 64.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",model_name="m"}} 1.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} 1.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} 1.0
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} 0.05
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{{INFO}}} 1.0
"""
# The sim's side: the same, without the config label it does not mirror.
SIM = REAL.replace(',mamba_block_size="None"', "")
FAMILIES = ("vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds")


def changed(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


def test_the_same_families_agree_although_the_real_engine_has_more_config_labels():
    assert metric_differences(SIM, REAL, required=FAMILIES) == []


@pytest.mark.parametrize(
    "old, new, difference",
    [
        (
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_hit_total",
            "vllm:prefix_cache_hit: the sim exports it, the real engine does not",
        ),
        (
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_hit_total",
            "vllm:prefix_cache_hits: kvwatch reads it, and the sim does not export it",
        ),
        (
            "# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total",
            "# TYPE vllm:prefix_cache_hits gauge\nvllm:prefix_cache_hits",
            "vllm:prefix_cache_hits: a gauge in the sim, a counter in the real engine",
        ),
        (
            'hits_total{engine="0",',
            'hits_total{engine_index="0",',
            "vllm:prefix_cache_hits: labels only in the sim ['engine_index'], "
            "only in the real engine ['engine']",
        ),
        (
            'source="local_cache_hit"',
            'source="local_hit"',
            "vllm:prompt_tokens_by_source: label 'source' takes ['local_compute', 'local_hit'] in the sim, "
            "['local_cache_hit', 'local_compute'] in the real engine",
        ),
        (
            'le="0.1"',
            'le="0.25"',
            "vllm:time_to_first_token_seconds: buckets only in the sim [0.25], only in the real engine [0.1]",
        ),
        (
            'enable_prefix_caching="True"',
            'enable_prefix_caching="true"',
            "vllm:cache_config_info: label 'enable_prefix_caching' takes ['true'] in the sim, "
            "['True'] in the real engine",
        ),
        (
            ',kv_cache_size_tokens="1600"',
            "",
            "vllm:cache_config_info: the sim has no label 'kv_cache_size_tokens'",
        ),
        (
            'block_size="16"',
            'block_size="16",replica="r1"',
            "vllm:cache_config_info: labels only in the sim ['replica']",
        ),
    ],
)
def test_a_changed_name_type_label_or_bucket_of_the_sim_is_a_difference(old, new, difference):
    assert difference in metric_differences(changed(SIM, old, new), REAL, required=FAMILIES)


def test_cache_sizes_may_differ_but_a_mirrored_config_label_the_real_engine_renamed_is_a_difference():
    smaller = changed(SIM, 'kv_cache_size_tokens="1600"', 'kv_cache_size_tokens="800"')
    smaller = changed(smaller, 'num_gpu_blocks="100"', 'num_gpu_blocks="50"')
    assert metric_differences(smaller, REAL, required=FAMILIES) == []
    renamed = changed(REAL, 'kv_offloading_backend="native"', 'offloading_backend="native"')
    assert "vllm:cache_config_info: the real engine has no label 'kv_offloading_backend'" in (
        metric_differences(SIM, renamed, required=FAMILIES)
    )
    assert "kv_offloading_backend" in CONFIG_LABELS


def test_families_only_the_real_engine_exports_are_no_difference():
    only_hits = SIM.split("# HELP vllm:prompt_tokens_by_source_total")[0]
    assert metric_differences(only_hits, REAL, required=()) == []


def test_counter_identities_hold_for_consistent_counters_and_name_a_broken_one():
    consistent = """\
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0"} 100.0
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 36.0
vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 64.0
vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 0.0
# TYPE vllm:prompt_tokens_cached_total counter
vllm:prompt_tokens_cached_total{engine="0"} 64.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0"} 64.0
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"} 64.0
vllm:prompt_tokens_cached_by_source_total{engine="0",source="host"} 0.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",kv_cache_size_tokens="1600",num_gpu_blocks="100"} 1.0
"""
    assert counter_problems(consistent) == []
    broken = consistent.replace('source="local_compute"} 36.0', 'source="local_compute"} 100.0')
    assert counter_problems(broken) == [
        "prompt_tokens = local_compute + local_cache_hit + external_kv_transfer by source: 100.0 != 164.0"
    ]


@pytest.mark.parametrize(
    "prompt, cached, created, problems",
    [
        (380, 0, 256, 0),  # seen on vLLM 0.32 with blocks of 128: only the prompt's full blocks
        (516, 256, 256, 0),
        (512, 384, 128, 0),  # the same prompt again: its last block is computed (and created) anew
        (512, 384, 0, 1),
        (516, 200, 312, 1),
        (512, 512, 0, 1),
    ],
)
def test_usage_problems_follow_what_vllm_counts(prompt, cached, created, problems):
    usage = {
        "prompt_tokens": prompt,
        "prompt_tokens_details": {"cached_tokens": cached, "created_cache_tokens": created},
    }
    assert len(usage_problems(usage, block_size=128)) == problems


def test_shapes_are_key_paths_and_chunks_have_kinds():
    chunk = {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}], "usage": None}
    assert shape(chunk) == {
        "choices",
        "choices[].delta",
        "choices[].delta.role",
        "choices[].finish_reason",
        "usage",
    }
    assert chunk_kind(chunk) == "first"
    assert chunk_kind({"choices": [{"delta": {"content": "a"}, "finish_reason": None}]}) == "token"
    assert chunk_kind({"choices": [{"delta": {}, "finish_reason": "stop"}]}) == "last"
    assert chunk_kind({"choices": [], "usage": {}}) == "usage"


def test_shape_differences_name_missing_and_extra_paths_but_not_left_out_fields():
    real = {
        "completion": shape(
            {"usage": {"prompt_tokens_details": {"cached_tokens": 1, "created_cache_tokens": 0}}}
        ),
        "stream last": shape({"choices": [{"finish_reason": "length", "stop_reason": None}]}),
    }
    sim = {
        "completion": shape({"usage": {"prompt_tokens_details": {"cached_tokens": 1}}, "worker": "r1"}),
        "stream last": shape({"choices": [{"finish_reason": "length"}]}),
        "stream usage": shape({"choices": []}),
    }
    assert shape_differences(sim, real) == [
        "completion: the sim sends worker, the real engine does not",
        "completion: the sim lacks usage.prompt_tokens_details.created_cache_tokens",
        "stream usage: only the sim sends one",
    ]


def test_the_flavour_matches_a_recorded_vllm_0_32():
    """The sim's families against a real /metrics: any renamed metric, label or bucket fails here first."""
    recorded = RECORDED.read_text()
    config = families(recorded)["vllm:cache_config_info"].values
    (model,) = families(recorded)["vllm:prompt_tokens"].values["model_name"]
    # Recorded with --max-model-len 8192, the context length the lab gives real and simulated replicas.
    cache = CacheConfig(
        block_size=int(*config["block_size"]),
        num_gpu_blocks=int(*config["num_gpu_blocks"]),
        prefix_caching=True,
        max_model_len=ReplicaSettings("r1").max_model_len,
    )
    metrics = SIMULATED_FLAVOURS.lookup("vllm")(model, cache)
    metrics.prefill_done(Prefill(300, 256, True, 0.01, 0.2, streaming=True))
    metrics.finished(Finished(300, 256, 8, 0.5, streaming=True, finished_reason="length"))
    sim = generate_latest(metrics.registry).decode()
    assert metric_differences(sim, recorded) == []
    assert counter_problems(sim) == [] and counter_problems(recorded) == []


# The live contract: the same traffic to a simulated replica and to a real vLLM of the lab.

SYSTEM_WORDS = 300  # ~1,000 tokens for the lab's real tokenizer, 2 blocks of 128 for the sim's
MAX_TOKENS = 8


@dataclass(frozen=True)
class Server:
    url: str
    model: str

    def chat(self, messages: list[dict], **options) -> httpx.Response:
        body = {"model": self.model, "messages": messages, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        response = http_post(f"{self.url}/v1/chat/completions", json=body | options, timeout=120)
        assert response.status_code == 200, response.text
        return response

    def stream(self, messages: list[dict], include_usage: bool = True) -> list[dict]:
        """The chunks of one streamed answer; `ignore_eos` lets the tiny real model always fill max_tokens."""
        options = {"stream": True, "stream_options": {"include_usage": include_usage}}
        lines = self.chat(messages, **options).text.split("\n\n")
        events = [line.removeprefix("data: ") for line in lines if line]
        assert events[-1] == "[DONE]", events[-1]
        return [json.loads(event) for event in events[:-1]]

    def metrics(self) -> str:
        return http_get(f"{self.url}/metrics", timeout=10).text


@dataclass(frozen=True)
class Traffic:
    conversations: list[list[list[dict]]]  # conversation -> round -> chunks
    completion: dict
    stream_without_usage: list[dict]

    def usages(self) -> list[dict]:
        return [chunks[-1]["usage"] for chunks in self.rounds()] + [self.completion["usage"]]

    def rounds(self) -> list[list[dict]]:
        return [chunks for conversation in self.conversations for chunks in conversation]

    def shapes(self) -> dict[str, frozenset[str]]:
        streamed = [chunk for chunks in self.rounds() for chunk in chunks]
        return (
            {"completion": shape(self.completion)}
            | stream_shapes("stream", streamed)
            | stream_shapes("stream without usage", self.stream_without_usage)
        )


def send_traffic(server: Server) -> Traffic:
    """Two streamed two-round conversations, one answer not streamed, one stream without usage."""
    conversations = []
    for topic in ("rule", "law"):
        system = " ".join(f"{topic}{i}" for i in range(SYSTEM_WORDS))
        messages = [{"role": "system", "content": system}]
        rounds = []
        for question in ("Summarise the rules.", "Say more."):
            messages.append({"role": "user", "content": question})
            rounds.append(server.stream(messages))
            answer = "".join(c["choices"][0]["delta"].get("content", "") for c in rounds[-1] if c["choices"])
            messages.append({"role": "assistant", "content": answer})
        conversations.append(rounds)
    question = [{"role": "user", "content": "What is a prefix cache?"}]
    return Traffic(conversations, server.chat(question).json(), server.stream(question, include_usage=False))


def block_size(server: Server) -> int:
    (size,) = families(server.metrics())["vllm:cache_config_info"].values["block_size"]
    return int(size)


@pytest.fixture(scope="module")
def real_vllm(vllm_lab) -> Server:
    """The first real vLLM server of the lab."""
    return Server(vllm_lab.replica_url("r1"), vllm_lab.status["model"])


@pytest.fixture
def replicas(real_vllm, start_replica) -> tuple[Server, Server]:
    """(simulated, real): a fresh sim with the real engine's model name and block size."""
    block = str(block_size(real_vllm))
    sim = start_replica(
        "r1", "vllm", "--model", real_vllm.model, "--block-size", block, "--time-scale", "0.05"
    )
    return Server(sim.url, real_vllm.model), real_vllm


@pytest.mark.integration
def test_metrics_after_the_same_traffic_agree_with_real_vllm(replicas):
    sim, real = replicas
    for server in (sim, real):
        send_traffic(server)
    assert metric_differences(sim.metrics(), real.metrics()) == []
    assert counter_problems(sim.metrics()) == []
    assert counter_problems(real.metrics()) == []


@pytest.mark.integration
def test_answers_to_the_same_traffic_have_real_vllms_shape_and_usage(replicas):
    sim, real = replicas
    traffic = {server: send_traffic(server) for server in (sim, real)}
    assert shape_differences(traffic[sim].shapes(), traffic[real].shapes()) == []
    for server, sent in traffic.items():
        block = block_size(server)
        assert [problem for usage in sent.usages() for problem in usage_problems(usage, block)] == [], server
        # Round two reuses round one's blocks, so the cache's side of the contract was exercised.
        assert all(
            rounds[1][-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            for rounds in sent.conversations
        )
