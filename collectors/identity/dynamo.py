"""NVIDIA Dynamo's frontend: no header names the worker, but every streamed chunk carries
`nvext.worker_id` when the request asks for it (`nvext.extra_fields`). The id is an object
`{prefill_worker_id, prefill_dp_rank, decode_worker_id, decode_dp_rank}`: under prefill/decode
disaggregation the decode worker holds the conversation's KV cache afterwards, so it is the backend;
an aggregated worker may fill in only the prefill id."""

from __future__ import annotations

from kvwatch.collectors.identity.base import Convention, plain_name


def read(value: object) -> str | None:
    if isinstance(value, dict):
        return plain_name(value.get("decode_worker_id")) or plain_name(value.get("prefill_worker_id"))
    return plain_name(value)  # older frontends: a bare id


CONVENTION = Convention(
    name="dynamo",
    read=read,
    json_paths=("nvext.worker_id",),
    # "timing" adds the router's predicted kv_hit_rate to the last chunk.
    request_extras={"nvext": {"extra_fields": ["worker_id", "timing"]}},
)
