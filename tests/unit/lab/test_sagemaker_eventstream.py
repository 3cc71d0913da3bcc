"""The lab's event-stream encoder, decoded by botocore's own decoder and parsed with the SageMaker runtime's
service model, as the AWS SDK parses a real InvokeEndpointWithResponseStream answer."""

from __future__ import annotations

import io

import botocore.session
import pytest
from botocore.eventstream import ChecksumMismatch, EventStream, EventStreamBuffer
from botocore.exceptions import EventStreamError
from botocore.parsers import EventStreamJSONParser

from kvwatch.lab.gateways.sagemaker.eventstream import encode_event, encode_exception, payload_part


class _Raw:
    """The body as urllib3 hands it to botocore: chunks of any size."""

    def __init__(self, data: bytes, chunk: int):
        self._data = io.BytesIO(data)
        self._chunk = chunk

    def stream(self):
        while block := self._data.read(self._chunk):
            yield block


def event_stream(data: bytes, chunk: int = 7) -> EventStream:
    """The stream of events botocore's client yields for this body."""
    model = botocore.session.get_session().get_service_model("sagemaker-runtime")
    operation = model.operation_model("InvokeEndpointWithResponseStream")
    shape = operation.output_shape.members["Body"]
    return EventStream(_Raw(data, chunk), shape, EventStreamJSONParser(), operation.name)


def events(data: bytes, chunk: int = 7) -> list[dict]:
    return list(event_stream(data, chunk))


def test_payload_parts_decode_to_their_bytes_in_order_whatever_the_chunking():
    body = payload_part(b'data: {"a": 1}\n\n') + payload_part(b"data: [DO") + payload_part(b"NE]\n\n")
    for chunk in (1, 7, len(body)):
        assert [e["PayloadPart"]["Bytes"] for e in events(body, chunk)] == [
            b'data: {"a": 1}\n\n',
            b"data: [DO",
            b"NE]\n\n",
        ]


def test_the_headers_are_those_of_an_event_of_the_stream():
    buffer = EventStreamBuffer()
    buffer.add_data(encode_event("PayloadPart", b"x"))
    (message,) = list(buffer)
    assert message.headers == {
        ":event-type": "PayloadPart",
        ":content-type": "application/octet-stream",
        ":message-type": "event",
    }
    assert message.payload == b"x"


@pytest.mark.parametrize("flipped", [9, -2], ids=["prelude", "message"])
def test_botocore_checks_both_checksums(flipped):
    frame = bytearray(payload_part(b"some payload"))
    frame[flipped] ^= 0xFF
    buffer = EventStreamBuffer()
    buffer.add_data(bytes(frame))
    with pytest.raises(ChecksumMismatch):
        list(buffer)


def test_a_model_stream_error_after_parts_raises_with_its_code():
    body = payload_part(b"data: first\n\n") + encode_exception("ModelStreamError", "reset", "StreamBroken")
    received = []
    with pytest.raises(EventStreamError) as raised:
        for event in event_stream(body):
            received.append(event)
    assert received == [{"PayloadPart": {"Bytes": b"data: first\n\n"}}]
    assert raised.value.response["Error"] == {"Code": "ModelStreamError", "Message": "reset"}


def test_an_internal_stream_failure_raises_as_such():
    with pytest.raises(EventStreamError) as raised:
        events(encode_exception("InternalStreamFailure", "try again"))
    assert raised.value.response["Error"]["Code"] == "InternalStreamFailure"
