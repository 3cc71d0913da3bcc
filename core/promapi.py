"""The one client of Prometheus' HTTP API in kvwatch: prometheus-api-client's PrometheusConnect over a
requests session that bounds the whole answer and checks it, so that every failure is one exception
of core.errors and every reader fails the same way."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime

import requests
import urllib3
from prometheus_api_client import PrometheusConnect
from requests.adapters import Retry

from kvwatch.core.connections import connect_reason
from kvwatch.core.errors import KVWatchError, QueryRefused, UnexpectedAnswer, Unreachable, UpstreamTimeout

CHUNK_BYTES = 65536


class PrometheusApi:
    """Prometheus at `url`, each answer complete within `deadline_s` or UpstreamTimeout; no retries: a
    reader that waits for backoffs is worse than one that says Prometheus is down. Every method raises
    an UpstreamError and nothing else when Prometheus fails.

    `rules_url` is where the rule engine answers the rules and Alertmanagers API when the store does not
    evaluate rules itself (vmalert beside VictoriaMetrics); by default `url`, as Prometheus does both."""

    def __init__(self, url: str, deadline_s: float, rules_url: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.rules_url = (rules_url or url).rstrip("/")
        self._session = _CheckedSession(deadline_s)
        self._connect = PrometheusConnect(self.url, session=self._session, retry=Retry(total=0))

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """The series of an instant query, at `at` (unix seconds) or now."""
        params = {} if at is None else {"time": at}
        return _series(lambda: self._connect.custom_query(expr, params=params))

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """The series of a range query, each with its `values`."""
        start_time, end_time = (datetime.fromtimestamp(t, UTC) for t in (start, end))
        return _series(lambda: self._connect.custom_query_range(expr, start_time, end_time, f"{step:g}"))

    def alerting_rules(self) -> list[dict]:
        """The alerting rules Prometheus evaluates, each with its group's `interval` and its alerts
        (/api/v1/rules?type=alert): their state, activeAt, and keepFiringSince while keep_firing_for
        holds one whose expression stopped matching."""
        answer = self._session.get(f"{self.rules_url}/api/v1/rules", params={"type": "alert"}).json()
        try:
            return [
                {**rule, "interval": float(group["interval"])}
                for group in answer["data"]["groups"]
                for rule in group["rules"]
            ]
        except (KeyError, TypeError, ValueError) as error:
            raise UnexpectedAnswer(f"no rule groups in the answer: {error!r}") from None

    def loaded_config(self) -> str:
        """The configuration Prometheus runs with, as YAML (/api/v1/status/config)."""
        return str(self._data("status/config", "yaml"))

    def targets(self) -> list[dict]:
        """The scrape targets Prometheus scrapes now, with their health and last error (/api/v1/targets)."""
        return _objects(self._data("targets?state=active", "activeTargets"), "activeTargets")

    def rule_groups(self) -> list[dict]:
        """The rule groups Prometheus evaluates, each rule with its health and last error (/api/v1/rules)."""
        return _objects(self._data("rules", "groups", self.rules_url), "groups")

    def alertmanagers(self) -> list[dict]:
        """The Alertmanagers Prometheus sends its alerts to now (/api/v1/alertmanagers)."""
        found = self._data("alertmanagers", "activeAlertmanagers", self.rules_url)
        return _objects(found, "activeAlertmanagers")

    def _data(self, path: str, key: str, base: str | None = None) -> object:
        """`key` of the data of the API's answer at /api/v1/`path` of `base` (default: the store's)."""
        answer = self._session.get(f"{base or self.url}/api/v1/{path}").json()
        try:
            return answer["data"][key]
        except (KeyError, TypeError) as error:
            raise UnexpectedAnswer(f"no {key} in the answer: {error!r}") from None


def _objects(found: object, key: str) -> list[dict]:
    """`found`, checked to be a list of JSON objects."""
    if not (isinstance(found, list) and all(isinstance(item, dict) for item in found)):
        raise UnexpectedAnswer(f"{key} in the answer is not a list of objects")
    return found


def _series(ask) -> list[dict]:
    """The result of `ask()`, checked to be series: a list of objects with labels."""
    try:
        result = ask()
    except KVWatchError:
        raise
    except (KeyError, TypeError, ValueError) as error:  # the JSON is not shaped like the API's
        raise UnexpectedAnswer(f"no result in the answer: {error!r}") from None
    if not isinstance(result, list) or not all(
        isinstance(s, dict) and isinstance(s.get("metric"), dict) for s in result
    ):
        raise UnexpectedAnswer("the result is not a list of series")
    return result


class _CheckedSession(requests.Session):
    """A requests session that reads every answer whole within the deadline, then checks it: requests'
    timeout bounds each read only, so a server that sends a byte now and then would hold a reader
    forever. Raises the errors of core.errors instead of requests' own."""

    def __init__(self, deadline_s: float) -> None:
        super().__init__()
        self.deadline_s = deadline_s
        # As core.connections.http_client: no proxy from the environment, and the CA bundle that every
        # other kvwatch connection trusts (SSL_CERT_FILE or SSL_CERT_DIR, else certifi's).
        self.trust_env = False
        self.verify = os.environ.get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_DIR") or True

    def request(self, method, url, *args, **options) -> requests.Response:
        """The answer, read whole and checked. Connecting and the headers take the deadline's time
        (urllib3's total timeout), the body what is left of it. No idle connection outlives the
        answer: each reader asks once or twice, and a kept socket would only leak."""
        ends = time.monotonic() + self.deadline_s
        options.update(stream=True, timeout=urllib3.Timeout(total=self.deadline_s))
        try:
            with super().request(method, url, *args, **options) as response:
                response._content = _body_by(response, ends)  # what requests' .content would read
        except (requests.Timeout, urllib3.exceptions.TimeoutError, TimeoutError):
            raise UpstreamTimeout(f"no complete answer within {self.deadline_s:g} s") from None
        except (requests.RequestException, urllib3.exceptions.HTTPError) as error:
            raise Unreachable(connect_reason(error)) from error
        finally:
            self.close()
        _check(response)
        return response


def _body_by(response: requests.Response, ends: float) -> bytes:
    """The body, decoded, each read bounded by the time left until `ends` (a monotonic time)."""
    chunks, raw = [], response.raw
    while (left := ends - time.monotonic()) > 0:
        if raw.connection is not None and raw.connection.sock is not None:
            raw.connection.sock.settimeout(left)
        if not (chunk := raw.read1(CHUNK_BYTES, decode_content=True)):
            return b"".join(chunks)
        chunks.append(chunk)
    raise TimeoutError


def _check(response: requests.Response) -> None:
    """Raises QueryRefused unless Prometheus answered with success, UnexpectedAnswer for no JSON object."""
    try:
        answer = response.json()
    except ValueError:
        raise UnexpectedAnswer(f"HTTP {response.status_code} with no JSON") from None
    if not isinstance(answer, dict):
        raise UnexpectedAnswer(f"HTTP {response.status_code} with JSON that is no object")
    if answer.get("status") != "success" or not response.ok:
        raise QueryRefused(answer.get("error", f"HTTP {response.status_code}"), answer.get("errorType"))
