"""The contract between the lab's simulated `vllm` flavour and a real vLLM (0.32): what must agree.

Both sides are read as kvwatch reads them: /metrics with prometheus_client's parser, answers as JSON.
Every function returns the list of what is wrong, in words, so that a failing contract test says what
to change in lab/flavours/vllm.py or lab/server.py; an empty list means the sim is honest.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# What kvwatch reads from a vLLM V1 engine (collectors/engines/vllm.py, prometheus/queries.py); both sides
# must export it. Deprecated fallbacks such as vllm:gpu_prefix_cache_* are not required.
REQUIRED_FAMILIES = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_cached",
    "vllm:prompt_tokens_by_source",
    "vllm:prompt_tokens_cached_by_source",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
)
CONFIG_INFO = "vllm:cache_config_info"
# Labels of CONFIG_INFO whose values depend on how much memory each engine has, not on what it is.
SIZE_LABELS = frozenset({"num_gpu_blocks", "kv_cache_size_tokens"})
# CONFIG_INFO has a label per CacheConfig field (36 in 0.32). The sim mirrors some, each of which must be a
# real one; both must have those kvwatch reads or will read: the block size, whether prefix caching is on,
# the cache's size and its offloading.
CONFIG_LABELS = SIZE_LABELS | {"block_size", "enable_prefix_caching", "engine", "kv_offloading_backend"}

# Fields of vLLM's answers that the sim leaves out: each carries data only for something the lab has not
# or was not asked for (token ids and prompt text on request, disaggregated prefill, per-request metrics,
# MoE routing, reasoning parsers, stop strings, multimodal input).
LEFT_OUT_FIELDS = frozenset(
    {
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_text",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
        "choices[].stop_reason",
        "choices[].token_ids",
        "choices[].routed_experts",
        "choices[].message.reasoning",
        "usage.prompt_tokens_details.multimodal_tokens",
    }
)


@dataclass(frozen=True)
class Family:
    """What the contract compares of one metric family: never its numbers, which traffic decides."""

    type: str
    labels: frozenset[str]  # label names, `le` aside
    values: dict[str, frozenset[str]]  # the values each label takes
    buckets: frozenset[float]  # a histogram's `le` bounds; empty for other types


def families(text: str) -> dict[str, Family]:
    """The families of one /metrics text, without prometheus_client's `_created` companions."""
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue
        values: dict[str, set[str]] = defaultdict(set)
        for sample in family.samples:
            for label, value in sample.labels.items():
                values[label].add(value)
        buckets = frozenset(float(le) for le in values.pop("le", ()))
        labels = {label: frozenset(seen) for label, seen in values.items()}
        found[family.name] = Family(family.type, frozenset(labels), labels, buckets)
    return found


def metric_differences(
    sim_text: str, real_text: str, required: Iterable[str] = REQUIRED_FAMILIES
) -> list[str]:
    """Every way the sim's families differ from the real engine's, and the required families either lacks.

    Families only the real engine exports are no difference: the sim imitates what kvwatch needs.
    """
    sim, real = families(sim_text), families(real_text)
    differences = [
        f"{name}: kvwatch reads it, and the {side} does not export it"
        for name in required
        for side, exported in (("sim", sim), ("real engine", real))
        if name not in exported
    ]
    for name, ours in sorted(sim.items()):
        if name not in real:
            differences.append(f"{name}: the sim exports it, the real engine does not")
            continue
        differences += _family_differences(name, ours, real[name])
    return differences


def _family_differences(name: str, sim: Family, real: Family) -> list[str]:
    differences = []
    if sim.type != real.type:
        differences.append(f"{name}: a {sim.type} in the sim, a {real.type} in the real engine")
    if name == CONFIG_INFO:  # an info gauge, of whose labels the sim mirrors a part
        differences += [
            f"{name}: the {side} has no label {label!r}"
            for side, labels in (("sim", sim.labels), ("real engine", real.labels))
            for label in sorted(CONFIG_LABELS - labels)
        ]
        if sim.labels - real.labels:
            differences.append(f"{name}: labels only in the sim {sorted(sim.labels - real.labels)}")
    elif sim.labels != real.labels:
        differences.append(
            f"{name}: labels only in the sim {sorted(sim.labels - real.labels)}, "
            f"only in the real engine {sorted(real.labels - sim.labels)}"
        )
    for label in sorted((sim.labels & real.labels) - SIZE_LABELS):
        if sim.values[label] != real.values[label]:
            differences.append(
                f"{name}: label {label!r} takes {sorted(sim.values[label])} in the sim, "
                f"{sorted(real.values[label])} in the real engine"
            )
    if sim.buckets != real.buckets:
        differences.append(
            f"{name}: buckets only in the sim {sorted(sim.buckets - real.buckets)}, "
            f"only in the real engine {sorted(real.buckets - sim.buckets)}"
        )
    return differences


