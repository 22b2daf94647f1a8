#!/usr/bin/python
# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
from __future__ import annotations

DOCUMENTATION = r"""
---
module: overlay_selfcheck
short_description: Run the GLM-5.3 overlay self-check inside an engine image
version_added: 0.1.0
description:
  - >-
      Runs C(docker run DOCKER_RUN_ARGS -e ENV IMAGE glm53-overlay selfcheck) on the target (the head)
      and parses the JSON report it prints,
      C({"ok": bool, "checks": [{"name", "ok", "detail", "skipped"}], "versions": {}}).
  - Fails, naming the first failing check and its detail, when the report is not ok, when any check
    failed, when a check named in O(must_run) was skipped or is missing, or when the output holds no
    such JSON report (then stderr is the evidence).
  - Text logged before the report (vLLM plugin logs) is ignored; the last JSON object printed counts.
  - A container name is added when O(docker_run_args) has none, so a run that overruns O(timeout) is
    removed with C(docker rm -f).
author:
  - sparkops (!UNKNOWN)
options:
  image:
    description: Image reference to check.
    type: str
    required: true
  command:
    description: Command run in the image.
    type: list
    elements: str
    default: [glm53-overlay, selfcheck]
  docker_run_args:
    description: Arguments placed between C(docker run) and the image.
    type: list
    elements: str
    default: ["--rm", "--network", "none"]
  env:
    description: Environment variables for the container; treated as secret (hidden in RV(cmd) and logs).
    type: dict
    default: {}
  timeout:
    description: Seconds the self-check may run.
    type: float
    default: 600
  must_run:
    description:
      - Checks that may not report themselves skipped, e.g. the EXL3 GPU checks of an image meant for
        GPUs (they skip when the container sees no GPU).
    type: list
    elements: str
    default: []
  record_dir:
    description:
      - Directory on the target where a passed self-check is recorded, one file per image ID, O(command),
        O(docker_run_args), O(env) and O(must_run) (environment values enter only through a hash).
      - When a record for the image's current ID exists, the check is not run again and RV(cached) is true;
        an image cannot change under its ID, so an unchanged image passes as it passed. Any rebuild is a new
        ID and is checked. Delete the directory to force a new run.
      - Omitted, the check runs every time and nothing is recorded. Nothing is written in check mode.
    type: path
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: full
    details: The self-check only reads the image, so it runs in check mode too.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
    support: none
  idempotent:
    description: When run twice in a row outside check mode, with the same arguments, the second invocation indicates no change.
    support: full
    details: RV(changed) is always false.
notes:
  - Needs the C(docker) CLI on the target; uses only the Python standard library.
"""

EXAMPLES = r"""
- name: Self-check the engine image before shipping it to the workers
  sparkops.glm53.overlay_selfcheck:
    image: "{{ glm53_engine_image }}"
    env:
      VLLM_TARGET_DEVICE: cpu
  register: glm53_selfcheck

- name: Self-check an image once per image ID, recording the pass on the head
  sparkops.glm53.overlay_selfcheck:
    image: "{{ glm53_engine_image }}"
    record_dir: "{{ ansible_env.HOME }}/.cache/glm53/selfcheck"

- name: Self-check a GPU image on the GPU, requiring its kernel checks
  sparkops.glm53.overlay_selfcheck:
    image: "{{ glm53_engine_image }}"
    docker_run_args: [--rm, --network, none, --gpus, all]
    must_run: [exl3_cuda_kernels, exl3_gemm_k4_mcg, exl3_moe_apply, exl3_moe_cuda_graph]

- name: Show the versions found in the image
  ansible.builtin.debug:
    var: glm53_selfcheck.versions
"""

