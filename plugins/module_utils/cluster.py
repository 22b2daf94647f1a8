# SPDX-License-Identifier: MIT
"""How the ranks of one deployment are addressed: rank = host order, rank 0 is the head."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def rank_refs(hosts: Sequence[str], hostvars: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per rank for vllm_health: the head's container is local, the others are reached by ssh
    from the head over the fabric (the same path the weight sync uses)."""
    refs = []
    for rank, host in enumerate(hosts):
        hv = hostvars[host]
        refs.append({
            "rank": rank,
            "node": host,
            "container": hv["_glm53_container"],
            "ssh": None if rank == 0 else f"{hv['_glm53_ssh_user']}@{hv['glm53_fabric_ip']}",
        })
    return refs
