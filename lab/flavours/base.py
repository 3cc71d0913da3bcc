"""The interface every metrics flavour implements, and the records the replica passes to it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from prometheus_client import CollectorRegistry


@dataclass(frozen=True)
class Prefill:
    """A request whose prefill just finished (its first token is out)."""

    prompt_tokens: int
    cached_tokens: int
    prefix_caching: bool
    queue_seconds: float
    ttft_seconds: float
    streaming: bool


@dataclass(frozen=True)
class Finished:
    """A request that ended: normally (`stop`, `length`) or cut off (`abort`)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    e2e_seconds: float
    streaming: bool
    finished_reason: str


@dataclass(frozen=True)
class CacheConfig:
    """The engine's configuration as its metrics describe it: the KV cache and the context length."""

    block_size: int
    num_gpu_blocks: int
    prefix_caching: bool
    max_model_len: int  # vLLM buckets its per-request token histograms up to it


class EngineMetrics:
    """What the replica tells its metrics; a flavour turns it into its engine's series."""

    name: ClassVar[str]  # as `kvwatch lab up --flavours` names it

    def __init__(self, model_name: str, cache: CacheConfig) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.cache = cache

    def prefill_done(self, prefill: Prefill) -> None:
        """Called once per request when its first token is produced."""

    def finished(self, finished: Finished) -> None:
        """Called once per request when it ends."""

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        """Called whenever the number of running / waiting requests or the cache usage changes."""

    def set_prefix_caching(self, enabled: bool) -> None:
        """Called when prefix caching is switched on or off."""
        self.cache = replace(self.cache, prefix_caching=enabled)
