"""OTLP log records as access-log records: the fields a log format parses, taken from a LogRecord's
attributes or body, in the types the gateway's own JSON file log writes.

Envoy's OpenTelemetry access logger renders every command operator as a string attribute (or a string
in a kvlist body), with "-" for a value it does not have; its JSON file log writes the same values as
numbers, and null for one it does not have. Coerced by the format's field types, a record from OTLP
equals the line the file log wrote for the same request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord

from kvwatch.collectors.gatewaylogs import envoy
from kvwatch.core.errors import KVWatchError

FieldTypes = Mapping[str, type | tuple[type, ...]]
# What Envoy renders for a command operator without a value (its DefaultUnspecifiedValueString).
UNSPECIFIED = "-"
_TEXT_OR_NULL = (str, type(None))
# An AnyValue nests kvlists and arrays; a sender's nesting deeper than this is no access log.
MAX_DEPTH = 8


class MissingFields(KVWatchError, ValueError):
    """A log record without one of the fields the format needs."""


def plain_value(value: AnyValue, depth: int = 0) -> object:
    """An AnyValue as the JSON value it stands for: kvlists as dicts, arrays as lists."""
    kind = value.WhichOneof("value")
    if kind == "kvlist_value":
        return _plain_kvlist(value.kvlist_value.values, depth + 1)
    if kind == "array_value":
        return (
            [plain_value(item, depth + 1) for item in value.array_value.values] if depth < MAX_DEPTH else None
        )
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind) if kind else None


def _plain_kvlist(pairs, depth: int) -> dict[str, object] | None:
    if depth > MAX_DEPTH:
        return None
    return {pair.key: plain_value(pair.value, depth) for pair in pairs}


def _body_fields(body: AnyValue) -> Mapping[str, object]:
    """The fields a body carries: a kvlist's, or a JSON object string's; other bodies carry none."""
    kind = body.WhichOneof("value")
    if kind == "kvlist_value":
        return _plain_kvlist(body.kvlist_value.values, 1) or {}
    if kind == "string_value" and body.string_value.lstrip().startswith("{"):
        try:
            decoded = json.loads(body.string_value)
        except (ValueError, RecursionError):
            return {}
        return decoded if isinstance(decoded, dict) else {}
    return {}


def _converter(allowed: type | tuple[type, ...]) -> Callable[[object], object] | None:
    """How a field's value becomes the type the format wants: a string as that type where it reads as
    one, any other value as it is. None for a field that takes a string as it is."""
    kinds = allowed if isinstance(allowed, tuple) else (allowed,)
    optional, integer, number = type(None) in kinds, int in kinds, float in kinds
    if not (optional or integer or number):
        return None

    def typed(value: object) -> object:
        if not isinstance(value, str):
            return value
        if optional and value == UNSPECIFIED:
            return None
        if integer:
            try:
                return int(value)
            except ValueError:
                pass
        if number:
            try:
                parsed = float(value)
            except ValueError:
                return value
            return parsed if math.isfinite(parsed) else value
        return value

    return typed


class AccessLogRecords:
    """The format's fields of LogRecords, and those of its `optional` ones a record has, each field's
    conversion chosen once for all records."""

    def __init__(self, fields: FieldTypes, optional: FieldTypes = envoy.OPTIONAL_FIELDS) -> None:
        self.fields = fields
        self._wanted = {**optional, **fields}
        # A text field that may be null needs no call: "-" is its null. The others' converters are called.
        self._text_or_null = tuple(name for name, allowed in self._wanted.items() if allowed == _TEXT_OR_NULL)
        converters = {name: _converter(allowed) for name, allowed in self._wanted.items()}
        self._typed = [
            (name, typed)
            for name, typed in converters.items()
            if typed is not None and name not in self._text_or_null
        ]

    def __call__(self, log_record: LogRecord) -> dict[str, object]:
        """The wanted fields of one LogRecord: the attributes', else the body's; raises MissingFields."""
        wanted = self._wanted
        found = self._body_fields(log_record) if log_record.HasField("body") else {}
        for pair in log_record.attributes:
            key = pair.key
            if key in wanted:
                value = pair.value
                # Envoy sends every attribute as a string: read as plain_value reads it, in one call.
                text = value.string_value
                if text or value.WhichOneof("value") == "string_value":
                    found[key] = text
                else:
                    found[key] = plain_value(value)
        if not self.fields.keys() <= found.keys():
            raise MissingFields(sorted(self.fields.keys() - found.keys()))
        for name in self._text_or_null:
            if found.get(name) == UNSPECIFIED:
                found[name] = None
        for name, typed in self._typed:
            if name in found:
                found[name] = typed(found[name])
        return found

    def _body_fields(self, log_record: LogRecord) -> dict[str, object]:
        return {name: value for name, value in _body_fields(log_record.body).items() if name in self._wanted}


def log_records(request: ExportLogsServiceRequest) -> Iterator[LogRecord]:
    for resource_logs in request.resource_logs:
        for scope_logs in resource_logs.scope_logs:
            yield from scope_logs.log_records


def count_records(request: ExportLogsServiceRequest) -> int:
    return sum(len(scope.log_records) for resource in request.resource_logs for scope in resource.scope_logs)
