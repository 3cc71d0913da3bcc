"""Which model a route serves: GET <base URL>/models, for the commands whose --model is optional."""

from __future__ import annotations

import asyncio
import sys

import httpx

from kvwatch.collectors.probe.session import api_url
from kvwatch.core.connections import connect_reason, http_client, request, url_problem
from kvwatch.core.redaction import redact


async def list_models(
    client: httpx.AsyncClient, base_url: str, api_key: str | None, deadline_s: float
) -> list[str]:
    """The model ids GET <base URL>/models lists. Raises httpx.HTTPError (an error status too) or
    ValueError when the answer is no model list."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = await request(client, "GET", api_url(base_url, "models"), deadline_s, headers=headers)
    response.raise_for_status()
    answer = response.json()
    listed = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(listed, list) or not all(isinstance(m, dict) and "id" in m for m in listed):
        raise ValueError("the answer is no model list: no `data` of objects with an `id`")
    return [str(model["id"]) for model in listed]


def listing_failed(error: httpx.HTTPError | ValueError) -> str:
    """Why `list_models` gave no list, to follow "GET <url>": an error status, a timeout, no model list,
    or the operating system's reason for no connection."""
    if isinstance(error, httpx.HTTPStatusError):
        return f"answered HTTP {error.response.status_code}"
    if isinstance(error, httpx.TimeoutException | ValueError):
        return f"failed: {error}"
    return f"failed: {connect_reason(error)}"


def chosen_model(
    model: str | None, base_url: str, api_key: str | None, deadline_s: float, command: str
) -> str:
    """`model`, or when it is not given the one model the route serves, said on stderr: a default name
    would be a 404 on every real cluster. ValueError, naming the ids, when the route serves several."""
    if model:
        return model
    if problem := url_problem(base_url):
        raise ValueError(f"base URL {redact(base_url)} is not a valid URL: {problem}")
    url = redact(api_url(base_url, "models"))

    async def listing() -> list[str]:
        async with http_client(timeout=deadline_s) as client:
            return await list_models(client, base_url, api_key, deadline_s)

    try:
        models = asyncio.run(listing())
    except (httpx.HTTPError, ValueError) as error:
        reason = listing_failed(error)
    else:
        if len(models) == 1:
            print(f"kvwatch {command}: model {models[0]}, the one {url} lists", file=sys.stderr)
            return models[0]
        listed = f"lists {len(models)} models ({', '.join(models)})" if models else "lists no model"
        raise ValueError(f"{url} {listed}: name the one to use with --model")
    raise ValueError(f"no --model given, and GET {url} {reason}: name the model with --model")
