"""Seeded, reproducible multi-turn workloads for the probe: synthetic, or loaded from ShareGPT-style JSON.

Sizes are in lab tokens: the lab's tokenizer counts each word and each punctuation mark as one token.
Real tokenizers differ (a BPE tokenizer gives roughly 1.3 tokens per English word), so against a real
engine the same workload has a somewhat longer prompt; the probe reads the true counts from `usage`.
"""

from __future__ import annotations

import json
import os
import random
import stat
from dataclasses import dataclass
from pathlib import Path

# The default for conversations that bring none: static, so every session shares it as a cached prefix.
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer accurately and concisely, and keep the whole conversation "
    "in mind when you answer."
)

_WORDS = (
    "account answer archive balance batch budget cache channel check client cluster config context "
    "customer data deploy detail document engine error event field file format gateway history index "
    "invoice issue latency limit log memory message metric model network node order owner policy "
    "prompt queue quota record region replica report request result review route rule schedule "
    "service session shipment status storage summary support system table team ticket token trace "
    "update usage user value version warning window worker"
).split()

_USER_ROLES = {"human", "user"}
# A ShareGPT file is parsed whole and its conversations kept for the process's life: 16 MiB holds a few
# thousand conversations, more than a probe cycles through, in about 100 MB of memory once parsed.
MAX_SHAREGPT_BYTES = 16 << 20


@dataclass(frozen=True)
class Conversation:
    """What a probe session sends: the static system prompt first, then one user turn per round."""

    system_prompt: str
    user_turns: tuple[str, ...]


def text(tokens: int, rng: random.Random) -> str:
    """Sentences of exactly `tokens` lab tokens (each word and each full stop is one)."""
    parts: list[str] = []
    while len(parts) < tokens:
        words = min(rng.randint(5, 13), tokens - len(parts) - 1)
        if words < 1:
            parts.append(rng.choice(_WORDS))
            break
        parts += [rng.choice(_WORDS) for _ in range(words)] + ["."]
    return " ".join(parts).replace(" .", ".")


def system_prompt(tokens: int, seed: int) -> str:
    """The static system prompt all sessions share: the prefix a healthy cluster reuses across them."""
    return text(tokens, random.Random(f"system-{seed}"))


def user_turns(rounds: int, tokens: int, rng: random.Random) -> tuple[str, ...]:
    return tuple(text(tokens, rng) for _ in range(rounds))


def synthetic(
    rounds: int, system_tokens: int, turn_tokens: int, seed: int, sessions: int
) -> list[Conversation]:
    """`sessions` conversations of `rounds` turns: one shared system prompt, each its own user turns."""
    for name, value in (
        ("rounds", rounds),
        ("system_tokens", system_tokens),
        ("turn_tokens", turn_tokens),
        ("sessions", sessions),
    ):
        if value < 1:
            raise ValueError(f"{name} must be positive, not {value}")
    system = system_prompt(system_tokens, seed)
    rng = random.Random(f"turns-{seed}")
    return [Conversation(system, user_turns(rounds, turn_tokens, rng)) for _ in range(sessions)]


def load_sharegpt(
    path: str | Path, min_rounds: int = 4, limit: int | None = None, seed: int = 0
) -> list[Conversation]:
    """Conversations with at least `min_rounds` human turns from a ShareGPT-style JSON file.

    The file is a list of {"id", "conversations": [{"from": "system" | "human" | "gpt", "value"}]};
    "role" / "content" keys (and "messages" for the list) are read too. Only the human turns are kept,
    in order: the probe sends the answers it really gets. Short conversations are dropped, as the
    source article advises, so that every session has warm rounds to measure. A seeded shuffle picks
    `limit` of them. Raises ValueError naming the file and the problem, a file over MAX_SHAREGPT_BYTES
    or that is no regular file (a FIFO, /dev/zero) included.
    """
    path = Path(path)
    try:
        data = _read_bounded(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot read it ({error.strerror})") from None
    if data is None:
        raise ValueError(f"{path}: not a regular file")
    if len(data) > MAX_SHAREGPT_BYTES:
        raise ValueError(
            f"{path}: larger than {MAX_SHAREGPT_BYTES >> 20} MiB; a probe needs a few thousand conversations "
            "at most: keep a part of the file, e.g. with `jq '.[:2000]'`"
        )
    try:
        items = json.loads(data)
    except ValueError as error:  # bad JSON, or bytes that are no Unicode text at all
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    except RecursionError:
        raise ValueError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(items, list):
        raise ValueError(
            f"{path}: expected a JSON list of conversations, found a JSON {type(items).__name__}"
        )
    kept = [c for c in map(_conversation, items) if c and len(c.user_turns) >= min_rounds]
    if not kept:
        raise ValueError(
            f"{path}: no usable conversation: none of its {len(items)} entries has at least "
            f"{min_rounds} human turns"
        )
    random.Random(seed).shuffle(kept)
    return kept[:limit]


def _read_bounded(path: Path) -> bytes | None:
    """The file's bytes, one more than MAX_SHAREGPT_BYTES at most; None when it is no regular file. Opened
    without blocking, so that a FIFO at the path is refused rather than waited on."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(descriptor, "rb") as file:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None
        return file.read(MAX_SHAREGPT_BYTES + 1)


def _conversation(item: object) -> Conversation | None:
    """One entry as a Conversation; None when it is not shaped like a conversation at all."""
    messages = item.get("conversations", item.get("messages")) if isinstance(item, dict) else None
    if not isinstance(messages, list):
        return None
    system, turns = DEFAULT_SYSTEM_PROMPT, []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("from", message.get("role"))
        value = message.get("value", message.get("content"))
        if not isinstance(value, str) or not value.strip():
            continue
        if role == "system":
            system = value
        elif role in _USER_ROLES:
            turns.append(value)
    return Conversation(system, tuple(turns))
