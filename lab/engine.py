"""The simulated inference engine behind one lab replica.

It models what makes session affinity matter: a real prefix cache, prefill serialised on one
accelerator (so load queues), and time to first token = queue wait + per-request overhead + uncached
prompt tokens / prefill rate. Every request leaves a ground-truth record of what really happened.

Default timings model a 7B/8B-class model in bf16 on one mid-range data-centre GPU (an L40S: about
180 TFLOP/s dense bf16, 864 GB/s). Prefill is compute bound at 2 FLOP per parameter per token, so
~1.6e10 FLOP/token at ~50 % utilisation gives ~6,000 tokens/s: a 4,000-token cold prefill costs
about 0.7 s. Decode is memory bound: ~16 GB of weights read per step gives ~50 tokens/s per sequence.
KV cache: an 8B GQA model needs 128 KiB per token; ~10 GiB left for KV is ~80,000 tokens, i.e. 5,000
blocks of 16.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvwatch.core.tokenizer import answer_words, tokenize
from kvwatch.lab.flavours import SIMULATED_FLAVOURS, CacheConfig, Finished, Prefill
from kvwatch.lab.prefix_cache import PrefixCache
from kvwatch.lab.sessions import SessionTable

# content: answer text only; reasoning: a reasoning model's thinking first, then text; tool-call: a tool
# call's arguments and no text.
ANSWER_STYLES = ("content", "reasoning", "tool-call")
GROUND_TRUTH_KEPT = 100_000
# A ground-truth file is renamed to <file>.1 (replacing the one before) once it reaches this size, so
# a replica keeps at most twice as much on disk however long the lab runs.
GROUND_TRUTH_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ReplicaSettings:
    replica_id: str
    flavour: str = "vllm"
    model: str = "lab-model"
    block_size: int = 16
    cache_blocks: int = 5000
    max_model_len: int = 8192  # as the lab's real vLLM runs (--max-model-len); the sim does not enforce it
    prefill_tokens_per_s: float = 6000.0
    decode_tokens_per_s: float = 50.0
    request_overhead_s: float = 0.015
    max_num_seqs: int = 64
    answer_tokens: int = 48
    time_scale: float = 1.0
    identity_header: bool = True
    answer_style: str = "content"  # one of ANSWER_STYLES: how the stream delivers the answer's tokens
    ground_truth_path: Path | None = None
    ground_truth_max_bytes: int = GROUND_TRUTH_MAX_BYTES
    seed: int = 0


@dataclass(frozen=True)
class Faults:
    """Runtime faults, switched through the replica's admin endpoint."""

    prefix_caching: bool = True
    extra_latency_s: float = 0.0
    error_rate: float = 0.0
    # None: no key needed. Otherwise each accepted key maps to the models it may use ("*" = all).
    api_keys: dict[str, list[str]] | None = None
    expired_keys: list[str] = field(default_factory=list)

    def public(self) -> dict:
        """The faults as the admin endpoint shows them: keys are never echoed, only counted."""
        shown = asdict(self)
        shown["api_keys"] = None if self.api_keys is None else len(self.api_keys)
        shown["expired_keys"] = len(self.expired_keys)
        return shown


