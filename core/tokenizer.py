"""A deterministic stand-in tokenizer and chat template.

The lab needs what a real engine's tokenizer guarantees and nothing more: the same text always gives the
same token ids, and a conversation that grows by appending messages keeps its rendered prefix token for
token, so the prefix cache can reuse it. One word or punctuation mark is one token.
"""

from __future__ import annotations

import functools
import random
import re
import zlib
from collections.abc import Iterable, Mapping

from kvwatch.core.errors import KVWatchError

_TOKEN_PATTERN = re.compile(r"\w+|[^\w\s]")
# Ids below this are reserved for the chat template's markers; text tokens hash above it.
_FIRST_TEXT_ID = 1000
_ROLE_IDS = {"system": 1, "user": 2, "assistant": 3, "tool": 4, "developer": 5}
_END_OF_MESSAGE = 10

_ANSWER_WORDS = (
    "the cache keeps every block of the conversation so the next round only computes what is new "
    "while a replica that never saw the history must prefill all of it again from the first token"
).split()


class TemplateError(KVWatchError, ValueError):
    """A message the chat template cannot render (the server answers 400 with this text)."""


def split_words(text: str) -> list[str]:
    return _TOKEN_PATTERN.findall(text)


def tokenize(text: str) -> list[int]:
    return list(_text_ids(text))


@functools.lru_cache(maxsize=256)
def _text_ids(text: str) -> tuple[int, ...]:
    """Remembered per text: each round of a conversation renders its whole history again, and the
    replica tokenizes on its event loop, where the time delays reading the other sessions' requests."""
    return tuple(_FIRST_TEXT_ID + zlib.crc32(word.encode()) for word in split_words(text))


def message_text(message: Mapping) -> str:
    """The text of one chat message: a string, or the text parts of an OpenAI content list."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise TemplateError("only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    raise TemplateError("message content must be a string or a list of text parts")


def render_chat(messages: Iterable[Mapping]) -> list[int]:
    """Token ids of a chat prompt: each message as <role> text <end>, then the assistant's <role>."""
    ids: list[int] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError("each message must be an object")
        role = message.get("role")
        if role not in _ROLE_IDS:
            raise TemplateError(f"unknown message role {role!r}")
        ids.append(_ROLE_IDS[role])
        ids.extend(tokenize(message_text(message)))
        ids.append(_END_OF_MESSAGE)
    ids.append(_ROLE_IDS["assistant"])
    return ids


def answer_words(prompt_ids: list[int], count: int) -> list[str]:
    """A deterministic answer of `count` tokens, seeded by the prompt (same prompt, same answer)."""
    rng = random.Random(zlib.crc32(repr(prompt_ids[-64:]).encode()) ^ len(prompt_ids))
    return [rng.choice(_ANSWER_WORDS) for _ in range(count)]
