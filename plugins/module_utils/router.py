# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""vLLM's router (vllm-router) in front of the replica groups: the group APIs it routes to, its command line, and
how busy a group still is while it drains (docs/replica-groups.md).

The router lists each group by its head's API URL. A group leaves the rotation by that URL (POST
/remove_worker?url=), so the URL site.yml drains must be the same string the router was started with: each group's
play notes it once from its own settings (`api_url`, roles/glm53), and the router's list is those notes.
"""
from __future__ import annotations

from collections.abc import Sequence

ALL_ADDRESSES = ("", "0.0.0.0", "::")
# vLLM's gauges of a group's requests: those being served and those queued.
IN_FLIGHT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def api_url(bind: str, fabric_ip: str, port: int | str) -> str:
    """A head's API as other hosts reach it: its bind address, or its fabric address when vLLM listens on all."""
    ip = fabric_ip if str(bind) in ALL_ADDRESSES else str(bind)
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{int(port)}"


def group_scrape_targets(urls: Sequence[str], names: Sequence[str]) -> list[dict[str, object]]:
    """Prometheus file_sd targets for the groups' APIs (http://HOST:PORT), each labelled with its group's name."""
    if len(urls) != len(names):
        raise ValueError(f"{len(urls)} group APIs for {len(names)} group names")
    return [{"targets": [url.removeprefix("http://")], "labels": {"group": name}} for url, name in zip(urls, names)]


def router_argv(*, bind: str, port: int, workers: Sequence[str], policy: str, health_interval: int,
                health_failures: int, metrics_port: int, api_key: str) -> list[str]:
    """vllm-router's command line. The router waits at start until every group answers /health (vllm-router
    0.1.17 refuses to start otherwise), so the wait is long; one healthy check brings a group back."""
    if not workers:
        raise ValueError("the router needs at least one group API to route to")
    argv = [
        "--host", bind, "--port", str(port),
        "--worker-urls", *workers,
        "--policy", policy,
        "--health-check-endpoint", "/health",
        "--health-check-interval-secs", str(health_interval),
        "--health-failure-threshold", str(health_failures),
        "--health-success-threshold", "1",
        "--worker-startup-timeout-secs", "3600",
        "--worker-startup-check-interval", "2",
        "--prometheus-host", bind, "--prometheus-port", str(metrics_port),
        "--log-level", "info",
        # Which groups take requests is the health checks' and the playbooks' business (drain.yml, join.yml,
        # status.yml read it from /workers). vllm-router's circuit breaker (10 failed attempts, retries counted,
        # then 60 s out and 3 good requests to come back) is a second rotation none of them sees: a group back
        # from a crash can stay out of it after /workers lists it healthy, and a rolling restart that drains the
        # other group then leaves none, so the router answers 503 (the likely cause of one 503 of 26 requests, 16 s
        # into four_nodes' rolling switch after a killed group's return, CI 2026-12-07; docs/testing.md, round 28).
        "--disable-circuit-breaker",
    ]
    # The groups' key: the router sends it to every group (clients' keys are the edge's).
    if api_key:
        argv += ["--api-key", api_key]
    return argv


def requests_in_flight(metrics_text: str) -> int:
    """Requests a vLLM API is serving or queueing, from its /metrics (Prometheus text), summed over its labels."""
    # Here, not at the top: the controller has prometheus_client (requirements.txt); a Spark need not.
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in IN_FLIGHT_METRICS:
                total += sample.value
    return int(total)
