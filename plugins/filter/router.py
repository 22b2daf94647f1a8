# SPDX-License-Identifier: MIT
"""Filters for vLLM's router in front of replica groups; documentation in api_url.yml, group_scrape_targets.yml, router_argv.yml and
requests_in_flight.yml."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sparkops.glm53.plugins.module_utils.router import (
    api_url,
    group_scrape_targets,
    requests_in_flight,
    router_argv,
)


def _api_url(bind: Any, fabric_ip: Any, port: Any) -> str:
    try:
        return api_url(str(bind), str(fabric_ip), port)
    except ValueError as exc:
        raise AnsibleFilterError(f"api_url: {exc}") from exc


def _group_scrape_targets(urls: Any, names: Any) -> list[dict[str, object]]:
    try:
        return group_scrape_targets(list(urls), list(names))
    except ValueError as exc:
        raise AnsibleFilterError(f"group_scrape_targets: {exc}") from exc


def _router_argv(settings: Mapping[str, Any]) -> list[str]:
    try:
        return router_argv(**settings)
    except (TypeError, ValueError) as exc:
        raise AnsibleFilterError(f"router_argv: {exc}") from exc


def _requests_in_flight(metrics_text: str) -> int:
    try:
        return requests_in_flight(str(metrics_text))
    except ValueError as exc:
        raise AnsibleFilterError(f"requests_in_flight: not Prometheus text ({exc})") from exc


class FilterModule:
    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"api_url": _api_url, "group_scrape_targets": _group_scrape_targets, "router_argv": _router_argv,
                "requests_in_flight": _requests_in_flight}
