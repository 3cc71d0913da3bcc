"""What the server at a base URL serves: the models GET <base URL>/models lists, the one a command uses
when --model is not given, and, asked once a round got no completion, whether it is an OpenAI-compatible
API at all or some other server (a Prometheus, a Grafana, a web page), named as it names itself. A 404
alone cannot tell a wrong model from a wrong server; these answers can."""

from __future__ import annotations

import asyncio
import html
import json
import re
import sys
from dataclasses import dataclass

import httpx

from kvwatch.collectors.probe.session import ProbeSettings, api_url
from kvwatch.core.connections import connect_reason, endpoint_problem, http_client, request, url_problem
from kvwatch.core.redaction import redact

# The round's error kinds after which the server is worth asking what it is: it answered, not with a
# completion.
NO_COMPLETION = ("not_found", "bad_response", "http_error")
SHOWN_MODELS = 20
_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
NAME_CHARS = 80


@dataclass(frozen=True)
class Server:
    """What a base URL's server answered to the two requests every OpenAI-compatible API serves."""

    base_url: str
    models: tuple[str, ...] | None  # what GET <base URL>/models lists; None when it gave no model list
    models_answer: str  # what GET <base URL>/models gave instead of a list, e.g. "answers HTTP 404"
    chat_answer: str  # what POST <base URL>/chat/completions answered, e.g. "HTTP 404 (text/plain)"
    api_error: bool  # that answer was an OpenAI-style error object: {"error": ...} or {"object": "error"}
    name: str | None  # how the server names itself: its home page's title, its Server header

    @property
    def openai_compatible(self) -> bool:
        return self.models is not None or self.api_error

    def unserved_model(self, model: str) -> str | None:
        """That `model` is not among the models listed, naming them; None when it is or none were listed."""
        if self.models is None or model in self.models:
            return None
        listed = ", ".join(self.models[:SHOWN_MODELS]) if self.models else "no model"
        more = f" and {len(self.models) - SHOWN_MODELS} more" if len(self.models) > SHOWN_MODELS else ""
        return f"model {model} is not served here: GET {self._url('models')} lists {listed}{more}"

    def not_an_api(self) -> str | None:
        """That no OpenAI-compatible API answers at the base URL, and what does; None when one does."""
        if self.openai_compatible:
            return None
        named = f"; the server calls itself {self.name}" if self.name else ""
        return (
            f"no OpenAI-compatible API answers at {self._url('')}: "
            f"POST {self._url('chat/completions')} answers {self.chat_answer}, no OpenAI error object, "
            f"and GET {self._url('models')} {self.models_answer}{named}"
        )

    def _url(self, path: str) -> str:
        return redact(api_url(self.base_url, path))


async def explanation(probe: ProbeSettings) -> str | None:
    """What the server says of a round that got no completion: the models it serves instead of the one
    asked for, or that no OpenAI-compatible API answers there; None when it says neither."""
    async with http_client(timeout=probe.timeout_seconds) as client:
        server = await what_answers(client, probe)
    return server.unserved_model(probe.model) or server.not_an_api()


async def what_answers(client: httpx.AsyncClient, probe: ProbeSettings) -> Server:
    """Ask the base URL's server for its models and, when it lists none, what it answers a chat request
    with and what it calls itself. Never raises: what fails is said in the answers."""
    deadline = probe.timeout_seconds
    try:
        models = tuple(await list_models(client, probe.base_url, probe.api_key, deadline))
        models_answer = f"lists {len(models)} model{'' if len(models) == 1 else 's'}"
    except httpx.HTTPStatusError as error:
        models, models_answer = None, f"answers HTTP {error.response.status_code}"
    except ValueError as error:
        models, models_answer = None, f"answers {error}"
    except httpx.HTTPError as error:
        models, models_answer = None, f"failed: {connect_reason(error)}"
    if models is not None:
        return Server(probe.base_url, models, models_answer, "", False, None)
    chat_answer, api_error = await _chat_answer(client, probe)
    name = None if api_error else await _self_name(client, probe.base_url, deadline)
    return Server(probe.base_url, None, models_answer, chat_answer, api_error, name)


