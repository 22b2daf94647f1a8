#!/usr/bin/python
# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_quality
short_description: Check a served model's next-token distributions against a teacher's reference set
version_added: 0.1.0
description:
  - Runs on the head. Reads a reference set (docs/quality-gate.md) from O(reference_dir), the
    teacher's top-k next-token log-probabilities over token windows, and sends each window to the
    served OpenAI API as C(POST /v1/completions) with the token ids as the prompt, C(max_tokens=1) and
    vLLM's C(prompt_logprobs) set to the set's top-k.
  - Scores every position by KL(teacher || served) over the teacher's top-k plus one bucket for the rest
    of the vocabulary (full-vocabulary probabilities, not renormalised; the smallest divergence both
    reports allow, so never above the true one), and by top-1 agreement. Reports both per window and
    position-weighted overall, and names the O(worst) windows.
  - Fails when the mean KLD exceeds O(max_kld) or the top-1 agreement is below O(min_top1); the message
    carries both numbers, the thresholds and the worst windows. A request that fails or an answer
    without C(prompt_logprobs) fails too, with the response as evidence.
  - Writes the report as JSON to O(report_path) (pass or fail) and returns it as RV(report).
  - Token ids in, token ids out; the server's tokenizer and chat template play no part, so the windows
    must have been rendered the way the served model is prompted (the set records how).
author:
  - sparkops (!UNKNOWN)
extends_documentation_fragment:
  - sparkops.glm53.openai_api
options:
  reference_dir:
    description: Directory holding the set's C(reference.json) and windows file (a downloaded snapshot).
    type: path
    required: true
  reference_id:
    description: How the report names the set, e.g. C(ORG/REPO@SHA).
    type: str
    default: ""
  max_kld:
    description: Largest mean KL divergence (nats) that passes.
    type: float
    required: true
  min_top1:
    description: Smallest share of positions (0 to 1) whose served top-1 token is the teacher's that passes.
    type: float
    required: true
  worst:
    description: Number of worst windows (by mean KLD) named in the message and the report.
    type: int
    default: 3
  request_timeout:
    description: Seconds allowed for each window's request.
    type: float
    default: 600
  report_path:
    description: Where on the head to write the JSON report; its directory is created.
    type: path
  served_by:
    description:
      - Names the running ranks that answer (the role passes the head rank's container id and start time).
      - When set, and the report at O(report_path) passed with the same O(served_by), set, thresholds, URL and
        served name, the gate is not measured again and that report is returned with RV(reused) true. The ranks
        cannot change what they compute without a restart, which gives a new O(served_by). Empty always measures.
    type: str
    default: ""
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: partial
    details:
      - In check mode the module reads and validates the reference set and asks C(/v1/models) once; it
        sends no window, writes no report, never fails on the API, and returns RV(would_score).
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
    support: none
  idempotent:
    description: When run twice in a row outside check mode, with the same arguments, the second invocation indicates no change.
    support: full
    details: It only reads; RV(changed) is always false (the report file is evidence, not state).
notes:
  - Uses only the Python standard library on the head.
  - The server must allow C(prompt_logprobs) of the set's top-k (vLLM's C(--max-logprobs), 20 by default).
"""

EXAMPLES = r"""
- name: Quality gate against the BF16 teacher set
  sparkops.glm53.vllm_quality:
    served_model_name: GLM-5.3-Flash-EXL3
    reference_dir: /home/spark/.cache/huggingface/hub/models--ORG--SET/snapshots/0123abc
    reference_id: ORG/SET@0123abc
    max_kld: 0.08
    min_top1: 0.9
    report_path: /home/spark/.cache/glm53/quality/last.json
  register: glm53_quality
  failed_when: false
"""

RETURN = r"""
changed:
  description: Always false.
  type: bool
  returned: always
passed:
  description: Whether both thresholds held.
  type: bool
  returned: when every window was scored
