"""What the doctor finds: one Check per look at the route, a Diagnosis of them all, the causes they name."""

from __future__ import annotations

from dataclasses import asdict, dataclass

STATUSES = ("pass", "warn", "fail", "skipped")
CAUSES = (
    "connection_refused",
    "dns_error",
    "tls_mismatch",
    "tls_error",
    "protocol_error",
    "timeout",
    "not_openai_api",
    "bad_base_url",
    "unauthorized",
    "forbidden",
    "model_not_found",
    "bad_response",
    "session_id_not_propagated",
    "hash_key_not_session",
    "session_header_not_the_routes",  # sessions move with the header sent, stay with another of the family
    "dynamo_session_affinity_off",  # X-Dynamo-Session-ID sent, the frontend without its affinity TTL flag
    "prefix_cache_disabled",
    "dynamic_prompt_prefix",
    "cluster_not_found",
    # A SageMaker endpoint (doctor.sagemaker):
    "stateful_sessions_disabled",
    "aws_credentials",
    "model_stream_error",
    "sessions_expire_between_rounds",
    "session_reuse_lost",
    "sessions_not_opened",
    "session_header_stripped",
    "clock_skew",
    "prefix_aware_overflow",
)


@dataclass(frozen=True)
class Check:
    """One finding: what was looked at, what to do about it, and the cause it names when it fails."""

    name: str
    status: str  # pass | warn | fail | skipped
    evidence: str
    fix: str = ""
    cause: str | None = None  # one of CAUSES; set on failures

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}")
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError(f"unknown cause {self.cause!r}")


@dataclass(frozen=True)
class Diagnosis:
    """Every check in order, skipped ones included."""

    checks: tuple[Check, ...]

    @property
    def causes(self) -> list[str]:
        """The causes of the failed checks, in check order."""
        return list(dict.fromkeys(c.cause for c in self.checks if c.status == "fail" and c.cause))

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)

    def as_json(self) -> dict:
        return {"checks": [asdict(c) for c in self.checks], "causes": self.causes}
