"""llm-d's session scorer with the `encoded_endpoint_header` strategy: `x-session-token`, base64 of
"namespace/pod", echoed so the client sends it back. Its `session_id` strategy echoes nothing: then no
response names the replica, and stickiness comes from the cached tokens."""

from __future__ import annotations

import base64
import binascii

from kvwatch.collectors.identity.base import Convention, plain_name


def read(value: object) -> str | None:
    """The pod of a token; a value that is no such token is used as it is."""
    token = plain_name(value)
    if token is None:
        return None
    try:
        namespace, _, pod = base64.b64decode(token, validate=True).decode().rpartition("/")
    except (binascii.Error, UnicodeDecodeError):
        return token
    return pod if namespace and pod else token


CONVENTION = Convention(name="llm-d", read=read, headers=("x-session-token",))
