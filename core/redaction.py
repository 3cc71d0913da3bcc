"""Keeping the API key and URL secrets out of everything kvwatch prints, stores and exports.

A server may echo the key it was sent, and rarely as it is: without its `sk-` prefix, JSON-escaped (up
to every character as `\\u0073`) in an error object, as HTML entities, URL-encoded in a redirect,
upper-cased, in hex, base32 or base64 inside `Authorization: Basic ...`, a token or a cookie, even split
by zero-width characters. `redact` removes every such form, anything else that looks like a key, and the
password and secret query parameters of any URL in the text.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import re
from urllib.parse import quote

REDACTED = "[redacted]"
# A base64 piece of the key shorter than this could match ordinary text (the key itself is always redacted).
MIN_ENCODED_CHARS = 8
# What is left of a key after a prefix (`sk-`, `sk-proj-`) is redacted on its own from this length on:
# shorter, it could be a word of ordinary text.
MIN_CORE_CHARS = 16
_PREFIX_PART = re.compile(r"[A-Za-z0-9]{1,12}[-_]")  # `sk-`, `proj-`, `or-`, `v1-`, `gsk_`
_INVISIBLE = "[\u00ad\u200b-\u200d\u2060\ufeff]*"  # soft hyphen, zero-width spaces and joiners, BOM
# Base64 (standard and URL-safe) and base32, each with its group: so many bytes as so many characters.
_ENCODINGS = ((base64.b64encode, 3, 4), (base64.urlsafe_b64encode, 3, 4), (base64.b32encode, 5, 8))
_KEY_LIKE = re.compile(r"(Bearer\s+)[\w.~+/=-]+|\bsk-[\w*.-]+", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(://[^/?#@\s:]*:)[^/?#\s]*@")  # scheme://user:password@host, to the last @
# A query parameter whose name says it holds a secret (`?password=`, `&access_token=`, `&sslpassword=`,
# `&X-Amz-Signature=`, `&api_key=`), up to its end; `key` only as a word of the name: `sslkey` is a path.
_SECRET_PARAMETER = re.compile(
    r"([?&;](?:[\w.-]*(?:password|passwd|secret|token|signature)|(?:[\w.-]*[_.-])?"
    r"(?:key|apikey|sig|pwd|pass|auth|authorization|credentials?))=)[^&#;\s\"'<>]*",
    re.IGNORECASE,
)


def redact(text: str, secret: str | None = None) -> str:
    """`text` without `secret` in any form a server may echo it in, key-like strings or URL secrets."""
    if secret:
        text = _forms_of(secret).sub(REDACTED, text)
    text = _KEY_LIKE.sub(lambda m: f"{m.group(1) or ''}{REDACTED}", text)
    text = _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)
    return _SECRET_PARAMETER.sub(lambda m: f"{m.group(1)}{REDACTED}", text)


def redacted_name(value: str | None, secret: str | None) -> str | None:
    """A name a server sent (a backend, a session id), or REDACTED when any of it is secret: it becomes a
    metric label and a stored value, where half a key is as bad as a whole one."""
    return REDACTED if value is not None and redact(value, secret) != value else value


@functools.lru_cache(maxsize=8)
def _forms_of(secret: str) -> re.Pattern:
    """One pattern, in any case, for the secret and its core (`_cores`), each as it is, escaped
    character by character (JSON, HTML) with or without zero-width characters between them,
    URL-encoded, in hex, base32 and base64, whole or inside the encoding of a longer text."""
    cores = _cores(secret)
    forms = {form for core in cores for form in _encoded(core)}
    # Longest first: a whole padded encoding goes before the piece of it that it contains.
    literal = map(re.escape, sorted(forms, key=len, reverse=True))
    return re.compile("|".join([*map(_spelled, cores), *literal]), re.IGNORECASE)


def _cores(secret: str) -> list[str]:
    """The secret, then what is left after each part of its prefix (`sk-proj-abc...`: `proj-abc...`,
    `abc...`) while that is long enough to be no ordinary word: a server may echo the key without it."""
    cores = [secret]
    while (prefix := _PREFIX_PART.match(cores[-1])) and len(cores[-1]) - prefix.end() >= MIN_CORE_CHARS:
        cores.append(cores[-1][prefix.end() :])
    return cores


def _spelled(secret: str) -> str:
    """A pattern for `secret` with any of its characters escaped, as JSON (`\\u0073`, `\\/`) or HTML
    (`&#115;`, `&#x73;`, `&quot;`) escapes them, and zero-width characters between any two."""
    return _INVISIBLE.join(map(_character, secret))


def _character(c: str) -> str:
    code = ord(c)
    escapes = [c, json.dumps(c)[1:-1], "\\/" if c == "/" else c, html.escape(c)]
    numeric = [rf"\\u{code:04x}", f"&#0*{code};", f"&#x0*{code:x};"]
    return "(?:" + "|".join([*dict.fromkeys(map(re.escape, escapes)), *numeric]) + ")"


def _encoded(secret: str) -> set[str]:
    """`secret` URL-encoded, in hex, base32 and base64; and for base32 and base64 also the characters
    that encode its bits alone when a longer text contains it (`user:<key>` in HTTP Basic): each
    alphabet has a different such piece for each offset of the secret in a group of bytes."""
    raw, escaped = secret.encode(), json.dumps(secret)[1:-1]
    forms = {escaped, quote(secret, safe=""), quote(secret), raw.hex()}
    for encode, group_bytes, group_chars in _ENCODINGS:
        bits = 8 * group_bytes // group_chars
        whole = encode(raw).decode()
        forms |= {whole, whole.rstrip("=")}
        for offset in range(group_bytes):
            # The characters made of the secret's bits alone, after `offset` bytes of something else.
            first, end = -(-8 * offset // bits), 8 * (offset + len(raw)) // bits
            if end - first >= MIN_ENCODED_CHARS:
                forms.add(encode(bytes(offset) + raw).decode()[first:end])
    return forms