RETURN = r"""
changed:
  description: Always false.
  type: bool
  returned: always
ok:
  description: Whether the self-check passed.
  type: bool
  returned: when a report was parsed
checks:
  description: Each check with its C(name), C(ok), C(detail) and C(skipped).
  type: list
  elements: dict
  returned: when a report was parsed
  sample: [{"name": "exl3_quantization_registered", "ok": true, "skipped": false,
            "detail": "exl3 -> glm53_overlay.exl3.config.Exl3Config"}]
versions:
  description: Versions the self-check reports (vLLM, torch, overlay, ...).
  type: dict
  returned: when a report was parsed
  sample: {"vllm": "0.33.0", "glm53_overlay": "0.1.0"}
cached:
  description: True when a recorded pass for this image ID was used instead of running the check (O(record_dir)).
  type: bool
  returned: always
record:
  description: The record file used or written; absent when O(record_dir) is not set or nothing passed.
  type: str
  returned: when a record was used or written
rc:
  description: Exit status of C(docker run); 0 when RV(cached) is true.
  type: int
  returned: always
stderr:
  description: Last 4000 characters of stderr.
  type: str
  returned: always
cmd:
  description: The docker command run, environment values masked.
  type: list
  elements: str
  returned: always
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sparkops.glm53.plugins.module_utils.health import subprocess_runner
from ansible_collections.sparkops.glm53.plugins.module_utils.selfcheck import (
    DEFAULT_COMMAND,
    DEFAULT_RUN_ARGS,
    OUTPUT_LIMIT,
    container_name_of,
    docker_run_argv,
    evaluate,
    masked_argv,
    record_name,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            image=dict(type="str", required=True),
            command=dict(type="list", elements="str", default=list(DEFAULT_COMMAND)),
            docker_run_args=dict(type="list", elements="str", default=list(DEFAULT_RUN_ARGS)),
            env=dict(type="dict", default={}, no_log=True),
            timeout=dict(type="float", default=600),
            must_run=dict(type="list", elements="str", default=[]),
            record_dir=dict(type="path"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    argv = docker_run_argv(p["image"], p["command"], p["docker_run_args"], p["env"])
    result = {"changed": False, "cached": False, "cmd": masked_argv(argv)}

    record = None
    if p["record_dir"]:
        rc, image_id, _err = subprocess_runner(["docker", "image", "inspect", "--format", "{{.Id}}", p["image"]], 60, False)
        # An image that cannot be inspected is left to the run below, which fails with docker's own words.
        if rc == 0 and image_id.strip():
            record = os.path.join(p["record_dir"], record_name(image_id.strip(), p["command"], p["docker_run_args"],
                                                               p["env"], p["must_run"]))
            recorded = _read(record)
            verdict = evaluate(0, recorded, "", p["must_run"]) if recorded else None
            if verdict is not None and verdict.ok and verdict.report is not None:
                result.update(cached=True, record=record, rc=0, stderr="", ok=True,
                              checks=[check.as_dict() for check in verdict.report.checks],
                              versions=verdict.report.versions)
                module.exit_json(msg="%s for image %s before; not run again (record %s)"
                                 % (verdict.msg, image_id.strip()[:19], record), **result)

    rc, out, err = subprocess_runner(argv, p["timeout"], False)
    result.update(rc=rc, stderr=err[-OUTPUT_LIMIT:])
    if rc == 124:
        name = container_name_of(argv[2:])
        if name:
            subprocess_runner(["docker", "rm", "-f", name], 60, False)
        module.fail_json(msg="overlay selfcheck did not finish within %ss" % p["timeout"], **result)

    verdict = evaluate(rc, out, err, p["must_run"])
    if verdict.report is not None:
        result.update(
            ok=verdict.ok,
            checks=[check.as_dict() for check in verdict.report.checks],
            versions=verdict.report.versions,
        )
    if not verdict.ok:
        module.fail_json(msg=verdict.msg, **result)
    if record and not module.check_mode and verdict.report is not None:
        os.makedirs(p["record_dir"], exist_ok=True)
        with open(record, "w") as handle:
            json.dump({"ok": True, "checks": result["checks"], "versions": result["versions"]}, handle)
        result["record"] = record
    module.exit_json(msg=verdict.msg, **result)


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return ""


if __name__ == "__main__":
    main()
