"""What the lab's SageMaker front checks and keeps of a request: the SigV4 header (its form and date,
never the signature), the session id, and the headers the runtime API defines (all others stripped)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime

from kvwatch.lab.gateways.sagemaker import errors
from kvwatch.lab.sessions import NEW_SESSION, SESSION_HEADER

ALGORITHM = "AWS4-HMAC-SHA256"
SERVICE = "sagemaker"
MAX_SKEW_S = 300  # AWS refuses a signature dated more than 5 minutes from its clock
AMZ_DATE = "%Y%m%dT%H%M%SZ"
# The API's request headers the container sees, by operation (botocore's InvokeEndpointInput and
# InvokeEndpointWithResponseStreamInput); the stream's Accept travels as X-Amzn-SageMaker-Accept.
PASSED = ("Content-Type", "X-Amzn-SageMaker-Custom-Attributes", "X-Amzn-SageMaker-Target-Model",
          "X-Amzn-SageMaker-Inference-Id", "X-Amzn-SageMaker-Target-Container-Hostname")  # fmt: skip
ACCEPT = {False: "Accept", True: "X-Amzn-SageMaker-Accept"}
_SESSION_ID = re.compile(errors.SESSION_ID_PATTERN)
_PARAMETER = re.compile(r"(Credential|SignedHeaders|Signature)=([^,\s]+)")


def check_signature(headers: Mapping[str, str], now: float) -> str:
    """The region the request was signed for; raises the AwsError AWS answers for a missing, incomplete,
    mis-scoped or stale SigV4 signature."""
    authorization = headers.get("Authorization")
    if not authorization:
        raise errors.missing_token()
    algorithm, _, rest = authorization.partition(" ")
    parameters = dict(_PARAMETER.findall(rest)) if algorithm == ALGORITHM else {}
    missing = [
        f"Authorization header requires '{name}' parameter."
        for name in ("Credential", "Signature", "SignedHeaders")
        if name not in parameters
    ]
    if "X-Amz-Date" not in headers and "Date" not in headers:
        missing.append("Authorization header requires existence of either a 'X-Amz-Date' or a 'Date' header.")
    if missing:
        raise errors.incomplete_signature(" ".join(missing) + f" Authorization={algorithm}")
    scope = parameters["Credential"].split("/")
    if len(scope) != 5 or scope[3] != SERVICE or scope[4] != "aws4_request":
        raise errors.invalid_signature(f"Credential should be scoped to correct service: '{SERVICE}'.")
    _check_date(headers.get("X-Amz-Date", ""), now)
    return scope[2]


def _check_date(stamp: str, now: float) -> None:
    try:
        signed = datetime.strptime(stamp, AMZ_DATE).replace(tzinfo=UTC).timestamp()
    except ValueError:
        raise errors.incomplete_signature(
            f"Date must be in ISO-8601 'basic format'. Got '{stamp}'."
        ) from None
    if abs(now - signed) > MAX_SKEW_S:
        raise errors.invalid_signature(_skew_message(stamp, signed, now))


def _skew_message(stamp: str, signed: float, now: float) -> str:
    """AWS's words for a signature dated over 5 minutes before its clock, or after it."""

    def at(when: float) -> str:
        return datetime.fromtimestamp(when, UTC).strftime(AMZ_DATE)

    if signed < now:
        earlier = at(now - MAX_SKEW_S)
        return f"Signature expired: {stamp} is now earlier than {earlier} ({at(now)} - 5 min.)"
    later = at(now + MAX_SKEW_S)
    return f"Signature not yet current: {stamp} is still later than {later} ({at(now)} + 5 min.)"


def validated_session(session_id: str | None, streaming: bool) -> str | None:
    """The request's SessionId: NEW_SESSION (InvokeEndpoint only) or an id of the model's pattern."""
    if session_id is None:
        return None
    if len(session_id) > errors.MAX_SESSION_ID:
        raise errors.constraint(
            session_id, "sessionId", f"Member must have length less than or equal to {errors.MAX_SESSION_ID}"
        )
    if session_id == NEW_SESSION and not streaming:
        return session_id
    if not _SESSION_ID.match(session_id) or session_id == NEW_SESSION:
        raise errors.constraint(
            session_id,
            "sessionId",
            f"Member must satisfy regular expression pattern: {errors.SESSION_ID_PATTERN}",
        )
    return session_id


def forwarded_headers(headers: Mapping[str, str], streaming: bool, session_id: str | None) -> dict[str, str]:
    """The headers the container gets: the API's own, every other one stripped."""
    kept = {name: headers[name] for name in PASSED if name in headers}
    if accept := headers.get(ACCEPT[streaming]):
        kept["Accept"] = accept
    if session_id is not None:
        kept[SESSION_HEADER] = session_id
    return kept
