"""The lab's tokenizer and chat template keep a growing conversation's prefix token for token."""

import pytest

from kvwatch.core.tokenizer import TemplateError, answer_words, render_chat, tokenize


def test_tokenize_is_deterministic_one_token_per_word_or_mark():
    assert tokenize("Hello, world!") == tokenize("Hello, world!")
    assert len(tokenize("Hello, world!")) == 4
    assert tokenize("a") != tokenize("b")


def test_growing_conversation_keeps_its_prefix():
    system = {"role": "system", "content": "You are terse."}
    round1 = [system, {"role": "user", "content": "What is a KV cache?"}]
    answer = " ".join(answer_words(render_chat(round1), 12))
    round2 = [*round1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    first, second = render_chat(round1), render_chat(round2)
    assert second[: len(first)] == first
    # The cached prompt + answer is a prefix of the next round's prompt.
    assert second[: len(first) + 12] == first + tokenize(answer)


def test_content_parts_are_joined():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert render_chat([{"role": "user", "content": parts}]) == render_chat(
        [{"role": "user", "content": "one\ntwo"}]
    )


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "wizard", "content": "x"}], "unknown message role 'wizard'"),
        ([{"role": "user", "content": 5}], "message content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content parts"),
        (["not an object"], "each message must be an object"),
    ],
)
def test_bad_messages_are_rejected_with_a_reason(messages, message):
    with pytest.raises(TemplateError, match=message):
        render_chat(messages)


def test_answers_are_reproducible_and_sized():
    prompt = render_chat([{"role": "user", "content": "hi"}])
    assert answer_words(prompt, 7) == answer_words(prompt, 7)
    assert len(tokenize(" ".join(answer_words(prompt, 7)))) == 7
