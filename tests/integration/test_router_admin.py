# SPDX-License-Identifier: MIT
"""The router's admin calls as roles/router makes them, against the real vllm-router (0.1.17, installed here) started
with our command line: a group URL encoded by Jinja's urlencode (drain.yml, join.yml) leaves and rejoins the
rotation, and a group whose /health fails is listed unhealthy after the configured failures. The groups are small
HTTP servers answering /health: vLLM's API is not what is tested here (molecule four_nodes routes to real ones)."""
from __future__ import annotations

import http.server
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import jinja2
import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.router import router_argv

from tools.sim_model.serve_hub import free_port

pytestmark = pytest.mark.integration


class Group(http.server.ThreadingHTTPServer):
    healthy = True


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        ok = self.server.healthy  # type: ignore[attr-defined]
        self.send_response(200 if ok else 503)
        self.end_headers()
        self.wfile.write(b"ok" if ok else b"down")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def groups() -> Iterator[list[Group]]:
    servers = [Group(("127.0.0.1", free_port()), Health) for _index in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield servers
    for server in servers:
        server.shutdown()


def url(server: Group) -> str:
    return "http://127.0.0.1:%d" % server.server_address[1]


def call(base: str, path: str, method: str = "GET") -> Any:
    with urllib.request.urlopen(urllib.request.Request(base + path, method=method), timeout=10) as reply:
        body = reply.read().decode()
    return json.loads(body) if body.startswith("{") else body


@pytest.fixture()
def router(groups: list[Group]) -> Iterator[str]:
    port = free_port()
    argv = router_argv(bind="127.0.0.1", port=port, workers=[url(g) for g in groups], policy="cache_aware",
                       health_interval=1, health_failures=2, metrics_port=free_port(), api_key="")
    proc = subprocess.Popen(["vllm-router", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = "http://127.0.0.1:%d" % port
    try:
        for _attempt in range(100):
            try:
                if call(base, "/health") == "All servers healthy":
                    break
            except OSError:
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def encoded(value: str) -> str:
    """As drain.yml and join.yml put a group's URL in the query."""
    return jinja2.Environment().from_string("{{ value | urlencode }}").render(value=value)


def test_a_group_leaves_and_rejoins_the_rotation_by_its_encoded_url(router: str, groups: list[Group]) -> None:
    b = url(groups[1])
    assert sorted(call(router, "/list_workers")["urls"]) == sorted(url(g) for g in groups)
    call(router, "/remove_worker?url=" + encoded(b), "POST")
    assert call(router, "/list_workers")["urls"] == [url(groups[0])]
    call(router, "/add_worker?url=" + encoded(b), "POST")
    assert sorted(call(router, "/list_workers")["urls"]) == sorted(url(g) for g in groups)


def test_a_group_failing_health_is_listed_unhealthy_then_healthy_again(router: str, groups: list[Group]) -> None:
    def health_of_b() -> bool:
        workers = call(router, "/workers")["workers"]
        return next(w["is_healthy"] for w in workers if w["url"] == url(groups[1]))

    def wait_for(want: bool) -> float:
        start = time.monotonic()
        while health_of_b() != want:
            assert time.monotonic() - start < 15, "group b never became %s" % ("healthy" if want else "unhealthy")
            time.sleep(0.2)
        return time.monotonic() - start

    groups[1].healthy = False
    wait_for(False)
    assert call(router, "/readiness")["healthy_workers"] == 1
    groups[1].healthy = True
    wait_for(True)