kld:
  description: Position-weighted mean KL(teacher || served) in nats.
  type: float
  returned: when every window was scored
top1:
  description: Share of positions whose served top-1 token is the teacher's.
  type: float
  returned: when every window was scored
report:
  description:
    - The full report also written to O(report_path) (format C(sparkops-glm53-quality-report) version 1).
    - Keys time, passed, reasons, kld, top1, max_kld, min_top1, positions, worst_windows, windows,
      served_model_name, url, served_by, reference, elapsed_s; each window row has id, kind, positions, kld, top1,
      max_position_kld, worst_position, teacher_top1_there, served_top1_there.
  type: dict
  returned: when every window was scored
reused:
  description: True when an earlier passing report for the same running ranks was returned instead of measuring.
  type: bool
  returned: when O(served_by) matched a passing report
would_score:
  description: Windows and positions the set holds (check mode).
  type: dict
  returned: in check mode
api:
  description: What C(GET /v1/models) answered (check mode).
  type: str
  returned: in check mode
"""

import time
from datetime import datetime, timezone

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sparkops.glm53.plugins.module_utils.health import api_headers, openai_api_options, urllib_http
from ansible_collections.sparkops.glm53.plugins.module_utils.quality import (
    GateConfig,
    GateIO,
    QualityError,
    Thresholds,
    load_reference,
    read_report,
    reusable_pass,
    run_gate,
    write_report,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            **openai_api_options(),
            reference_dir=dict(type="path", required=True),
            reference_id=dict(type="str", default=""),
            max_kld=dict(type="float", required=True),
            min_top1=dict(type="float", required=True),
            worst=dict(type="int", default=3),
            request_timeout=dict(type="float", default=600),
            report_path=dict(type="path"),
            served_by=dict(type="str", default=""),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if p["max_kld"] < 0 or not 0 <= p["min_top1"] <= 1 or p["worst"] < 0 or p["request_timeout"] <= 0:
        module.fail_json(msg="max_kld must be >= 0, min_top1 within 0..1, worst >= 0 and request_timeout > 0")
    try:
        reference = load_reference(p["reference_dir"])
    except QualityError as exc:
        module.fail_json(msg=str(exc), changed=False)
    config = GateConfig(
        url=p["url"], served_model_name=p["served_model_name"], api_key=p["api_key"],
        thresholds=Thresholds(max_kld=p["max_kld"], min_top1=p["min_top1"]),
        request_timeout=p["request_timeout"], worst_count=p["worst"], reference_id=p["reference_id"],
        served_by=p["served_by"],
    )
    earlier = read_report(p["report_path"]) if p["report_path"] else None
    if earlier is not None and reusable_pass(earlier, config):
        module.exit_json(changed=False, reused=True, passed=True, kld=earlier.get("kld"), top1=earlier.get("top1"),
                         report=earlier, msg="quality gate: passed at %s against these same running ranks (%s); "
                         "not measured again" % (earlier.get("time", "?"), p["served_by"]))

    if module.check_mode:
        models = urllib_http("GET", p["url"].rstrip("/") + "/v1/models", api_headers(p["api_key"]), None, 10.0)
        module.exit_json(changed=False, api=models.describe(), would_score={
            "windows": len(reference.windows), "positions": reference.positions, "top_k": reference.top_k})

    io = GateIO(http=urllib_http, clock=time.monotonic,
                now_iso=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    outcome = run_gate(config, reference, io)
    if outcome.report and p["report_path"]:
        try:
            write_report(p["report_path"], outcome.report)
        except OSError as exc:
            module.fail_json(msg="%s; the report could not be written to %s: %s" % (outcome.msg, p["report_path"], exc))
    result = {"changed": False, "msg": outcome.msg}
    if outcome.report:
        result.update(passed=outcome.report["passed"], kld=outcome.report["kld"], top1=outcome.report["top1"],
                      report=outcome.report)
    if outcome.failed:
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
