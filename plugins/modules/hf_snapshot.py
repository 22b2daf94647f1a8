#!/usr/bin/python
# -*- coding: utf-8 -*-
# SPDX-License-Identifier: MIT
from __future__ import annotations

DOCUMENTATION = r"""
---
module: hf_snapshot
short_description: Download a pinned Hugging Face model revision completely and resumably
description:
  - Lists the files of the revision with their sizes (the manifest), compares them with the Hugging Face
    cache under O(cache_dir), and downloads only the files that are absent or have the wrong size.
  - Complete means every file of the revision (after O(allow_patterns)/O(ignore_patterns)) is present in
    the snapshot directory with the listed size. An interrupted download resumes on the next run.
  - Writes the manifest as JSON to C(models--ORG--REPO/manifests/SHA.json) in the cache, so workers can
    verify an rsynced copy with M(sparkops.glm53.snapshot_verify), and so a re-run with a commit sha
    (or a branch resolved before) finishes without contacting the hub.
  - When the primary repo cannot be listed or fully downloaded, the O(fallbacks) are tried in order, each at
    its own revision.
version_added: "0.1.0"
author:
  - sparkops (!UNKNOWN)
requirements:
  - huggingface_hub >= 0.34 on the target
options:
  repo_id:
    description: Primary model repository, C(ORG/NAME).
    type: str
    required: true
  fallbacks:
    description:
      - Repositories tried in order when the primary is missing, lacks the revision or cannot be downloaded
        completely, each with its own revision (a commit sha belongs to one repo; a mirror and the repo it
        mirrors have different shas for the same files).
    type: list
    elements: dict
    default: []
    suboptions:
      repo_id:
        description: Repository, C(ORG/NAME).
        type: str
        required: true
        aliases: [repo]
      revision:
        description: Commit sha (recommended), branch or tag of that repository; omitted, O(revision) is used.
        type: str
  revision:
    description: Commit sha (recommended), branch or tag.
    type: str
    default: main
  cache_dir:
    description: Hugging Face cache directory (the one mounted at /root/.cache/huggingface/hub in the engine).
    type: path
    required: true
  token:
    description: Hugging Face token for gated or private repos.
    type: str
  endpoint:
    description: Hub endpoint URL; the simulated cluster points this at its local olah mirror.
    type: str
  allow_patterns:
    description: Only files matching one of these glob patterns belong to the snapshot.
    type: list
    elements: str
  ignore_patterns:
    description: Files matching one of these glob patterns are left out.
    type: list
    elements: str
  refresh:
    description:
      - Ask the hub for the file list even when an earlier run's manifest says the snapshot is complete.
        Files already present with the right size are still not downloaded again.
    type: bool
    default: false
  local_only:
    description:
      - Only look for a snapshot that an earlier run's manifest says is complete on disk, without the hub;
        change nothing and return RV(local) false when there is none (always false with O(refresh)).
      - The action plugin runs this first, in the foreground, so a re-run whose snapshot is in place costs one
        module run instead of a background job and its polling.
    type: bool
    default: false
  progress_file:
    description:
      - While downloading, keep this JSON file updated (at least every 5 s) with C(done_bytes), C(total_bytes),
        C(files_done), C(files_total), C(rate_bps), C(eta_s), C(updated) (epoch seconds), C(state),
        C(repo_id) and C(revision), for a controller-side poller of an async task.
    type: path
  max_workers:
    description: Files downloaded in parallel.
    type: int
    default: 4
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: full
    details: Lists the revision on the hub and reports what would be downloaded, without writing anything.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
    support: none
  idempotent:
    description: When run twice in a row outside check mode, with the same arguments, the second invocation indicates no change.
    support: full
notes:
  - Progress bars of huggingface_hub are disabled; use O(progress_file) with C(async) to watch a long download.
"""

