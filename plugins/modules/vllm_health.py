#!/usr/bin/python
# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_health
short_description: Wait until a multi-node vLLM launch serves, failing fast when a rank container dies
version_added: 0.1.0
description:
  - Runs on the head node. Every O(poll_interval) seconds it inspects each rank's container
    (C(docker inspect), locally or over C(ssh -o BatchMode=yes) to the rank's node) and probes the
    OpenAI API on the head (C(GET /health), then C(GET /v1/models)).
  - A rank whose container has exited (or is dead) fails the task at once; a container that is not
    running (created, restarting, missing, node unreachable) on O(not_running_polls) polls in a row fails
    it too. The failure names the node and rank and carries the container's last O(log_tail) log lines,
    so a dead worker is noticed in seconds instead of at the ready timeout. When several ranks are found
    dead in one poll, the one whose container exited first is named (a head whose worker vanished exits
    too; the worker is the cause) and the others are listed after it.
  - Once O(served_model_name) is listed, sends O(warmup_requests) warmup chat requests and then a
    canary chat request (temperature 0, thinking off through top-level C(chat_template_kwargs)). The
    canary's answer must be non-empty, not a single character repeated, and match
    O(canary.expect_regex) when given; an engine that passes C(/health) but answers garbage fails here
    with the response body as evidence.
  - A served-model list without O(served_model_name), or a rejected O(api_key), fails at once (the list
    does not change while vLLM runs).
  - Never reports C(changed); it only observes.
author:
  - sparkops (!UNKNOWN)
extends_documentation_fragment:
  - sparkops.glm53.openai_api
options:
  timeout:
    description: Seconds to wait for the API to become ready (weights and CUDA graphs are slow).
    type: float
    default: 3600
  poll_interval:
    description: Seconds between polls.
    type: float
    default: 5
  not_running_polls:
    description: Consecutive polls a rank container may be seen not running (but not exited) before failing.
    type: int
    default: 3
  request_timeout:
    description: Seconds allowed for each warmup and canary chat request (the first one may JIT-compile).
    type: float
    default: 600
  ranks:
    description: The rank containers to watch. Empty means API checks only.
    type: list
    elements: dict
    default: []
    suboptions:
      rank:
        description: Node rank (0 is the head).
        type: int
        required: true
      node:
        description: Inventory name of the node, used in messages.
        type: str
        required: true
      container:
        description: Name of the rank's container on that node.
        type: str
        required: true
      ssh:
        description:
          - C(user@host) to reach the node from the head with C(ssh -o BatchMode=yes).
          - Null runs C(docker) locally on the head.
        type: str
  log_tail:
    description: Lines of C(docker logs) to return for a failed rank or on timeout.
    type: int
    default: 40
  canary:
    description: The chat request that must be answered coherently.
    type: dict
    default: {}
    suboptions:
      prompt:
        description: User message.
        type: str
        default: "Reply with one short sentence: what is the capital of France?"
      max_tokens:
        description: Completion token limit.
        type: int
        default: 32
      expect_regex:
        description:
          - Python regular expression the answer must contain (C(re.search)). Use a prompt with a checkable
            answer; an engine with broken kernels can answer fluent text that is empty of meaning.
          - A pattern that does not compile fails the module before any request.
        type: str
      enable_thinking:
        description: Value of C(chat_template_kwargs.enable_thinking).
        type: bool
        default: false
  warmup_requests:
    description: Chat requests sent (and not judged) before the canary.
    type: int
    default: 1
  wait:
    description:
      - Whether to wait for the API. With V(false) the module looks once; when the API serves, it warms up and
        asks the canary as usual, and when it does not serve yet (and no rank has died), it returns
        RV(ready=false) without failing.
      - The action plugin makes such a look in the foreground first, so that a run whose engine already serves
        is not a background job with its status polls.
    type: bool
    default: true
  progress_file:
    description:
      - Path on the head where a JSON record C({elapsed_s, phase, last_log_line, polls, timeout_s}) is
        written after every poll, for a controller-side reader to show progress.
      - C(last_log_line) is the head container's newest log line.
    type: path
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: partial
    details:
      - In check mode the module makes one probe without waiting (container states, C(/health),
        C(/v1/models)), sends no warmup or canary request, and reports what it saw in RV(ready)
        without failing when vLLM is not up.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
    support: none
  idempotent:
    description: When run twice in a row outside check mode, with the same arguments, the second invocation indicates no change.
    support: full
    details: It only reads state; RV(changed) is always false.
notes:
  - Outside check mode and without C(async), the collection's action plugin runs the module in the
    background and prints, every 20 s on the controller, the elapsed time, the phase and the head
    container's newest log line (read from O(progress_file); a temporary one is used when unset).
  - Needs the C(docker) CLI on the head (and C(ssh) for remote ranks, with key-based login to them);
    uses only the Python standard library.
"""

EXAMPLES = r"""
- name: Wait for GLM-5.3 Flash to serve on both Sparks
  sparkops.glm53.vllm_health:
    served_model_name: GLM-5.3-Flash-EXL3
    api_key: "{{ glm53_api_key | default(omit) }}"
    timeout: 3600
    ranks:
      - {rank: 0, node: spark1, container: glm53-rank0, ssh: null}
      - {rank: 1, node: spark2, container: glm53-rank1, ssh: "root@10.0.0.2"}
    canary:
      prompt: "What is 2+3? Answer with the number only."
      max_tokens: 8
      expect_regex: "5"
    progress_file: /tmp/glm53-health.json
  register: glm53_health

- name: Quick look in check mode (never fails when down)
  sparkops.glm53.vllm_health:
    served_model_name: GLM-5.3-Flash-EXL3
  check_mode: true
  register: glm53_probe
"""

RETURN = r"""
changed:
  description: Always false.
  type: bool
  returned: always
ready:
  description: Whether vLLM served the model (and, outside check mode, passed the canary).
  type: bool
  returned: success
phase:
  description: Last phase reached, one of waiting_health, waiting_models, warmup, canary, ready, failed.
  type: str
  returned: always
elapsed_s:
  description: Seconds spent in the module.
  type: float
  returned: always
ready_after_s:
  description: Seconds until C(/v1/models) listed the served model.
  type: float
  returned: when the API became ready
polls:
  description: Number of polls made.
  type: int
  returned: always
models:
  description: Model ids listed by C(/v1/models).
  type: list
  elements: str
  returned: when C(/v1/models) answered
warmup_s:
  description: Seconds spent on warmup requests.
  type: float
  returned: when the API became ready
warmup_statuses:
  description: HTTP status of each warmup request (0 when no answer came).
  type: list
  elements: int
  returned: when the API became ready
canary_text:
  description: The canary's answer.
  type: str
  returned: when the canary ran
  sample: The capital of France is Paris.
canary_finish_reason:
  description: The canary choice's finish_reason.
  type: str
  returned: when the canary ran
canary_completion_tokens:
  description: Completion tokens the canary used.
  type: int
  returned: when the canary ran
canary_status:
  description: HTTP status of the failed canary request (0 when no answer came).
  type: int
  returned: when the canary failed
canary_body:
  description: Body of the failed canary response (first 4000 characters), the evidence.
  type: str
  returned: when the canary failed
rank_states:
  description: Last seen container state per rank, e.g. C(running) or C(exited (exit code 137)).
  type: dict
  returned: always
failed_rank:
  description: Rank whose container failed.
  type: int
  returned: when a rank container failed
failed_node:
  description: Inventory name of the node of the failed rank.
  type: str
  returned: when a rank container failed
failed_container:
  description: Container name of the failed rank.
  type: str
  returned: when a rank container failed
failed_at:
  description: Docker's time (RFC 3339) when the failed rank's container exited; null when it did not exit.
  type: str
  returned: when a rank container failed
failed_ranks:
  description: Every rank found failed in the same poll, the first to exit first.
  type: list
  elements: dict
  returned: when a rank container failed
  contains:
    rank:
      description: Node rank.
      type: int
    node:
      description: Inventory name of the node.
      type: str
    container:
      description: Container name.
      type: str
    state:
      description: The container's state, e.g. C(exited (exit code 137)).
      type: str
    finished_at:
      description: When the container exited (docker's RFC 3339 time), or null.
      type: str
log_tail:
  description: Last log lines of the failed rank's container, or of the head's on timeout.
  type: list
  elements: str
  returned: on failure by a rank or by timeout
api:
  description: What the API probe saw (check mode).
  type: str
  returned: in check mode
ranks_running:
  description: Whether every rank container was running (check mode).
  type: bool
  returned: in check mode
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sparkops.glm53.plugins.module_utils.health import (
    Canary,
    HealthConfig,
    HealthIO,
    HealthWaiter,
    Rank,
    openai_api_options,
    pattern_error,
    progress_file_writer,
    subprocess_runner,
    urllib_http,
)

RANK_OPTIONS = dict(
    rank=dict(type="int", required=True),
    node=dict(type="str", required=True),
    container=dict(type="str", required=True),
    ssh=dict(type="str"),
)
CANARY_OPTIONS = dict(
    prompt=dict(type="str", default="Reply with one short sentence: what is the capital of France?"),
    # A token count, not a secret (validate-modules guesses secrets from the word "token").
    max_tokens=dict(type="int", default=32, no_log=False),
    expect_regex=dict(type="str"),
    enable_thinking=dict(type="bool", default=False),
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            **openai_api_options(),
            timeout=dict(type="float", default=3600),
            poll_interval=dict(type="float", default=5),
            not_running_polls=dict(type="int", default=3),
            request_timeout=dict(type="float", default=600),
            ranks=dict(type="list", elements="dict", default=[], options=RANK_OPTIONS),
            log_tail=dict(type="int", default=40),
            canary=dict(type="dict", default={}, options=CANARY_OPTIONS),
            warmup_requests=dict(type="int", default=1),
            progress_file=dict(type="path"),
            wait=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if p["not_running_polls"] < 1 or p["poll_interval"] <= 0 or p["timeout"] < 0:
        module.fail_json(msg="not_running_polls must be >= 1, poll_interval > 0 and timeout >= 0")
    regex_error = pattern_error(p["canary"].get("expect_regex"))
    if regex_error:
        module.fail_json(msg="canary.expect_regex does not compile: %s" % regex_error)
    config = HealthConfig(
        url=p["url"],
        served_model_name=p["served_model_name"],
        ranks=[Rank.from_dict(r) for r in p["ranks"]],
        api_key=p["api_key"],
        timeout=p["timeout"],
        poll_interval=p["poll_interval"],
        log_tail=p["log_tail"],
        canary=Canary.from_dict(p["canary"]),
        warmup_requests=p["warmup_requests"],
        not_running_polls=p["not_running_polls"],
        request_timeout=p["request_timeout"],
        wait=p["wait"],
    )
    progress = progress_file_writer(p["progress_file"]) if p["progress_file"] else None
    waiter = HealthWaiter(config, HealthIO(run=subprocess_runner, http=urllib_http, progress=progress))

    if module.check_mode:
        module.exit_json(**waiter.probe())

    outcome = waiter.run()
    if outcome.failed:
        module.fail_json(msg=outcome.msg, **outcome.result)
    module.exit_json(msg=outcome.msg, **outcome.result)


if __name__ == "__main__":
    main()
