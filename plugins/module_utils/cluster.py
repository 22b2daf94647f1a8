# SPDX-License-Identifier: MIT
"""How the ranks of one deployment are addressed: rank = host order, rank 0 is the head."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
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


CONTAINER_HF_CACHE = "/root/.cache/huggingface"


def checkpoint_paths(snapshot: Mapping[str, Any], hf_cache_dir: str) -> dict[str, str]:
    """Where one downloaded revision lives, relative to a node's HF cache dir (the same on every node),
    from an hf_snapshot result on the head. The sync marker sits outside the repo dir so the head's
    rsync never carries (or overwrites) a worker's marker."""
    root = PurePosixPath(hf_cache_dir)
    snapshot_dir = PurePosixPath(snapshot["snapshot_path"]).relative_to(root)
    repo_dir = snapshot_dir.parent.parent  # hub/models--ORG--REPO/snapshots/SHA
    return {
        "repo_id": snapshot["repo_id"],
        "revision": snapshot["revision"],
        "repo_dir": str(repo_dir),
        "snapshot": str(snapshot_dir),
        "manifest": str(PurePosixPath(snapshot["manifest_path"]).relative_to(root)),
        "marker": f"{repo_dir.parent}/.glm53-sync/{repo_dir.name}@{snapshot['revision']}.json",
        "container_path": f"{CONTAINER_HF_CACHE}/{snapshot_dir}",
    }