async def _chat_answer(client: httpx.AsyncClient, probe: ProbeSettings) -> tuple[str, bool]:
    """What one short chat request gets: its status and content type, and whether it is an API's error."""
    body = {"model": probe.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {probe.api_key}"} if probe.api_key else {}
    url = api_url(probe.base_url, "chat/completions")
    try:
        response = await request(client, "POST", url, probe.timeout_seconds, json=body, headers=headers)
    except httpx.HTTPError as error:
        return f"nothing ({connect_reason(error)})", False
    kind = response.headers.get("Content-Type", "no content type").split(";")[0]
    return f"HTTP {response.status_code} ({kind})", _is_api_error(response.content)


def _is_api_error(content: bytes) -> bool:
    """An error object as OpenAI, vLLM, SGLang and the gateways in front of them write one."""
    try:
        answer = json.loads(content)
    except ValueError:
        return False
    return isinstance(answer, dict) and ("error" in answer or answer.get("object") == "error")


async def _self_name(client: httpx.AsyncClient, base_url: str, deadline_s: float) -> str | None:
    """The title of the server's home page (redirects followed), else its Server header."""
    home = str(httpx.URL(base_url).copy_with(path="/", query=None, fragment=None))
    try:
        response = await request(client, "GET", home, deadline_s, follow_redirects=True)
    except httpx.HTTPError:
        return None
    if found := _TITLE.search(response.content[: 64 << 10]):
        title = " ".join(html.unescape(found.group(1).decode(errors="replace")).split())
        if title:
            return repr(title[:NAME_CHARS])
    server = response.headers.get("Server")
    return f"{server[:NAME_CHARS]!r} (its Server header)" if server else None


async def list_models(
    client: httpx.AsyncClient, base_url: str, api_key: str | None, deadline_s: float
) -> list[str]:
    """The model ids GET <base URL>/models lists. Raises httpx.HTTPError (an error status too) or
    ValueError saying what the answer is instead of a model list ("no JSON", "no model list: ...")."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = await request(client, "GET", api_url(base_url, "models"), deadline_s, headers=headers)
    response.raise_for_status()
    try:
        answer = response.json()
    except ValueError:  # no JSON, or not UTF-8
        raise ValueError("no JSON") from None
    listed = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(listed, list) or not all(isinstance(m, dict) and "id" in m for m in listed):
        raise ValueError("no model list: no `data` of objects with an `id`")
    return [str(model["id"]) for model in listed]


def listing_failed(error: httpx.HTTPError | ValueError) -> str:
    """Why `list_models` gave no list, to follow "GET <url>": an error status, an answer that is no model
    list (no JSON, or JSON without one), a timeout, or the operating system's reason for no connection."""
    if isinstance(error, httpx.HTTPStatusError):
        return f"answered HTTP {error.response.status_code}"
    if isinstance(error, ValueError):
        return f"answered {error}, where an OpenAI-compatible API lists its models"
    if isinstance(error, httpx.TimeoutException):
        return f"failed: {str(error) or 'no answer in time'}"
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
    if problem := endpoint_problem(base_url):
        raise ValueError(f"base URL {redact(base_url)} {problem}")
    url = redact(api_url(base_url, "models"))

    async def listing() -> list[str]:
        async with http_client(timeout=deadline_s) as client:
            return await list_models(client, base_url, api_key, deadline_s)

    try:
        models = asyncio.run(listing())
    except (httpx.HTTPError, ValueError) as error:
        no_model_list = isinstance(error, ValueError) or (
            isinstance(error, httpx.HTTPStatusError) and error.response.status_code == 404
        )
        if no_model_list:  # not a server error: perhaps no API at all
            _raise_when_no_api(base_url, api_key, deadline_s)
        reason = listing_failed(error)
    else:
        if len(models) == 1:
            print(f"kvwatch {command}: model {models[0]}, the one {url} lists", file=sys.stderr)
            return models[0]
        listed = f"lists {len(models)} models ({', '.join(models)})" if models else "lists no model"
        raise ValueError(f"{url} {listed}: name the one to use with --model")
    raise ValueError(f"no --model given, and GET {url} {reason}: name the model with --model")


def _raise_when_no_api(base_url: str, api_key: str | None, deadline_s: float) -> None:
    """ValueError naming what answers at `base_url` when it is no OpenAI-compatible API: a server that
    lists no models may still be one that serves chat completions only."""
    # Any model will do: an API answers an unknown one with an error object.
    probe = ProbeSettings(base_url, "kvwatch-no-model", api_key, timeout_seconds=deadline_s)

    async def asking() -> Server:
        async with http_client(timeout=deadline_s) as client:
            return await what_answers(client, probe)

    if problem := asyncio.run(asking()).not_an_api():
        raise ValueError(f"no --model given, and {problem}")
