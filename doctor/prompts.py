"""The doctor's look at real prompts: dynamic content (a timestamp, an id) at the front of the system
prompt, which makes every conversation's prompt unique from there on, so that no cache can reuse it."""

from __future__ import annotations

import bisect
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvwatch.core.tokenizer import TemplateError, message_text, split_words
from kvwatch.doctor.findings import Check

MAX_SAMPLE_REQUESTS = 10_000
MIN_STATIC_TAIL = 16  # one KV block: static content after a varying piece that a cache could have reused
EXCERPT_CHARS = 60

# What the varying piece of a system prompt looks like, most specific first.
DYNAMIC_CONTENT = (
    ("UUID", re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)),
    ("timestamp", re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}|^\d{10}(\d{3})?\b")),
    ("date", re.compile(r"\d{4}-\d{2}-\d{2}|\b\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b")),
    ("time of day", re.compile(r"\b\d{1,2}:\d{2}(:\d{2})?\b")),
    ("request id", re.compile(r"\b[0-9a-f]{12,}\b", re.IGNORECASE)),
    ("counter", re.compile(r"\d+")),
)
# Seen on the varying piece's line when the piece itself looks like nothing in particular.
ID_LABEL = re.compile(r"\b(request|trace|correlation|session|conversation)[ _-]?id\b", re.IGNORECASE)


@dataclass(frozen=True)
class _Prompt:
    """A distinct system prompt: its text, its tokens (words and punctuation, as the lab's tokenizer
    counts them) and where each token starts in the text."""

    text: str
    tokens: list[str]
    starts: list[int]

    @classmethod
    def of(cls, text: str) -> _Prompt:
        tokens, starts, position = split_words(text), [], 0
        for token in tokens:
            position = text.index(token, position)
            starts.append(position)
            position += len(token)
        return cls(text, tokens, starts)

    def varying(self, index: int) -> tuple[int, str, str]:
        """About the token at `index`: the index of the first token of the text between spaces around it,
        what that text looks like (a kind of DYNAMIC_CONTENT, or "") and its line."""
        at = self.starts[index]
        start = at - len(re.search(r"\S*$", self.text[:at]).group())
        chunk = self.text[start:].split(None, 1)[0]
        line = self.text[self.text.rfind("\n", 0, at) + 1 :].split("\n", 1)[0].strip()
        kind = next((kind for kind, pattern in DYNAMIC_CONTENT if pattern.search(chunk)), "")
        kind = kind or ("request id" if ID_LABEL.search(line) else "")
        excerpt = line if len(line) <= EXCERPT_CHARS else line[: EXCERPT_CHARS - 1] + "…"
        return bisect.bisect_left(self.starts, start), kind, excerpt


def _front_variation(a: _Prompt, b: _Prompt) -> int | None:
    """Where two system prompts differ, when they are one prompt with a short varying piece followed by
    static content that a cache could have reused; None when they are different prompts or differ only
    at the end."""
    shorter = min(len(a.tokens), len(b.tokens))
    same = next((i for i in range(shorter) if a.tokens[i] != b.tokens[i]), shorter)
    tail = 0
    while tail < shorter - same and a.tokens[-1 - tail] == b.tokens[-1 - tail]:
        tail += 1
    piece = max(len(a.tokens), len(b.tokens)) - same - tail
    return same if tail >= MIN_STATIC_TAIL and piece <= tail else None


def _system_prompts(path: Path) -> tuple[list[str], int]:
    """The system prompt of each request payload in a JSONL file ("" when it has none), and how many lines
    were no request payload. At most MAX_SAMPLE_REQUESTS are read."""
    prompts, malformed = [], 0
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
                head = []
                for message in messages:
                    if message.get("role") not in ("system", "developer"):
                        break
                    head.append(message_text(message))
                prompts.append("\n".join(head))
            except (ValueError, TypeError, KeyError, AttributeError, TemplateError):
                malformed += 1
            if len(prompts) >= MAX_SAMPLE_REQUESTS:
                break
    return prompts, malformed


def prompt_prefix(requests_sample: str | Path | None) -> Check:
    """A timestamp or an id at the top of the system prompt makes every conversation's prompt unique from
    there on, so none reuses the static rest that the cache holds from another."""
    name = "prompt-prefix stability"
    if requests_sample is None:
        return Check(name, "skipped", "no --requests-sample FILE.jsonl of real request payloads to look at")
    try:
        prompts, malformed = _system_prompts(Path(requests_sample))
    except (OSError, UnicodeDecodeError) as error:
        return Check(name, "skipped", f"cannot read {requests_sample}: {error}")
    unread = f"; {malformed} lines were no request payload with `messages`" if malformed else ""
    if len(prompts) < 2:
        return Check(
            name, "skipped", f"{len(prompts)} requests in {requests_sample}: too few to compare{unread}"
        )
    groups = Counter(prompts)
    if not any(groups):
        return Check(name, "pass", f"none of {len(prompts)} requests starts with a system prompt{unread}")
    if len(groups) == 1:
        size = len(split_words(prompts[0]))
        return Check(
            name, "pass", f"all {len(prompts)} requests share one system prompt of {size} tokens{unread}"
        )
    largest = groups.most_common(1)[0][1]
    summary = (
        f"{len(prompts)} requests, {len(groups)} distinct system prompts; the most common is shared by "
        f"{largest} ({largest / len(prompts):.0%}){unread}"
    )
    distinct = sorted(map(_Prompt.of, groups), key=lambda p: p.tokens)
    found = []  # (first varying token, kind, line) of each prompt that is another one but for a piece
    for a, b in zip(distinct, distinct[1:], strict=False):
        index = _front_variation(a, b)
        if index is not None:
            found += [a.varying(index), b.varying(index)]
    if not found:
        return Check(name, "pass", f"{summary}; no two differ only in a piece before static content")
    token = Counter(index for index, _, _ in found).most_common(1)[0][0]
    kinds = Counter(kind for _, kind, _ in found if kind)
    examples = " vs ".join(f"'{line}'" for line in dict.fromkeys(line for _, _, line in found[:4]))
    what = f"a {kinds.most_common(1)[0][0]}" if kinds else "a piece"
    evidence = (
        f"{summary}; they are one prompt with {what} that varies from token {token} on (words and "
        f"punctuation as the lab counts them; a real tokenizer's index differs somewhat): {examples}"
    )
    fix = (
        "put static content first and dynamic content last: move what changes out of the top of the system "
        "prompt, into the last user message or the end of the system prompt"
    )
    if not kinds:
        return Check(name, "warn", evidence, fix)
    return Check(name, "fail", evidence, fix, "dynamic_prompt_prefix")
