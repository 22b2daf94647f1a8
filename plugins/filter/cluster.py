# SPDX-License-Identifier: MIT
"""Filters that address the ranks of a deployment; documentation in rank_refs.yml, checkpoint_paths.yml and
replica_layout.yml."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sparkops.glm53.plugins.module_utils.cluster import checkpoint_paths, rank_refs
from ansible_collections.sparkops.glm53.plugins.module_utils.replica_groups import replica_layout


def _rank_refs(hosts: Sequence[str], hostvars: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    try:
        return rank_refs(list(hosts), hostvars)
    except KeyError as exc:
        raise AnsibleFilterError(f"rank_refs: a Spark lacks {exc}; run the glm53 settings role first") from exc


def _checkpoint_paths(snapshot: Mapping[str, Any], hf_cache_dir: str) -> dict[str, str]:
    try:
        return checkpoint_paths(snapshot, str(hf_cache_dir))
    except (KeyError, ValueError) as exc:
        raise AnsibleFilterError(f"checkpoint_paths: {exc} (expects an hf_snapshot result under {hf_cache_dir})") from exc


def _replica_layout(assigned: Mapping[str, Any]) -> dict[str, object]:
    try:
        return replica_layout(list(assigned), assigned).as_dict()
    except ValueError as exc:
        raise AnsibleFilterError(str(exc)) from exc


class FilterModule:
    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"rank_refs": _rank_refs, "checkpoint_paths": _checkpoint_paths, "replica_layout": _replica_layout}
