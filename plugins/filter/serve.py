# SPDX-License-Identifier: MIT
"""Filters over the `vllm serve` settings; documentation in vllm_serve_argv.yml and vllm_settings_check.yml."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sparkops.glm53.plugins.module_utils.serve_argv import (
    as_bool,
    render_serve_argv,
    settings_warnings,
    topology_errors,
)
from ansible_collections.sparkops.glm53.plugins.module_utils.settings_rules import serve_settings_errors
from ansible_collections.sparkops.glm53.plugins.plugin_utils.argument_spec import spec_options


def vllm_serve_argv(settings: Mapping[str, Any], rank: int, nnodes: int, master_addr: str,
                    num_attention_heads: int = 64) -> list[str]:
    try:
        # The settings' own rules first: the renderer checks only the rules between them.
        errors = serve_settings_errors(settings, spec_options(), num_attention_heads=int(num_attention_heads))
        errors += topology_errors(settings, rank=int(rank), nnodes=int(nnodes), master_addr=str(master_addr))
        if errors:
            raise ValueError("; ".join(errors))
        return render_serve_argv(settings, rank=int(rank), nnodes=int(nnodes), master_addr=str(master_addr),
                                 num_attention_heads=int(num_attention_heads))
    except (TypeError, ValueError) as exc:
        raise AnsibleFilterError(f"vllm_serve_argv: {exc}") from exc


def vllm_settings_check(settings: Mapping[str, Any], gpu: bool = True, num_attention_heads: int = 64,
                        nnodes: int | None = None) -> dict[str, list[str]]:
    if not isinstance(settings, Mapping):
        raise AnsibleFilterError("vllm_settings_check: expects a mapping of settings")
    try:
        on_gpu = as_bool(gpu)
    except ValueError as exc:
        raise AnsibleFilterError(f"vllm_settings_check: gpu: {exc}") from exc
    errors = serve_settings_errors(settings, spec_options(), num_attention_heads=int(num_attention_heads))
    if nnodes is not None:
        # Rank and master address do not matter here: only the parallel sizes against the node count.
        errors += topology_errors(settings, rank=0, nnodes=int(nnodes), master_addr="head")
    return {
        "errors": errors,
        "warnings": settings_warnings(settings, gpu=on_gpu),
    }


class FilterModule:
    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"vllm_serve_argv": vllm_serve_argv, "vllm_settings_check": vllm_settings_check}
