"""What answers at a base URL, asked once a round got no completion: an OpenAI-compatible API and the
models it serves, or some other server (a Prometheus, a Grafana, a web page) named as it names itself.
A 404 alone cannot tell a wrong model from a wrong server; these answers can."""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass

import httpx

from kvwatch.collectors.probe.models import list_models
from kvwatch.collectors.probe.session import ProbeSettings, api_url
from kvwatch.core.connections import connect_reason, http_client, request
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
        models, models_answer = None, str(error).removeprefix("the answer is ")
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
