"""Amazon SageMaker's stateful sessions: `X-Amzn-SageMaker-Session-Id` (InvokeEndpoint's SessionId), the
only session header SageMaker lets through to the container."""

from kvwatch.collectors.sessionkeys.base import SessionKey

KEY = SessionKey(
    "sagemaker", "X-Amzn-SageMaker-Session-Id", "Amazon SageMaker's stateful sessions (SessionId)"
)
