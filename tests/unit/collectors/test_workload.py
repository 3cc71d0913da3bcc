"""Probe workloads: seeded synthetic conversations sized in lab tokens, and the ShareGPT loader."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from kvwatch.collectors.probe import workload
from kvwatch.collectors.probe.workload import (
    DEFAULT_SYSTEM_PROMPT,
    Conversation,
    load_sharegpt,
    synthetic,
    system_prompt,
    user_turns,
)
from kvwatch.core.tokenizer import split_words
from paths import TESTDATA

SAMPLE = TESTDATA / "sharegpt-sample.json"


def test_synthetic_conversations_share_one_system_prompt_and_have_their_own_turns():
    conversations = synthetic(rounds=5, system_tokens=300, turn_tokens=40, seed=7, sessions=4)

    assert len(conversations) == 4
    assert len({c.system_prompt for c in conversations}) == 1
    assert len(split_words(conversations[0].system_prompt)) == 300
    assert all(len(c.user_turns) == 5 for c in conversations)
    assert all(len(split_words(turn)) == 40 for c in conversations for turn in c.user_turns)
    turns = [turn for c in conversations for turn in c.user_turns]
    assert len(set(turns)) == len(turns)


def test_synthetic_workloads_are_reproducible_by_seed():
    assert synthetic(3, 50, 10, seed=1, sessions=2) == synthetic(3, 50, 10, seed=1, sessions=2)
    other = synthetic(3, 50, 10, seed=2, sessions=2)
    assert other[0].system_prompt != synthetic(3, 50, 10, seed=1, sessions=2)[0].system_prompt


@pytest.mark.parametrize("tokens", [1, 2, 6, 7, 15, 100])
def test_texts_have_exactly_the_asked_lab_tokens(tokens):
    assert len(split_words(system_prompt(tokens, seed=0))) == tokens
    assert [len(split_words(t)) for t in user_turns(3, tokens, random.Random(0))] == [tokens] * 3


@pytest.mark.parametrize("name", ["rounds", "system_tokens", "turn_tokens", "sessions"])
def test_synthetic_rejects_non_positive_sizes(name):
    sizes = {"rounds": 2, "system_tokens": 10, "turn_tokens": 5, "seed": 0, "sessions": 1, name: 0}
    with pytest.raises(ValueError, match=f"^{name} must be positive, not 0$"):
        synthetic(**sizes)


def test_sharegpt_keeps_conversations_of_four_human_turns_or_more():
    conversations = load_sharegpt(SAMPLE)

    by_first_turn = {c.user_turns[0]: c for c in conversations}
    assert set(by_first_turn) == {"What is a KV cache?", "Name a prefix-caching engine.", "What is TTFT?"}
    assert by_first_turn["What is a KV cache?"] == Conversation(
        "You are a patient tutor for distributed systems.",
        (
            "What is a KV cache?",
            "Why does it help a multi-turn chat?",
            "What breaks it behind a load balancer?",
            "How does consistent hashing fix that?",
            "And what happens when a replica is added?",
        ),
    )
    # role/content keys; an empty turn is skipped; no system message gives the default one.
    assert by_first_turn["Name a prefix-caching engine."] == Conversation(
        DEFAULT_SYSTEM_PROMPT,
        (
            "Name a prefix-caching engine.",
            "Name another one.",
            "Which metric shows its hit rate?",
            "Thanks, that is all.",
        ),
    )
    assert by_first_turn["What is TTFT?"].system_prompt == "Answer in one sentence."
    assert len(by_first_turn["What is TTFT?"].user_turns) == 4


def test_sharegpt_min_rounds_limit_and_seed():
    assert len(load_sharegpt(SAMPLE, min_rounds=5)) == 1
    assert {c.user_turns[0] for c in load_sharegpt(SAMPLE, min_rounds=3)} >= {"Hello there."}
    assert len(load_sharegpt(SAMPLE, limit=2)) == 2
    orders = {tuple(c.user_turns[0] for c in load_sharegpt(SAMPLE, seed=seed)) for seed in range(10)}
    assert len(orders) > 1
    assert load_sharegpt(SAMPLE, seed=3) == load_sharegpt(SAMPLE, seed=3)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ("[{not json", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 3"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        ('{"conversations": []}', "expected a JSON list of conversations, found a JSON dict"),
        ("[]", "no usable conversation: none of its 0 entries has at least 4 human turns"),
    ],
    ids=["missing", "bad-json", "not-text", "not-a-list", "empty"],
)
def test_sharegpt_errors_name_the_file_and_the_problem(tmp_path, content, message):
    path = tmp_path / "data.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as raised:
        load_sharegpt(path)
    assert str(raised.value).startswith(f"{path}: {message}")


def test_a_sharegpt_file_over_the_limit_is_refused_unparsed(tmp_path, monkeypatch):
    monkeypatch.setattr(workload, "MAX_SHAREGPT_BYTES", 2 << 20)  # a small limit: the test stays fast
    conversation = {"conversations": [{"from": "human", "value": "word " * 100}] * 4}
    entries = (2 << 20) // len(json.dumps(conversation)) - 1
    text = json.dumps([conversation] * entries)
    at_the_limit, over = tmp_path / "at-the-limit.json", tmp_path / "over.json"
    at_the_limit.write_text(text + " " * ((2 << 20) - len(text)))
    over.write_text(text + " " * ((2 << 20) + 1 - len(text)))
    assert len(load_sharegpt(at_the_limit)) == entries
    with pytest.raises(ValueError) as raised:
        load_sharegpt(over)
    assert str(raised.value) == (
        f"{over}: larger than 2 MiB; a probe needs a few thousand conversations at most: "
        "keep a part of the file, e.g. with `jq '.[:2000]'`"
    )


def test_a_sharegpt_path_that_is_no_regular_file_is_refused_at_once(tmp_path):
    fifo = tmp_path / "conversations.json"
    os.mkfifo(fifo)  # no writer: reading it would wait forever
    started = time.monotonic()
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(ValueError, match=f"^{path}: not a regular file$"):
            load_sharegpt(path)
    assert time.monotonic() - started < 1


def test_sharegpt_nested_too_deeply_is_one_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"deep\.json: not valid JSON \(nested too deeply\)$"):
        load_sharegpt(deep)


def test_sharegpt_without_long_enough_conversations_says_so():
    with pytest.raises(ValueError, match="none of its 6 entries has at least 6 human turns$"):
        load_sharegpt(SAMPLE, min_rounds=6)
