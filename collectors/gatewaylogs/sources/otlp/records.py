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
from collections.abc import Iterator, Mapping

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord

from kvwatch.collectors.gatewaylogs import envoy
from kvwatch.core.errors import KVWatchError

FieldTypes = Mapping[str, type | tuple[type, ...]]
# What Envoy renders for a command operator without a value (its DefaultUnspecifiedValueString).
UNSPECIFIED = "-"
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


def _typed(value: object, allowed: type | tuple[type, ...]) -> object:
    """A string as the type the format wants where it reads as one; any other value as it is."""
    if not isinstance(value, str):
        return value
    kinds = allowed if isinstance(allowed, tuple) else (allowed,)
    if value == UNSPECIFIED and type(None) in kinds:
        return None
    if int in kinds:
        try:
            return int(value)
        except ValueError:
            pass
    if float in kinds:
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    return value


def access_log_record(
    log_record: LogRecord, fields: FieldTypes, optional: FieldTypes = envoy.OPTIONAL_FIELDS
) -> dict[str, object]:
    """The format's fields of one LogRecord, and those of its `optional` ones it has: the attributes',
    else the body's; raises MissingFields."""
    wanted = {**optional, **fields}
    found = dict(_body_fields(log_record.body))
    found.update((pair.key, plain_value(pair.value)) for pair in log_record.attributes if pair.key in wanted)
    if not fields.keys() <= found.keys():
        raise MissingFields(sorted(fields.keys() - found.keys()))
    return {name: _typed(found[name], allowed) for name, allowed in wanted.items() if name in found}


def log_records(request: ExportLogsServiceRequest) -> Iterator[LogRecord]:
    for resource_logs in request.resource_logs:
        for scope_logs in resource_logs.scope_logs:
            yield from scope_logs.log_records


def count_records(request: ExportLogsServiceRequest) -> int:
    return sum(len(scope.log_records) for resource in request.resource_logs for scope in resource.scope_logs)
