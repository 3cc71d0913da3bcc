"""The lab SageMaker front's error answers, shaped as botocore's service model for the SageMaker runtime
(`sagemaker-runtime/2017-05-13/service-2.json`) defines them, so that the real client raises the
modeled exception: the code in `x-amzn-ErrorType`, the members in a JSON body."""

from __future__ import annotations

import json

from aiohttp import web

from kvwatch.core.errors import KVWatchError

ACCOUNT = "123456789012"  # the lab's stand-in for the caller's account
ERROR_TYPE_HEADER = "x-amzn-ErrorType"
CORAL = "http://internal.amazon.com/coral/com.amazon.sagemaker/"
SESSION_ID_PATTERN = r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$"
MAX_SESSION_ID = 256


class AwsError(KVWatchError):
    """An error answer of the runtime API: HTTP status, error code and the shape's members."""

    def __init__(self, status: int, code: str, message: str, **members):
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.members = {"Message": message, **members}

    def response(self, request_id: str) -> web.Response:
        headers = {
            ERROR_TYPE_HEADER: f"{self.code}:{CORAL}",
            "x-amzn-RequestId": request_id,
            "Content-Type": "application/json",
        }
        # The API gateway's own errors (authentication) carry a lower-case `message` only.
        body = {"message": self.members["Message"]} if self.status == 403 else self.members
        return web.Response(status=self.status, text=json.dumps(body), headers=headers)


def missing_token() -> AwsError:
    return AwsError(403, "MissingAuthenticationTokenException", "Missing Authentication Token")


def incomplete_signature(message: str) -> AwsError:
    return AwsError(403, "IncompleteSignatureException", message)


def invalid_signature(message: str) -> AwsError:
    return AwsError(403, "InvalidSignatureException", message)


def validation(message: str) -> AwsError:
    return AwsError(400, "ValidationError", message)


def constraint(value: str, member: str, rule: str) -> AwsError:
    """AWS's wording for a request member that breaks its shape's constraint."""
    return validation(
        f"1 validation error detected: Value '{value}' at '{member}' failed to satisfy constraint: {rule}"
    )


def endpoint_not_found(name: str) -> AwsError:
    return validation(f"Endpoint {name} of account {ACCOUNT} not found.")


def model_error(status: int, original: str, endpoint: str, region: str) -> AwsError:
    """The container answered `status`: 424, with its status and body as OriginalStatusCode/Message."""
    kind = "client" if status < 500 else "server"
    group = f"/aws/sagemaker/Endpoints/{endpoint}"
    return AwsError(
        424,
        "ModelError",
        f'Received {kind} error ({status}) from primary with message "{original}". See '
        f"https://{region}.console.aws.amazon.com/cloudwatch/home?region={region}#logEventViewer:"
        f"group={group} in account {ACCOUNT} for more information.",
        ErrorCode=f"{kind.upper()}_ERROR_FROM_MODEL",
        OriginalStatusCode=status,
        OriginalMessage=original,
        LogStreamArn=f"arn:aws:logs:{region}:{ACCOUNT}:log-group:{group}",
    )


def service_unavailable() -> AwsError:
    return AwsError(503, "ServiceUnavailable", "The endpoint has no instance in service; try again later.")


def unknown_operation() -> AwsError:
    return AwsError(404, "UnknownOperationException", "Unknown operation")


def session_expired(session_id: str) -> AwsError:
    """The lab's answer for a session its table dropped, idle past the session TTL."""
    return validation(
        f"Session {session_id} has expired: it was idle past the session TTL. Start a new session."
    )


def session_gone(session_id: str) -> AwsError:
    """The lab's answer (SageMaker's is not documented) when the instance holding a session is gone."""
    return validation(
        f"Session {session_id} is not available: the instance that held it is no longer in service. "
        "Start a new session."
    )
