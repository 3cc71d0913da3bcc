"""Keeping the API key and URL passwords out of everything kvwatch prints, stores and exports.

A server may echo the key it was sent, and rarely as it is: JSON-escaped in an error object,
URL-encoded in a redirect, upper-cased, or base64-encoded inside `Authorization: Basic ...`, a token or
a cookie. `redact` removes every such form, anything else that looks like a key, and the password of
any URL in the text.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from urllib.parse import quote

REDACTED = "[redacted]"
# A base64 piece of the key shorter than this could match ordinary text (the key itself is always redacted).
MIN_ENCODED_CHARS = 8
_KEY_LIKE = re.compile(r"(Bearer\s+)[\w.~+/=-]+|\bsk-[\w*.-]+", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(://[^/?#@\s:]*:)[^/?#\s]*@")  # scheme://user:password@host, to the last @


def redact(text: str, secret: str | None = None) -> str:
    """`text` without `secret` in any form a server may echo it in, key-like strings or URL passwords."""
    if secret:
        text = _forms_of(secret).sub(REDACTED, text)
    text = _KEY_LIKE.sub(lambda m: f"{m.group(1) or ''}{REDACTED}", text)
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)


def redacted_name(value: str | None, secret: str | None) -> str | None:
    """A name a server sent (a backend, a session id), or REDACTED when any of it is secret: it becomes a
    metric label and a stored value, where half a key is as bad as a whole one."""
    return REDACTED if value is not None and redact(value, secret) != value else value


@functools.lru_cache(maxsize=8)
def _forms_of(secret: str) -> re.Pattern:
    """One pattern, in any case, for the secret as it is, JSON-escaped, URL-encoded and in base64.

    Base64 of a longer text that contains the secret (`user:<key>`) encodes it differently at each of
    three byte offsets; the whole 6-bit groups of each are the part of it that any such text shows.
    """
    raw, escaped = secret.encode(), json.dumps(secret)[1:-1]
    forms = {secret, escaped, escaped.replace("/", "\\/"), quote(secret, safe=""), quote(secret)}
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        whole = encode(raw).decode()
        forms |= {whole, whole.rstrip("=")}
        for offset in range(3):
            # The characters made of the secret's bits alone, after `offset` bytes of something else.
            first, end = -(-8 * offset // 6), 8 * (offset + len(raw)) // 6
            if end - first >= MIN_ENCODED_CHARS:
                forms.add(encode(bytes(offset) + raw).decode()[first:end])
    # Longest first: a whole padded encoding goes before the piece of it that it contains.
    return re.compile("|".join(map(re.escape, sorted(forms, key=len, reverse=True))), re.IGNORECASE)
