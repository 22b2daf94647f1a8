#!/usr/bin/python
# -*- coding: utf-8 -*-
# SPDX-License-Identifier: MIT
from __future__ import annotations

DOCUMENTATION = r"""
---
module: revision_prune
short_description: Remove old revisions of models from a Hugging Face cache, keeping the ones named
description:
  - For each repo in O(repos), removes every revision found in the Hugging Face hub cache O(cache_dir) that is
    not in O(keep), for upgrades and rollbacks that must make room for a new revision. Runs the same on the
    head and on a worker (whose rsynced copy has the same layout).
  - A revision is found by its snapshot directory (C(models--ORG--REPO/snapshots/SHA)), or only by the manifest
    (C(models--ORG--REPO/manifests/SHA.json), written by M(sparkops.glm53.hf_snapshot)) or the worker's marker
    (C(.glm53-sync/models--ORG--REPO@SHA.json), written by M(sparkops.glm53.snapshot_verify)) that a
    stopped download left behind.
  - Removing a revision removes its snapshot directory, the blobs only removed revisions link to, its manifest,
    its marker, its C(.no_exist/SHA) directory and the C(refs) files naming it. A blob a kept revision also
    links to stays. Partial C(.incomplete) blobs and blobs no snapshot links to are never touched.
  - A snapshot file that is a regular file rather than a link into C(blobs) counts its own size.
  - A repo none of whose revisions on this node is in O(keep) loses all of them. A revision in O(keep) that is
    not on this node is fine (it may be about to be downloaded).
version_added: "0.3.0"
author:
  - sparkops (!UNKNOWN)
options:
  cache_dir:
    description: The Hugging Face hub cache holding the C(models--ORG--REPO) directories (C(.../huggingface/hub)).
    type: path
    required: true
  repos:
    description: Repo ids (C(ORG/NAME)) whose old revisions to remove; other repos in the cache are not looked at.
    type: list
    elements: str
    required: true
  keep:
    description:
      - Commit shas (40 hex digits) never removed, whichever repo they belong to. Must name at least one.
      - A branch or tag name is refused, since it would match no snapshot and every revision would go.
    type: list
    elements: str
    required: true
  state:
    description:
      - C(pruned) removes the revisions not kept.
      - C(planned) only reports what C(pruned) would remove and free, and never reports a change.
    type: str
    choices: [pruned, planned]
    default: pruned
  needed_bytes:
    description:
      - Bytes the wanted revisions still need on this node (files not yet present). When given, the module also
        judges the disk (RV(disk)), the free space of the cache's filesystem against this, counting what a prune
        of the revisions not kept would free.
    type: int
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: full
    details: Reports what would be removed and freed; removes nothing.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
    support: none
  idempotent:
    description: When run twice in a row outside check mode, with the same arguments, the second invocation indicates no change.
    support: full
"""

EXAMPLES = r"""
- name: Keep only the pinned revisions of the model and the draft (and the previous model, for a rollback)
  sparkops.glm53.revision_prune:
    cache_dir: "{{ _glm53_hf_cache_dir }}/hub"
    repos: "{{ _glm53_checkpoints | map(attribute='repo') | list }}"
    keep:
      - "{{ glm53_model_revision }}"
      - "{{ glm53_draft_revision }}"
      - "{{ _glm53_previous_model_revision }}"

- name: How much would a prune free?
  sparkops.glm53.revision_prune:
    cache_dir: /home/glm53/.cache/huggingface/hub
    repos: [zai-org/GLM-5.3-EXL3]
    keep: [0123456789abcdef0123456789abcdef01234567]
    state: planned
  register: _glm53_prunable
"""

RETURN = r"""
pruned:
  description:
    - The revisions removed (with O(state=planned) or in check mode, that would be removed), each with the bytes
      of model data freed with it.
    - A blob shared by several removed revisions counts for the first of them only, so the bytes add up to
      RV(freed_bytes). Manifests, markers and refs are not counted.
  returned: always
  type: list
  elements: dict
  contains:
    repo_id:
      description: The repo.
      type: str
    revision:
      description: The commit sha.
      type: str
    bytes:
      description: Bytes freed with this revision.
      type: int
  sample:
    - {"repo_id": "zai-org/GLM-5.3-EXL3", "revision": "0123456789abcdef0123456789abcdef01234567", "bytes": 176093659136}
freed_bytes:
  description: Bytes freed in all (or that would be freed).
  returned: always
  type: int
kept:
  description: The revisions on this node that stay, of all repos in O(repos).
  returned: always
  type: list
  elements: str
disk:
  description:
    - The disk verdict when O(needed_bytes) is given; C(prunable_bytes) is what a prune of the revisions not kept
      would free (0 once this run pruned them), C(shortfall) the bytes still missing after it.
  returned: when O(needed_bytes) is given
  type: dict
  sample:
    free_bytes: 107374182400
    needed_bytes: 176093659136
    prunable_bytes: 176093659136
    fits_now: false
    fits_after_prune: true
    shortfall: 0
    message: "needs 164.0 GiB, 100.0 GiB free, 164.0 GiB prunable: fits only after pruning old revisions"
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sparkops.glm53.plugins.module_utils.revision_prune import (
    apply_prune,
    disk_verdict,
    free_bytes,
    is_commit_sha,
    plan_prune,
    scan_repo,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            cache_dir=dict(type="path", required=True),
            repos=dict(type="list", elements="str", required=True),
            keep=dict(type="list", elements="str", required=True),
            state=dict(type="str", choices=["pruned", "planned"], default="pruned"),
            needed_bytes=dict(type="int"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    empty = dict(changed=False, pruned=[], freed_bytes=0, kept=[])
    keep = [k.strip() for k in p["keep"] if k and k.strip()]
    if not keep:
        module.fail_json(msg="keep must name at least one revision (a commit sha) to keep; "
                             "with none, every revision of every repo would be removed", **empty)
    not_shas = [k for k in keep if not is_commit_sha(k)]
    if not_shas:
        module.fail_json(msg=f"keep takes commit shas (40 lowercase hex digits), not {not_shas}: a branch or tag "
                             "name matches no snapshot directory, so every revision would be removed", **empty)
    apply = p["state"] == "pruned" and not module.check_mode
    pruned: list[dict[str, object]] = []
    kept: list[str] = []
    freed = 0
    for repo_id in dict.fromkeys(p["repos"]):
        plan = plan_prune(scan_repo(p["cache_dir"], repo_id), keep)
        if apply and plan.changed:
            try:
                apply_prune(plan)
            except OSError as exc:
                # Some of this repo's files may be gone already: report a change.
                module.fail_json(msg=f"pruning {repo_id} in {p['cache_dir']}: {exc}", changed=True,
                                 pruned=pruned, freed_bytes=freed, kept=kept)
        pruned.extend({"repo_id": repo_id, "revision": r.revision, "bytes": r.bytes} for r in plan.delete)
        kept.extend(plan.kept)
        freed += plan.freed_bytes
    result: dict[str, object] = dict(changed=bool(pruned) and p["state"] == "pruned", pruned=pruned, freed_bytes=freed,
                                     kept=kept)
    if p["needed_bytes"] is not None:
        verdict = disk_verdict(free_bytes(p["cache_dir"]), p["needed_bytes"], 0 if apply else freed)
        result["disk"] = dict(free_bytes=verdict.free_bytes, needed_bytes=verdict.needed_bytes,
                              prunable_bytes=verdict.prunable_bytes, fits_now=verdict.fits_now,
                              fits_after_prune=verdict.fits_after_prune, shortfall=verdict.shortfall,
                              message=verdict.message)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
