#!/usr/bin/python
# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
from __future__ import annotations

DOCUMENTATION = r"""
---
module: image_ship
short_description: Ship a docker image to other hosts over ssh, exported and compressed once, with stall detection and retries
version_added: 0.1.0
description:
  - Runs C(docker image save) on the target (the head, through C(delegate_to)) and compresses the stream with
    C(zstd -T0), once, and sends it over C(ssh) to every one of O(destinations) at the same time, where
    C(zstd -dc | docker image load) loads it (as C(tee) would; the stream moves at the slowest destination's pace).
  - The module copies every byte between the stages itself, so it counts the bytes (raw and on the wire) and
    sees a stall, that is no byte moving for O(stall_timeout) seconds once C(docker image save) wrote its first
    byte (it exports every layer before that, which can take minutes for a large image; only O(timeout) bounds
    that wait). A destination that took no byte for that long is killed alone and the others go on; nothing
    moving at all kills every stage. The destinations that did not get the whole image start again together
    from the first byte, up to O(attempts) times, all within O(timeout) seconds.
  - C(docker image load) tags nothing until it has read the whole archive, so an interrupted ship leaves the
    destination's old image as it was.
  - ssh runs with C(BatchMode=yes), C(ConnectTimeout) and a keep-alive (C(ServerAliveInterval) x
    C(ServerAliveCountMax) about O(stall_timeout)), so a link that dies after the last byte, while the
    destination still loads the layers, ends the session too.
author:
  - sparkops (!UNKNOWN)
options:
  image:
    description: The image to ship, as the target's docker names it.
    type: str
    required: true
  destinations:
    description: Where to ship it, each shipped from the same export and compression.
    type: list
    elements: dict
    required: true
    suboptions:
      destination:
        description: C(user@host) for ssh; that user must be able to run docker there.
        type: str
        required: true
      name:
        description: How messages and the report name the destination (for example its inventory name).
        type: str
        default: ""
  compression_level:
    description: zstd compression level, 1 to 19.
    type: int
    required: true
  stall_timeout:
    description: Seconds without a byte moving after which an attempt is killed and started again.
    type: float
    required: true
  attempts:
    description: How many times to start the ship before failing, at least 1.
    type: int
    required: true
  timeout:
    description: Seconds all attempts together may take.
    type: float
    required: true
  connect_timeout:
    description: ssh's C(ConnectTimeout) in seconds.
    type: int
    default: 10
  hint:
    description: Appended to the failure message (for example which settings to change).
    type: str
    default: ""
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: full
    details:
      - Reports the command it would run and C(changed=true); ships nothing. The caller decides which
        destinations need the image (the module does not compare images).
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
    support: none
  idempotent:
    description: When run twice in a row outside check mode, with the same arguments, the second invocation indicates no change.
    support: none
    details: Every run ships; run it only when the destination's copy differs.
requirements:
  - docker and zstd on the target; ssh from the target to each destination; zstd and docker on each destination.
notes:
  - Only the Python standard library is used.
"""

EXAMPLES = r"""
- name: Ship the engine image from the head to two workers, exported and compressed once
  sparkops.glm53.image_ship:
    image: sparkops/glm53-engine:local
    destinations:
      - {destination: spark@10.0.0.2, name: spark2}
      - {destination: spark@10.0.0.3, name: spark3}
    compression_level: 3
    stall_timeout: 60
    attempts: 3
    timeout: 7200
  delegate_to: spark1
  register: ship

- name: Say how it went
  ansible.builtin.debug:
    msg: "{{ ship.reports }}"
"""

RETURN = r"""
reports:
  description: One line per destination saying how its ship went (time, bytes, ratio, attempts and why earlier ones
    failed), in the order of O(destinations).
  type: list
  elements: str
  returned: always
  sample: ["image ship to spark2: ok in 41.2 s, 21.3 GiB raw, 7.9 GiB on the wire (2.7x), 1 attempt"]
command:
  description: The pipeline, as a shell would write it (the module runs it without a shell).
  type: str
  returned: always
seconds:
  description: Seconds all attempts took together.
  type: float
  returned: always
raw_bytes:
  description: Bytes C(docker image save) produced in the last attempt.
  type: int
  returned: always
results:
  description: Each destination's ship, in the order of O(destinations).
  type: list
  elements: dict
  returned: always
  contains:
    name:
      description: The destination's name (O(destinations[].name), else its C(user@host)).
      type: str
    ok:
      description: Whether the destination loaded the whole image.
      type: bool
    seconds:
      description: Seconds from the start until the destination's last attempt ended.
      type: float
    wire_bytes:
      description: Compressed bytes handed to its ssh in its last attempt.
      type: int
    wire_bytes_total:
      description: Compressed bytes handed to its ssh over every attempt.
      type: int
    attempts:
      description: How many attempts it took part in.
      type: int
    attempt_log:
      description: Each attempt's outcome (C(ok), C(stalled), C(timed out), C(failed)), seconds, bytes and detail.
      type: list
      elements: dict
"""

import time
from dataclasses import asdict

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sparkops.glm53.plugins.module_utils.image_ship import (
    Policy,
    describe_stages,
    failure_message,
    report_line,
    ship,
    sink_stage,
    source_stages,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            image=dict(type="str", required=True),
            destinations=dict(type="list", elements="dict", required=True, options=dict(
                destination=dict(type="str", required=True),
                name=dict(type="str", default=""),
            )),
            compression_level=dict(type="int", required=True),
            stall_timeout=dict(type="float", required=True),
            attempts=dict(type="int", required=True),
            timeout=dict(type="float", required=True),
            connect_timeout=dict(type="int", default=10),
            hint=dict(type="str", default=""),
        ),
        supports_check_mode=True,
    )
    p = module.params
    policy = Policy(stall_timeout_s=p["stall_timeout"], attempts=p["attempts"], timeout_s=p["timeout"])
    problems = policy.errors()
    if not 1 <= p["compression_level"] <= 19:
        problems.append("compression_level must be in [1, 19] (got %d)" % p["compression_level"])
    if not p["destinations"]:
        problems.append("destinations must name at least one destination")
    if problems:
        module.fail_json(msg="; ".join(problems))
    names = [d["name"] or d["destination"] for d in p["destinations"]]
    sources = source_stages(p["image"], p["compression_level"])
    sinks = [sink_stage(d["destination"], p["stall_timeout"], p["connect_timeout"]) for d in p["destinations"]]
    command = describe_stages(sources, sinks)
    if module.check_mode:
        module.exit_json(changed=True, command=command, seconds=0.0, raw_bytes=0, results=[],
                         reports=["image ship to %s: would ship %s (%s)" % (name, p["image"], command)
                                  for name in names])
    started = time.monotonic()
    results = ship(sources, sinks, policy)
    answer = dict(
        command=command, seconds=round(time.monotonic() - started, 3),
        raw_bytes=max(r.raw_bytes for r in results),
        results=[dict(name=name, ok=r.ok, seconds=r.seconds, wire_bytes=r.wire_bytes,
                      wire_bytes_total=r.wire_bytes_total, attempts=len(r.attempts),
                      attempt_log=[asdict(a) for a in r.attempts]) for name, r in zip(names, results)],
        reports=[report_line(name, r) for name, r in zip(names, results)])
    failed = [(name, r) for name, r in zip(names, results) if not r.ok]
    if failed:
        module.fail_json(msg=failure_message(failed, p["hint"]), **answer)
    module.exit_json(changed=True, **answer)


if __name__ == "__main__":
    main()