class Engine:
    def __init__(self, settings: ReplicaSettings) -> None:
        self.settings = settings
        self.faults = Faults()
        # SageMaker's stateful sessions (lab/sessions.py); None: not enabled, as by default.
        self.sessions: SessionTable | None = None
        self.cache = PrefixCache(settings.cache_blocks, settings.block_size)
        self.metrics = SIMULATED_FLAVOURS.lookup(settings.flavour)(
            settings.model,
            CacheConfig(
                settings.block_size,
                settings.cache_blocks,
                prefix_caching=True,
                max_model_len=settings.max_model_len,
            ),
        )
        self.ground_truth: deque[dict] = deque(maxlen=GROUND_TRUTH_KEPT)
        # Requests not yet recorded, by id: their arrival (unix time). A test that compares the ground
        # truth with what was scraped by some moment waits until none that arrived before it is left.
        self.in_flight: dict[str, float] = {}
        self.rng = random.Random(settings.seed)
        self._prefill_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(settings.max_num_seqs)
        self._running = 0
        self._waiting = 0
        self._request_count = 0
        self._publish_load()

    def set_faults(self, faults: Faults) -> None:
        if faults.prefix_caching != self.faults.prefix_caching:
            self.metrics.set_prefix_caching(faults.prefix_caching)
        self.faults = faults

    def reset_cache(self) -> None:
        self.cache.clear()
        self._publish_load()

    def should_fail(self) -> bool:
        return self.faults.error_rate > 0 and self.rng.random() < self.faults.error_rate

    def record(self, entry: dict) -> None:
        """Keep a ground-truth record in memory and, when configured, in the JSONL file (rotated)."""
        entry = {"replica": self.settings.replica_id, **entry}
        self.ground_truth.append(entry)
        path = self.settings.ground_truth_path
        if path is not None:
            with path.open("a") as out:
                out.write(json.dumps(entry) + "\n")
                full = out.tell() >= self.settings.ground_truth_max_bytes
            if full:
                path.replace(path.with_name(f"{path.name}.1"))

    def sequence(
        self,
        prompt: list[int],
        max_tokens: int | None,
        streaming: bool,
        session_id: str | None,
        arrival: float,
    ) -> Sequence:
        """A new request that arrived at `arrival` (time.monotonic()), before it was parsed."""
        self._request_count += 1
        request_id = f"{self.settings.replica_id}-{self._request_count}"
        return Sequence(self, request_id, prompt, max_tokens, streaming, session_id, arrival)

    async def sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds * self.settings.time_scale)

    def _publish_load(self) -> None:
        self.metrics.set_load(self._running, self._waiting, self.cache.usage)