def counter_problems(text: str) -> list[str]:
    """Where one engine's /metrics breaks the identities the sim is built on.

    Each identity links counters that vLLM increments in the same step, so it holds at any scrape, even
    while other requests run: prompt tokens split by source, cached tokens by tier, and the KV cache's
    size in tokens.
    """
    totals: dict[tuple[str, str], float] = defaultdict(float)
    config = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name, sample.labels.get("source", "")] += sample.value
            if family.name == CONFIG_INFO:
                config = sample.labels

    def total(name: str, source: str | None = None) -> float:
        if source is not None:
            return totals[f"vllm:{name}_total", source]
        return sum(value for (sample, _), value in totals.items() if sample == f"vllm:{name}_total")

    identities = {
        "prompt_tokens = local_compute + local_cache_hit + external_kv_transfer by source": (
            total("prompt_tokens"),
            total("prompt_tokens_by_source"),
        ),
        "prompt_tokens_cached = local_cache_hit + external_kv_transfer": (
            total("prompt_tokens_cached"),
            total("prompt_tokens_by_source", "local_cache_hit")
            + total("prompt_tokens_by_source", "external_kv_transfer"),
        ),
        "prompt_tokens_cached_by_source, all tiers = prefix_cache_hits + external_prefix_cache_hits": (
            total("prompt_tokens_cached_by_source"),
            total("prefix_cache_hits") + total("external_prefix_cache_hits"),
        ),
        "cache_config_info: kv_cache_size_tokens = num_gpu_blocks x block_size": (
            int(config.get("kv_cache_size_tokens", -1)),
            int(config.get("num_gpu_blocks", 0)) * int(config.get("block_size", 0)),
        ),
    }
    return [
        f"{identity}: {left} != {right}" for identity, (left, right) in identities.items() if left != right
    ]


def usage_problems(usage: dict, block_size: int) -> list[str]:
    """Where one answer's usage breaks what vLLM reports with prefix caching on.

    Hits are whole blocks and never the last prompt token; `created_cache_tokens` counts the prompt's full
    blocks that were not hits, the last one included when the whole prompt was cached before.
    """
    prompt = usage["prompt_tokens"]
    details = usage["prompt_tokens_details"]
    cached, created = details["cached_tokens"], details["created_cache_tokens"]
    problems = []
    if cached % block_size or cached >= prompt:
        problems.append(f"{cached} of {prompt} prompt tokens cached: not whole blocks, or the last one too")
    if created != prompt // block_size * block_size - cached:
        problems.append(f"{created} created cache tokens for {prompt} prompt tokens, {cached} of them cached")
    return problems


def shape(body: object, path: str = "") -> frozenset[str]:
    """Every key path of a JSON body, e.g. `usage.prompt_tokens_details.cached_tokens` (list items: `[]`)."""
    if isinstance(body, dict):
        paths = set()
        for key, value in body.items():
            here = f"{path}.{key}" if path else key
            paths |= {here, *shape(value, here)}
        return frozenset(paths)
    if isinstance(body, list):
        return frozenset().union(*(shape(item, f"{path}[]") for item in body))
    return frozenset()


def chunk_kind(chunk: dict) -> str:
    """Which chunk of an event stream this is: `first` (the role), `token`, `last` (finishing) or `usage`."""
    if not chunk["choices"]:
        return "usage"
    choice = chunk["choices"][0]
    if "role" in choice["delta"]:
        return "first"
    return "token" if choice["finish_reason"] is None else "last"


def stream_shapes(name: str, chunks: list[dict]) -> dict[str, frozenset[str]]:
    """The shape of each kind of chunk in one or more streams, keyed `<name> <kind>`."""
    shapes: dict[str, frozenset[str]] = defaultdict(frozenset)
    for chunk in chunks:
        shapes[f"{name} {chunk_kind(chunk)}"] |= shape(chunk)
    return dict(shapes)


def shape_differences(sim: dict[str, frozenset[str]], real: dict[str, frozenset[str]]) -> list[str]:
    """Every key path in which the sim's answers differ from the real engine's, left-out fields aside."""
    differences = []
    for kind in sorted(sim.keys() | real.keys()):
        if kind not in sim or kind not in real:
            differences.append(f"{kind}: only the {'sim' if kind in sim else 'real engine'} sends one")
            continue
        ours, theirs = _mirrored(sim[kind]), _mirrored(real[kind])
        differences += [
            f"{kind}: the sim sends {path}, the real engine does not" for path in sorted(ours - theirs)
        ]
        differences += [f"{kind}: the sim lacks {path}" for path in sorted(theirs - ours)]
    return differences


def _mirrored(paths: frozenset[str]) -> frozenset[str]:
    return frozenset(
        path
        for path in paths
        if not any(path == field or path.startswith((f"{field}.", f"{field}[]")) for field in LEFT_OUT_FIELDS)
    )
