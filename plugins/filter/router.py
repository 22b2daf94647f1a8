# SPDX-License-Identifier: MIT
"""Filters for vLLM's router in front of replica groups; documentation in group_api_urls.yml, router_argv.yml and
requests_in_flight.yml."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sparkops.glm53.plugins.module_utils.router import (
    group_api_urls,
    requests_in_flight,
    router_argv,
)


def _group_api_urls(heads: Sequence[Mapping[str, Any]], default_bind: str, default_port: Any) -> list[str]:
    try:
        return group_api_urls(list(heads), str(default_bind), default_port)
    except (KeyError, ValueError) as exc:
        raise AnsibleFilterError(f"group_api_urls: a group head lacks {exc}; run the glm53 settings role first") from exc


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
        return {"group_api_urls": _group_api_urls, "router_argv": _router_argv,
                "requests_in_flight": _requests_in_flight}
