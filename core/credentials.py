"""Reading a secret (an API key, the webhook token, the store's password) from the file or environment
variable that holds it: the one reader for the config's `*_file` keys and `--api-key-file`.

A secret file is a few dozen bytes. Whatever else the path names is refused at once, by a message that
names the file and never quotes it: a FIFO (which would block the reader until something writes), a
device (`/dev/zero` would be read until memory runs out) or a file too large to be one secret.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from kvwatch.core.errors import KVWatchError

MAX_SECRET_FILE_BYTES = 64 << 10
TOKEN_BYTES = 32


class CredentialError(KVWatchError, ValueError):
    """A secret cannot be read; the message names where it was looked for, never its content."""


def read_secret_file(path: str | os.PathLike, secret: str) -> str:
    """The one `secret` ("API key", "password", ...) the regular file at `path` holds, without the spaces
    around it (a file usually ends with a newline)."""
    source = f"{secret} file {path}"
    try:
        data = _read_regular_file(Path(path), MAX_SECRET_FILE_BYTES + 1)
    except OSError as error:
        raise CredentialError(f"cannot read {source}: {error.strerror}") from None
    if data is None:
        raise CredentialError(f"{source} is not a regular file (a FIFO, socket or device)")
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise CredentialError(f"{source} is larger than {MAX_SECRET_FILE_BYTES >> 10} KiB: not one {secret}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:  # its message would quote bytes of the secret
        raise CredentialError(f"{source} is not UTF-8 text") from None
    return one_secret(text, source, secret)


def one_secret(text: str, source: str, secret: str) -> str:
    """`text` stripped, when it is one secret: a space inside is two secrets, or a sentence pasted."""
    value = text.strip()
    if not value:
        raise CredentialError(f"{source} is empty")
    if any(c.isspace() for c in value):
        raise CredentialError(f"{source} must hold one {secret}, without spaces or line breaks")
    return value


def _read_regular_file(path: Path, limit: int) -> bytes | None:
    """At most `limit` bytes of the file; None when it is no regular file. Opened without blocking, so that
    a FIFO is refused rather than waited on, and checked before any byte is read."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with open(descriptor, "rb") as file:
        mode = os.fstat(descriptor).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        return file.read(limit) if stat.S_ISREG(mode) else None


def write_new_token(path: str | os.PathLike) -> None:
    """A fresh random bearer token in a file only its owner can read (an earlier file of the same name is
    narrowed too): what kvwatch's webhook requires and Alertmanager sends, both naming the file."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(secrets.token_urlsafe(TOKEN_BYTES) + "\n")
