"""Gateway logs with session keys: a log configured with session-key conventions (collectors.sessionkeys)
takes a line's session id from the first of their headers the line carries, in every format and source,
and the config refuses an unknown key as every family does."""

from __future__ import annotations

import json
import re

import grpc
import pytest
from test_gatewaylogs import ENVOY_LINE, INGRESS_NGINX_LINE, NGINX_LINE, REQUEST_ID
from test_otlp_source import envoy_record, export_request
from test_sessionkeys import refused_as_unknown

from kvwatch.collectors import sessionkeys
from kvwatch.collectors.gatewaylogs import LOG_FORMATS, Malformed, json_object, session_fields
from kvwatch.collectors.gatewaylogs.sources import open_log
from kvwatch.collectors.gatewaylogs.sources.otlp.transports import EXPORT_METHOD
from kvwatch.collectors.gatewaylogs.tally import SessionTally, SourceState
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import GatewayLog, load_config
from paths import REPO
from processes import free_port

LINES = {"nginx": NGINX_LINE, "ingress-nginx": INGRESS_NGINX_LINE, "envoy": ENVOY_LINE}
# What each format reads when the line carries none of the keys' headers: its own field, the gateway's id.
ASSIGNED = {
    "nginx": {"session_id": "req-9", "session_source": "assigned"},
    "ingress-nginx": {"session_id": ""},
    "envoy": {"session_id": None},
}


def line(format_name: str, **fields: object) -> bytes:
    """The format's line, its session the gateway's own, with `fields` added (a header's, named as logged)."""
    record = {**json.loads(LINES[format_name]), **ASSIGNED[format_name], **fields}
    return json.dumps(record).encode()


def read(format_name: str, keys: tuple[str, ...], raw: bytes) -> tuple[str, bool]:
    request = LOG_FORMATS[format_name].keyed(session_fields(keys)).parse(json_object(raw))
    return request.session_id, request.assigned


def test_a_keys_header_is_logged_in_a_field_named_after_it_once_whatever_its_case():
    assert session_fields(("dynamo", "litellm")) == ("x-dynamo-session-id", "x-litellm-session-id")
    assert session_fields(("kvwatch", "olla", "llm-d")) == ("x-session-id",)  # one header, three keys
    assert session_fields(()) == ()
    with pytest.raises(ValueError, match='unknown session key "dynamoo"; did you mean "dynamo"?'):
        session_fields(("dynamoo",))


@pytest.mark.parametrize("format_name", sorted(LINES))
def test_the_first_of_the_keys_headers_a_line_carries_is_the_clients_session(format_name):
    dynamo_and_litellm = ("dynamo", "litellm")
    both = line(format_name, **{"x-dynamo-session-id": "d-1", "x-litellm-session-id": "l-1"})
    assert read(format_name, dynamo_and_litellm, both) == ("d-1", False)
    assert read(format_name, ("litellm", "dynamo"), both) == ("l-1", False)  # the keys' order
    only_litellm = line(format_name, **{"x-dynamo-session-id": "", "x-litellm-session-id": "l-1"})
    assert read(format_name, dynamo_and_litellm, only_litellm) == ("l-1", False)
    # None of them, as nginx logs an absent header ("" or "-") and Envoy (null): the format's own reading.
    for absent in ("", "-", None):
        gateways = line(format_name, **{"x-dynamo-session-id": absent})
        assert read(format_name, dynamo_and_litellm, gateways)[1] is True
    assert read(format_name, dynamo_and_litellm, line(format_name))[1] is True  # fields not logged at all
    # A log without session keys reads no header field.
    assert LOG_FORMATS[format_name].parse(json_object(both)).assigned is True


def test_a_keys_field_that_is_no_text_is_malformed():
    with pytest.raises(Malformed) as malformed:
        read("nginx", ("dynamo",), line("nginx", **{"x-dynamo-session-id": 42}))
    assert malformed.value.reason == "wrong_type"


def test_an_envoy_session_header_holding_the_request_id_is_still_the_gateways():
    """As with X-Session-Id: a route that adds the header with the request's id when absent."""
    raw = line("envoy", **{"x-dynamo-session-id": REQUEST_ID})
    assert read("envoy", ("dynamo",), raw) == (REQUEST_ID, True)


def test_a_tally_with_session_keys_counts_a_keyed_request_as_a_clients():
    def without_key(keys: tuple[str, ...]) -> int:
        tally = SessionTally("gw", log_format="nginx", session_keys=keys, clock=lambda: 1764595300.0)
        tally.take_line(line("nginx", **{"x-smg-routing-key": "s-1"}), 1764595300.0)
        return sum(tally.snapshot(SourceState()).without_session_key.values())

    assert (without_key(()), without_key(("smg",))) == (1, 0)


def gateway_log_yaml(tmp_path, keys: str) -> str:
    path = tmp_path / "kvwatch.yaml"
    path.write_text(
        f"gateway_logs:\n  - name: gw\n    path: {tmp_path / 'access.jsonl'}\n    session_keys: {keys}\n"
        f"store:\n  path: {tmp_path / 'kvwatch.db'}\n"
    )
    return path


def test_the_config_takes_one_key_or_a_list_and_refuses_an_unknown_one(tmp_path):
    (log,) = load_config(gateway_log_yaml(tmp_path, "dynamo")).gateway_logs
    assert log.session_keys == ("dynamo",)
    (log,) = load_config(gateway_log_yaml(tmp_path, "[dynamo, litellm]")).gateway_logs
    assert log.session_keys == ("dynamo", "litellm")
    refused_as_unknown(gateway_log_yaml(tmp_path, "[litellm, dynamoo]"), "gateway_logs[0].session_keys[1]")
    with pytest.raises(ConfigError, match="session_keys: expected a name or a list of names"):
        load_config(gateway_log_yaml(tmp_path, "{dynamo: 1}"))


def test_an_otlp_gateway_log_with_session_keys_reads_their_attributes():
    def without_key(keys: tuple[str, ...]) -> int:
        section = GatewayLog(
            name="gw", format="envoy", source="otlp", listen=str(free_port()), session_keys=keys
        )
        log = open_log(section)
        log.start()
        try:
            with grpc.insecure_channel(section.listen) as channel:
                record = envoy_record(**{"x-dynamo-session-id": "d-1"})
                channel.unary_unary(EXPORT_METHOD)(export_request(record).SerializeToString())
            snapshot = log.poll()
        finally:
            log.close()
        assert sum(snapshot.requests.values()) == 1
        return sum(snapshot.without_session_key.values())

    assert (without_key(()), without_key(("dynamo",))) == (1, 0)


def test_the_docs_give_every_keys_field_for_nginx_and_envoy():
    """docs/gateway-logs.md's lines to copy name each header's field as kvwatch reads it."""
    page = (REPO / "docs" / "gateway-logs.md").read_text()
    for key in sessionkeys.SESSION_KEYS.values():
        (field,) = session_fields((key.name,))
        variable = "$http_" + re.sub(r"[^a-z0-9]", "_", field)
        assert f'"{field}":"{variable}"' in page, field  # nginx's and ingress-nginx's log format
        assert f'"{field}": "%REQ({field.upper()})%"' in page, field  # Envoy's json_format
