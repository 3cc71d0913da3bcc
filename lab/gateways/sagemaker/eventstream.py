"""The AWS event-stream encoding of InvokeEndpointWithResponseStream's answer, which botocore decodes
(`botocore.eventstream`) but has no encoder for.

A message: total length (u32), headers length (u32), CRC32 of those 8 bytes, headers, payload, CRC32 of
everything before it; big-endian, CRC32 IEEE. A header: name length (u8), name, value type (7: string),
value length (u16), value.
"""

from __future__ import annotations

import json
import struct
import zlib

STRING_HEADER = 7
PRELUDE = struct.Struct(">II")


def _header(name: str, value: str) -> bytes:
    name_bytes, value_bytes = name.encode(), value.encode()
    return (
        struct.pack(">B", len(name_bytes))
        + name_bytes
        + struct.pack(">BH", STRING_HEADER, len(value_bytes))
        + value_bytes
    )


def encode_message(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream message with string headers, checksums included."""
    encoded_headers = b"".join(_header(name, value) for name, value in headers.items())
    total = PRELUDE.size + 4 + len(encoded_headers) + len(payload) + 4
    prelude = PRELUDE.pack(total, len(encoded_headers))
    prelude += struct.pack(">I", zlib.crc32(prelude))
    message = prelude + encoded_headers + payload
    return message + struct.pack(">I", zlib.crc32(message))


def encode_event(event_type: str, payload: bytes, content_type: str = "application/octet-stream") -> bytes:
    """An event of the response stream, e.g. `encode_event("PayloadPart", b"data: ...")`."""
    headers = {":event-type": event_type, ":content-type": content_type, ":message-type": "event"}
    return encode_message(headers, payload)


def payload_part(data: bytes) -> bytes:
    """A `PayloadPart` event carrying `data` as its `Bytes`."""
    return encode_event("PayloadPart", data)


def encode_exception(exception_type: str, message: str, error_code: str | None = None) -> bytes:
    """An exception event (`ModelStreamError` with its `ErrorCode`, `InternalStreamFailure`): botocore
    raises EventStreamError with `exception_type` as the error's code."""
    body = {"Message": message} | ({"ErrorCode": error_code} if error_code else {})
    headers = {
        ":exception-type": exception_type,
        ":content-type": "application/json",
        ":message-type": "exception",
    }
    return encode_message(headers, json.dumps(body).encode())
