"""The plain HTTP side of the benchmark: /health, /metrics, /v1/models, and waiting for an idle server.

stdlib urllib on purpose: these are single GETs, and the OpenAI client is kept for what users send.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .prometheus_deltas import Snapshot, parse_metrics, requests_in_flight


class ServerError(RuntimeError):
    """The server cannot be benchmarked (down, unhealthy, or never idle)."""


@dataclass(frozen=True)
class Server:
    base_url: str
    api_key: str | None = field(default=None, repr=False)  # never in a traceback or a log line
    timeout_s: float = 10.0

    def get(self, path: str) -> tuple[int, bytes]:
        request = urllib.request.Request(self.base_url + path)
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def post_json(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        request = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace")

    def count_tokens(self, model: str, text: str) -> int:
        """Tokens of `text` as the served model's tokenizer counts them (vLLM's /tokenize)."""
        status, body = self.post_json("/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})
        if status != 200 or not isinstance(body, dict) or "count" not in body:
            raise ServerError(f"POST {self.base_url}/tokenize answered HTTP {status}: {str(body)[:200]}")
        return int(body["count"])

    def check_health(self) -> None:
        try:
            status, body = self.get("/health")
        except (OSError, urllib.error.URLError) as exc:
            raise ServerError(f"GET {self.base_url}/health failed: {exc}") from exc
        if status != 200:
            raise ServerError(f"GET {self.base_url}/health answered HTTP {status}: "
                              f"{body[:200].decode('utf-8', 'replace')}")

    def models(self) -> dict[str, Any] | None:
        try:
            status, body = self.get("/v1/models")
            return json.loads(body) if status == 200 else None
        except (OSError, ValueError):
            return None

    def metrics(self) -> Snapshot | None:
        """None when the server has no Prometheus endpoint (not vLLM, or metrics disabled)."""
        try:
            status, body = self.get("/metrics")
        except OSError:
            return None
        if status != 200:
            return None
        try:
            return parse_metrics(body.decode("utf-8"))
        except ValueError:
            return None


def wait_until_idle(scrape: Callable[[], Snapshot | None], timeout_s: float, poll_s: float = 1.0, quiet_polls: int = 2,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> float | None:
    """Blocks until ``quiet_polls`` scrapes in a row show no running or waiting request.

    ``scrape`` is normally ``Server.metrics``. A freshly launched deployment is still answering the
    launch canary and other warm-up traffic; measuring over it halves the numbers. Returns the seconds
    waited, or None when the server exports no scheduler gauges (idle state unknowable). Raises
    ServerError when it stays busy.
    """
    start = clock()
    quiet = 0
    while True:
        snapshot = scrape()
        in_flight = requests_in_flight(snapshot) if snapshot is not None else None
        if in_flight is None:
            return None
        quiet = quiet + 1 if in_flight == (0.0, 0.0) else 0
        if quiet >= quiet_polls:
            return clock() - start
        if clock() - start >= timeout_s:
            running, waiting = in_flight
            raise ServerError(f"server still busy after {timeout_s:.0f} s ({running:.0f} running, "
                              f"{waiting:.0f} waiting requests); results would include that traffic. "
                              "Raise --warmup-wait, or pass --warmup-wait 0 to measure anyway.")
        sleep(poll_s)