EXAMPLES = r"""
- name: Download the pinned model revision on the head node
  sparkops.glm53.hf_snapshot:
    repo_id: Mia-AiLab/GLM-5.3-Flash-EXL3-TR3-4bpw
    revision: 25a44fdbf16862a46b7cc9921142c6c81350af2f
    fallbacks:
      - repo_id: brandonmusic/GLM-5.3-Flash-tr3-4bpw
        revision: 5ab363a8dcf6405955fd5f99671e01a1c9fb124b
    cache_dir: /srv/hf-cache/hub
    token: "{{ glm53_hf_token | default(omit) }}"
    progress_file: /tmp/glm53-download.json
  async: 86400
  poll: 0
  register: _glm53_download_job

- name: Simulated cluster, from the local olah endpoint
  sparkops.glm53.hf_snapshot:
    repo_id: sim/tiny-glm
    revision: main
    cache_dir: /root/.cache/huggingface/hub
    endpoint: http://10.0.0.1:8090
"""

RETURN = r"""
local:
  description: With O(local_only), whether a complete snapshot was found on disk (the other values are then set).
  returned: when O(local_only) is true
  type: bool
repo_id:
  description: The repository the snapshot came from (the primary or a fallback).
  returned: success
  type: str
revision:
  description: The resolved commit sha.
  returned: success
  type: str
snapshot_path:
  description: The snapshot directory (symlinks into the cache's blobs), what vLLM's --model can point at.
  returned: success
  type: str
manifest_path:
  description: The manifest JSON {repo_id, revision, files [{path, size}]} beside the snapshot.
  returned: success
  type: str
files:
  description: Number of files in the snapshot.
  returned: success
  type: int
total_bytes:
  description: Size of all files of the snapshot.
  returned: success
  type: int
downloaded_bytes:
  description: Bytes downloaded by this run; in check mode, bytes that would be downloaded.
  returned: success
  type: int
missing:
  description: Files that were absent or of the wrong size before this run (downloaded, or in check mode to download).
  returned: success
  type: list
  elements: str
attempts:
  description: Candidates that failed before the one used, each {repo_id, revision, error}.
  returned: always
  type: list
  elements: dict
disk:
  description: C(needed_bytes) for the missing files and C(free_bytes) in the cache's filesystem; null when nothing was listed.
  returned: success
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.sparkops.glm53.plugins.module_utils.hf_snapshot import (
    HuggingFaceHub,
    SnapshotError,
    SnapshotRequest,
    SnapshotSource,
    ensure_snapshot,
    local_snapshot,
)


def _tuple_or_none(value: list[str] | None) -> tuple[str, ...] | None:
    return tuple(value) if value else None


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            repo_id=dict(type="str", required=True),
            fallbacks=dict(type="list", elements="dict", default=[], options=dict(
                repo_id=dict(type="str", required=True, aliases=["repo"]),
                revision=dict(type="str"),
            )),
            revision=dict(type="str", default="main"),
            cache_dir=dict(type="path", required=True),
            token=dict(type="str", no_log=True),
            endpoint=dict(type="str"),
            allow_patterns=dict(type="list", elements="str"),
            ignore_patterns=dict(type="list", elements="str"),
            refresh=dict(type="bool", default=False),
            local_only=dict(type="bool", default=False),
            progress_file=dict(type="path"),
            max_workers=dict(type="int", default=4),
        ),
        supports_check_mode=True,
    )
    p = module.params
    request = SnapshotRequest(
        repo_id=p["repo_id"],
        revision=p["revision"],
        cache_dir=p["cache_dir"],
        fallbacks=tuple(SnapshotSource(f["repo_id"], f["revision"] or p["revision"]) for f in p["fallbacks"]),
        allow_patterns=_tuple_or_none(p["allow_patterns"]),
        ignore_patterns=_tuple_or_none(p["ignore_patterns"]),
        refresh=p["refresh"],
        progress_file=p["progress_file"],
        max_workers=p["max_workers"],
    )

    if p["local_only"]:
        found = local_snapshot(request)
        module.exit_json(changed=False, local=found is not None, **(found.to_dict() if found else {}))

    def hub_factory() -> HuggingFaceHub:
        try:
            return HuggingFaceHub(p["cache_dir"], endpoint=p["endpoint"], token=p["token"])
        except ImportError as exc:
            module.fail_json(msg=missing_required_lib("huggingface_hub"), exception=str(exc), attempts=[])
            raise

    try:
        result = ensure_snapshot(request, hub_factory, check_mode=module.check_mode)
    except SnapshotError as exc:
        module.fail_json(msg=str(exc), attempts=exc.attempts)
    module.exit_json(changed=result.changed, **result.to_dict())


if __name__ == "__main__":
    main()
