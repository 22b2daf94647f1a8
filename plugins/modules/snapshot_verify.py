#!/usr/bin/python
# -*- coding: utf-8 -*-
# SPDX-License-Identifier: MIT
from __future__ import annotations

DOCUMENTATION = r"""
---
module: snapshot_verify
short_description: Verify a model snapshot against its manifest and keep a per-revision marker
description:
  - Checks every file listed in the manifest written by M(sparkops.glm53.hf_snapshot) for presence and
    size in the snapshot directory, following symlinks (Hugging Face snapshot directories link into
    C(../../blobs); rsync the whole C(models--ORG--REPO) directory with C(-a) so the links stay valid).
    Costs one stat per file and never reads file contents.
  - Writes the marker file only when the copy is complete, and removes a marker that would claim an
    incomplete copy. A marker whose revision matches lets later runs skip the rsync.
version_added: "0.1.0"
author:
  - sparkops (!UNKNOWN)
options:
  path:
    description: The snapshot directory to verify (C(.../models--ORG--REPO/snapshots/SHA)).
    type: path
    required: true
  manifest:
    description: The manifest JSON on this node (C(.../models--ORG--REPO/manifests/SHA.json) travels with the rsync).
    type: path
    required: true
  marker:
    description: The marker file; its content names the repo, revision, file count and total bytes.
    type: path
    required: true
  state:
    description: C(verified) makes sure the copy is complete and the marker says so.
    type: str
    choices: [verified]
    default: verified
  fail_on_incomplete:
    description:
      - Fail when files are missing or of the wrong size. Set to false to only learn C(complete), e.g. to
        decide whether an rsync is needed.
    type: bool
    default: true
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: full
    details: Verifies for real and reports whether the marker would be written or removed.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
    support: none
  idempotent:
    description: When run twice in a row outside check mode, with the same arguments, the second invocation indicates no change.
    support: full
"""

EXAMPLES = r"""
- name: Verify the worker's copy after rsync and mark the revision
  sparkops.glm53.snapshot_verify:
    path: "{{ _glm53_cache }}/models--sim--tiny-glm/snapshots/{{ _glm53_weights.revision }}"
    manifest: "{{ _glm53_cache }}/models--sim--tiny-glm/manifests/{{ _glm53_weights.revision }}.json"
    marker: "{{ _glm53_cache }}/.glm53-verified-{{ _glm53_weights.revision }}"

- name: Does this worker already hold the revision?
  sparkops.glm53.snapshot_verify:
    path: "{{ _glm53_snapshot }}"
    manifest: "{{ _glm53_manifest }}"
    marker: "{{ _glm53_marker }}"
    fail_on_incomplete: false
  register: _glm53_worker_copy
"""

RETURN = r"""
complete:
  description: Every manifest file is present with the listed size.
  returned: always
  type: bool
missing:
  description: Manifest files absent from the snapshot (or dangling links).
  returned: always
  type: list
  elements: str
wrong_size:
  description: Files whose size differs, each as C(path) mapped to C(expected) and C(found) sizes.
  returned: always
  type: dict
marker_written:
  description: The marker was written by this run (in check mode, would be).
  returned: always
  type: bool
marker_removed:
  description: A stale marker was removed because the copy is incomplete (in check mode, would be).
  returned: always
  type: bool
revision:
  description: The revision named by the manifest.
  returned: always
  type: str
files:
  description: Number of files in the manifest.
  returned: always
  type: int
total_bytes:
  description: Total size listed by the manifest.
  returned: always
  type: int
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sparkops.glm53.plugins.module_utils.snapshot_manifest import load_manifest, verify_snapshot


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            manifest=dict(type="path", required=True),
            marker=dict(type="path", required=True),
            state=dict(type="str", choices=["verified"], default="verified"),
            fail_on_incomplete=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    try:
        manifest = load_manifest(p["manifest"])
    except ValueError as exc:
        module.fail_json(msg=str(exc), complete=False, missing=[], wrong_size={},
                         marker_written=False, marker_removed=False)
    outcome = verify_snapshot(p["path"], manifest, p["marker"], module.check_mode)
    check = outcome.check
    result = dict(
        changed=outcome.changed,
        complete=check.complete,
        missing=list(check.missing),
        wrong_size={path: {"expected": exp, "found": got} for path, (exp, got) in check.wrong_size.items()},
        marker_written=outcome.marker_action == "write",
        marker_removed=outcome.marker_action == "remove",
        revision=manifest.revision,
        files=len(manifest.files),
        total_bytes=manifest.total_bytes,
    )
    if not check.complete and p["fail_on_incomplete"]:
        module.fail_json(
            msg=f"snapshot {p['path']} is incomplete: {len(check.missing)} missing, "
                f"{len(check.wrong_size)} of wrong size (first: {list(check.bad_paths)[:5]})",
            **result,
        )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
