# SPDX-License-Identifier: MIT
"""Filters of the fabric check; documentation in fabric_ping_targets.yml, fabric_busbw.yml, fabric_report.yml."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sparkops.glm53.plugins.module_utils.fabric_check import (
    busbw_result,
    fabric_report,
    ping_result,
    ping_targets,
)


def _ping_targets(nodes: Mapping[str, Mapping[str, Any]], node: str) -> list[dict[str, Any]]:
    try:
        return ping_targets(node, nodes)
    except (KeyError, TypeError, ValueError) as exc:
        raise AnsibleFilterError(f"fabric_ping_targets: {exc!r} (expects fabric_facts results keyed by node)") from exc


def _busbw(runs: Mapping[str, Mapping[str, Any]], head: str) -> dict[str, Any]:
    return busbw_result(runs, head)


def _report(nodes: Mapping[str, Mapping[str, Any]], pings: Mapping[str, Sequence[Mapping[str, Any]]],
            busbw: Mapping[str, Any], floor_gbps: float) -> dict[str, Any]:
    try:
        results = {node: [ping_result(r) for r in runs if "item" in r] for node, runs in pings.items()}
        return fabric_report(nodes, results, busbw, float(floor_gbps))
    except (KeyError, TypeError, ValueError) as exc:
        raise AnsibleFilterError(f"fabric_report: {exc!r} (expects fabric_facts and ping results keyed by node)") from exc


class FilterModule:
    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"fabric_ping_targets": _ping_targets, "fabric_busbw": _busbw, "fabric_report": _report}