class Sequence:
    """One request's life in the engine: queue, prefill, decode, finish.

    Use as `async with engine.sequence(...) as seq: await seq.prefill(); async for w in seq.decode()`.
    Leaving the block early (client gone, error) records the request as aborted.
    """

    def __init__(
        self,
        engine: Engine,
        request_id: str,
        prompt: list[int],
        max_tokens: int | None,
        streaming: bool,
        session_id: str | None,
        arrival: float,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt = prompt
        self.streaming = streaming
        self.session_id = session_id
        answer_len = engine.settings.answer_tokens
        self.words = answer_words(prompt, min(answer_len, max_tokens or answer_len))
        self.finish_reason = "length" if max_tokens is not None and max_tokens < answer_len else "stop"
        self.cached_tokens = 0
        self.completion_tokens = 0
        self._arrival = arrival
        self._arrival_wall = time.time() - (time.monotonic() - arrival)
        self._queue_seconds = 0.0
        self._ttft_seconds: float | None = None
        self._state = "new"
        self._prefix_caching = engine.faults.prefix_caching

    async def __aenter__(self) -> Sequence:
        self.engine.in_flight[self.request_id] = self._arrival_wall
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        engine = self.engine
        del engine.in_flight[self.request_id]  # recorded below, if it began
        if self._state == "waiting":
            engine._waiting -= 1
        elif self._state in ("prefill", "decode", "done"):
            engine._running -= 1
            engine._slots.release()
        if self._state != "new":
            self._finish("abort" if self._state != "done" else self.finish_reason)
        engine._publish_load()

    async def prefill(self) -> None:
        """Wait for a sequence slot and the accelerator, then compute the uncached prompt tokens."""
        engine, settings = self.engine, self.engine.settings
        self._state = "waiting"
        engine._waiting += 1
        engine._publish_load()
        await engine.sleep(engine.faults.extra_latency_s)
        await engine._slots.acquire()
        try:
            await engine._prefill_lock.acquire()
        except BaseException:
            engine._slots.release()
            raise
        try:
            engine._waiting -= 1
            engine._running += 1
            self._state = "prefill"
            self._queue_seconds = time.monotonic() - self._arrival
            if self._prefix_caching:
                self.cached_tokens = engine.cache.match(self.prompt)
            engine._publish_load()
            uncached = len(self.prompt) - self.cached_tokens
            await engine.sleep(settings.request_overhead_s + uncached / settings.prefill_tokens_per_s)
            if self._prefix_caching:
                engine.cache.insert(self.prompt)
        finally:
            engine._prefill_lock.release()
        self._state = "decode"
        self._ttft_seconds = time.monotonic() - self._arrival
        engine.metrics.prefill_done(
            Prefill(
                prompt_tokens=len(self.prompt),
                cached_tokens=self.cached_tokens,
                prefix_caching=self._prefix_caching,
                queue_seconds=self._queue_seconds,
                ttft_seconds=self._ttft_seconds,
                streaming=self.streaming,
            )
        )
        engine._publish_load()

    async def decode(self) -> AsyncIterator[str]:
        """Yield the answer word by word; the first comes with prefill, the rest at the decode rate."""
        step = 1.0 / self.engine.settings.decode_tokens_per_s
        for index, word in enumerate(self.words):
            if index:
                await self.engine.sleep(step)
            self.completion_tokens = index + 1
            yield word
        self._state = "done"

    @property
    def ttft_seconds(self) -> float | None:
        """From arrival to the end of prefill; None before it ends."""
        return self._ttft_seconds

    @property
    def created_cache_tokens(self) -> int:
        """Prompt tokens in full blocks that this request computed for the cache, as vLLM counts them.

        A fully repeated prompt still creates its last full block: that block is recomputed, since the
        last prompt token is never a hit.
        """
        if not self._prefix_caching:
            return 0
        block = self.engine.settings.block_size
        return len(self.prompt) // block * block - self.cached_tokens

    def _finish(self, reason: str) -> None:
        engine = self.engine
        e2e = time.monotonic() - self._arrival
        if self._prefix_caching and self.completion_tokens:
            answer = tokenize(" ".join(self.words[: self.completion_tokens]))
            engine.cache.insert(self.prompt + answer)
        if self._ttft_seconds is not None:
            engine.metrics.finished(
                Finished(
                    prompt_tokens=len(self.prompt),
                    cached_tokens=self.cached_tokens,
                    completion_tokens=self.completion_tokens,
                    e2e_seconds=e2e,
                    streaming=self.streaming,
                    finished_reason=reason,
                )
            )
        engine.record(
            {
                "request_id": self.request_id,
                "time": self._arrival_wall,
                "session_id": self.session_id,
                "status": 200,
                "streaming": self.streaming,
                "prompt_tokens": len(self.prompt),
                "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens,
                "queue_seconds": round(self._queue_seconds, 6),
                "ttft_seconds": None if self._ttft_seconds is None else round(self._ttft_seconds, 6),
                "e2e_seconds": round(e2e, 6),
                "finished_reason": reason,
                "prefix_caching": self._prefix_caching,
            }
        )


def faults_from_json(current: Faults, update: dict) -> Faults:
    """Apply a partial update from the admin endpoint; unknown or mistyped fields are rejected."""
    allowed = {
        "prefix_caching": bool,
        "extra_latency_s": (int, float),
        "error_rate": (int, float),
        "api_keys": (dict, type(None)),
        "expired_keys": list,
    }
    for key, value in update.items():
        if key not in allowed:
            raise ValueError(f"unknown fault {key!r}; known: {', '.join(sorted(allowed))}")
        if not isinstance(value, allowed[key]) or (isinstance(value, bool) and key != "prefix_caching"):
            raise ValueError(f"fault {key!r} has the wrong type")
    if not 0 <= float(update.get("error_rate", current.error_rate)) <= 1:
        raise ValueError("error_rate must be between 0 and 1")
    if float(update.get("extra_latency_s", current.extra_latency_s)) < 0:
        raise ValueError("extra_latency_s must not be negative")
    keys = update.get("api_keys", current.api_keys)
    if keys is not None and not all(
        isinstance(models, list) and all(isinstance(m, str) for m in models) for models in keys.values()
    ):
        raise ValueError("api_keys must map each key to a list of model names")
    return replace(current, **update)
