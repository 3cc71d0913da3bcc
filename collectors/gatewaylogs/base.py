"""What every access-log format shares: the request one line stands for, and why a line stands for none."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import orjson

from kvwatch.collectors import sessionkeys
from kvwatch.core.errors import KVWatchError

MALFORMED_REASONS = ("invalid_json", "missing_field", "wrong_type", "bad_value", "too_long")
# The upstream of a request no server answered: the gateway did not proxy it, or found no live server.
NO_UPSTREAM = "none"


class Malformed(KVWatchError, ValueError):
    """A line that is no request; `reason` is one of MALFORMED_REASONS, so that it can be a label."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Request(NamedTuple):
    """One logged request, in the terms the follower counts whatever the gateway."""

    time: float  # Unix time the request ended
    listener: str
    upstream: str  # the last server tried, or NO_UPSTREAM
    failover: bool  # the gateway tried more than one server, or says the server failed
    status: int
    session_id: str
    assigned: bool  # the client sent no session key: the id is one the gateway made
    path: str | None = None  # the request's path without its query; None: the log does not say
    # Seconds from the gateway sending the request upstream to the first byte of the answer (nginx: its
    # headers; Envoy: its body, the first token of a stream); None: the log does not say.
    first_byte_seconds: float | None = None


FieldTypes = Mapping[str, type | tuple[type, ...]]


@dataclass(frozen=True)
class LogFormat:
    """One gateway's access-log format: the fields a decoded JSON line must have, and how a line that has
    them becomes a request.

    `parse` raises Malformed with the reason a line is no request.
    """

    name: str
    fields: FieldTypes
    # A line's request, given its checked fields and, from `keyed`, the client's session id a session
    # key's header carried (None: none did), which stands before the format's own session field.
    read: Callable[..., Request]
    check: Callable[[Mapping[str, object]], None] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "check", field_check(self.fields))

    def parse(self, record: Mapping[str, object]) -> Request:
        self.check(record)
        return self.read(record)

    def keyed(self, fields: tuple[str, ...]) -> LogFormat:
        """The format taking a line's session id from the first of `fields` (session_fields: the
        session-key headers the gateway logs) that the line carries, the client's; a line with none of
        them reads as before. The fields are resolved here, once: a line pays one lookup per field."""
        if not fields:
            return self
        read = self.read

        def read_keyed(record: Mapping[str, object]) -> Request:
            for field in fields:
                value = record.get(field)
                if value is not None and value != "" and value != "-":
                    if value.__class__ is not str:
                        raise Malformed("wrong_type")
                    return read(record, value)
            return read(record, None)

        return dataclasses.replace(self, read=read_keyed)


def session_fields(keys: Iterable[str]) -> tuple[str, ...]:
    """The fields in which a line carries the session headers of the session-key conventions `keys`
    (collectors.sessionkeys), each once and in the keys' order: the header's name in lower case,
    `x-dynamo-session-id`, whatever the gateway (docs/gateway-logs.md). ValueError names the known keys
    for an unknown one."""
    headers = (sessionkeys.SESSION_KEYS.lookup(key).header for key in keys)
    return tuple(dict.fromkeys(header.lower() for header in headers))


def json_object(line: bytes) -> Mapping[str, object]:
    """One log line decoded; every format writes one JSON object per line.

    orjson decodes it six times faster than json, the hot path of a busy gateway's log. Where orjson
    refuses a line (NaN, a lone surrogate, a BOM, UTF-16, nesting past 1,024) or may have read an integer
    past 64 bits as a float, json decides as it always has, so that every line reads as json reads it.
    """
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return _json_object(line)
    if not isinstance(record, dict):
        raise Malformed("invalid_json")
    for value in record.values():
        if value.__class__ is float and not -_INTEGER_LIMIT < value < _INTEGER_LIMIT:
            return _json_object(line)
    return record


# orjson reads an integer within 64 bits as int, a longer one as float, as json reads no integer; a float
# within this bound is exact either way. Formats read only a record's top-level values.
_INTEGER_LIMIT = float(2**63)


def _json_object(line: bytes) -> Mapping[str, object]:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        raise Malformed("invalid_json") from None
    if not isinstance(record, dict):
        raise Malformed("invalid_json")
    return record


def check_fields(record: Mapping[str, object], types: FieldTypes) -> None:
    """Every field present with one of its types; JSON's true and false are never numbers."""
    for field, allowed in types.items():
        if field not in record:
            raise Malformed("missing_field")
        if isinstance(record[field], bool) or not isinstance(record[field], allowed):
            raise Malformed("wrong_type")


def field_check(types: Mapping[str, type | tuple[type, ...]]) -> Callable[[Mapping[str, object]], None]:
    """`check_fields` for one format's fields, quicker for a line that passes: a decoded JSON value is of
    its type exactly, and no format's types include bool. A line that fails is checked by `check_fields`,
    which says why."""
    exact = tuple(
        (field, frozenset(allowed if isinstance(allowed, tuple) else (allowed,)))
        for field, allowed in types.items()
    )
    if any(bool in kinds for _, kinds in exact):
        raise ValueError("field_check: bool is never a field's type")

    def check(record: Mapping[str, object]) -> None:
        try:
            for field, kinds in exact:
                if record[field].__class__ not in kinds:
                    break
            else:
                return
        except KeyError:
            pass
        check_fields(record, types)

    return check


def request(
    time: float,
    listener: str,
    upstream: str,
    failover: bool,
    status: int,
    session_id: str,
    assigned: bool,
    path: str | None = None,
    first_byte_seconds: float | None = None,
) -> Request:
    """The request of a checked line (arguments in Request's order), refused when it has no session id, an
    impossible status, or a time that is no time (JSON's NaN or Infinity, which Python reads)."""
    if not session_id or not 100 <= status <= 599 or not math.isfinite(time):
        raise Malformed("bad_value")
    if first_byte_seconds is not None and not 0 <= first_byte_seconds < math.inf:
        raise Malformed("bad_value")
    # Listener and upstream names repeat on every line: interned, all tracked sessions share one copy.
    # tuple.__new__ builds the tuple in one C call, NamedTuple's own __new__ in a Python one.
    return _new_tuple(
        Request,
        (
            time,
            sys.intern(listener),
            sys.intern(upstream),
            failover,
            status,
            session_id,
            assigned,
            path,
            first_byte_seconds,
        ),
    )


_new_tuple = tuple.__new__


def path_of(target: object) -> str | None:
    """The path of a logged request target (`/v1/models?x=1`), or of a request line (`GET /v1/models`);
    None when the log has none."""
    if not isinstance(target, str) or not target:
        return None
    return target.split(" ", 1)[-1].partition("?")[0]


def optional_number(record: Mapping[str, object], field: str) -> float | None:
    """An optional numeric field: None when absent, null, "-" or "" (a value the gateway did not have)."""
    value = record.get(field)
    if value is None or value in ("-", ""):
        return None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise Malformed("wrong_type") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Malformed("wrong_type")
    return float(value)
