"""Build the lab's tiny Llama for real vLLM: random weights, a local tokenizer, no download.

Run with the vLLM virtualenv's Python (it needs torch, transformers and tokenizers, which kvwatch's own
environment does not have): `python lab/tiny_model.py DIR`. The same version of this file always
builds the same files, so a cache keyed by its hash stays valid.

The model's answers are gibberish, but chosen so that the prefix cache sees what it sees with a real
model: its output head only ever picks whole words that start with a space, so an answer sent back in
the next round's history tokenizes to exactly the tokens the engine generated, and a pinned replica can
reuse the whole history. Tokens of the chat template are single special tokens, so a growing
conversation keeps its token prefix.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
import sys
from pathlib import Path

SEED = 7
VOCAB_SIZE = 8192
SPECIAL_TOKENS = [
    "<|end|>",
    "<|pad|>",
    *(f"<|{role}|>" for role in ("system", "user", "assistant", "tool", "developer")),
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS_SENTENCES = 40_000
_SYLLABLES = (
    "ba be bi bo bu ca ce co da de di do fa fe fi fo ga ge go ha he hi ho ka ke ki ko la le li lo lu "
    "ma me mi mo na ne ni no pa pe pi po ra re ri ro sa se si so ta te ti to va ve vi vo wa we wi ya"
).split()


WORKLOAD = Path(__file__).resolve().parent.parent / "collectors" / "probe" / "workload.py"


def fingerprint() -> str:
    """A short hash of what the build reads: the cache directory's name, so a change builds anew."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + WORKLOAD.read_bytes())
    return digest.hexdigest()[:12]


def _workload_words() -> list[str]:
    """The probe's own vocabulary (collectors/probe/workload.py), so each of its words is one token."""
    spec = importlib.util.spec_from_file_location("kvwatch_workload", WORKLOAD)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return list(module._WORDS)


def _corpus(rng: random.Random) -> list[str]:
    """English-like sentences: the workload's words, made-up words, digits and punctuation."""
    words = _workload_words()
    made_up = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(6000)]
    pool = words * 40 + made_up
    sentences = []
    for _ in range(CORPUS_SENTENCES):
        sentence = " ".join(rng.choice(pool) for _ in range(rng.randint(4, 16)))
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 99999)}"
        sentences.append(sentence.capitalize() + rng.choice([".", ".", ".", "?", "!", ","]))
    return sentences


def build_tokenizer(directory: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(random.Random(SEED)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|end|>",
        pad_token="<|pad|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def answer_token_ids(tokenizer) -> list[int]:
    """Tokens the model may say: a space and letters, so answers re-tokenize to the same ids."""
    allowed = []
    for token, token_id in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token])
        if len(text) > 2 and text[0] == " " and text[1:].isalpha() and text[1:].isascii():
            allowed.append(token_id)
    return sorted(allowed)


def build_model(directory: Path, tokenizer) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Every other token scores 0; allowed ones score h.w with |h| ~ sqrt(512): never outscored.
        head = torch.zeros_like(model.lm_head.weight)
        allowed = torch.tensor(answer_token_ids(tokenizer))
        head[allowed] = torch.randn(len(allowed), head.shape[1])
        model.lm_head.weight.copy_(head)
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)


def build(directory: Path) -> None:
    """Write the model and tokenizer to `directory`: built beside it, then renamed into place whole."""
    partial = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True)
    tokenizer = build_tokenizer(partial)
    build_model(partial, tokenizer)
    (partial / "kvwatch-model.json").write_text(json.dumps({"builder": fingerprint(), "seed": SEED}))
    try:
        partial.rename(directory)
    except OSError:  # another build finished first; its files are the same
        shutil.rmtree(partial)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python lab/tiny_model.py DIR")
    build(Path(sys.argv[1]))
