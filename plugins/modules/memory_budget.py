#!/usr/bin/python
# -*- coding: utf-8 -*-
# SPDX-License-Identifier: MIT
from __future__ import annotations

DOCUMENTATION = r"""
---
module: memory_budget
short_description: Judge a node's memory against the vLLM memory settings, optionally after dropping clean page cache
description:
  - Reads C(/proc/meminfo) and reports what the node can give one rank, and which
    C(glm53_gpu_memory_utilization) or C(glm53_kv_cache_memory_bytes) fits there.
  - On a GPU node (unified memory, GB10) the page cache is not counted as free, because CUDA does not get it
    back reliably; it is counted only when O(page_cache_dropped) says it will have been dropped before the
    ranks start. On a CPU node the rule is vLLM-CPU's own, MemAvailable.
  - With O(drop_page_cache), first syncs and writes C(1) to C(/proc/sys/vm/drop_caches) (clean page cache
    only), then reads C(/proc/meminfo) again and judges the settings on what is there after the drop. Where
    the write is not permitted (not root, or a container with a read-only C(/proc/sys)) the drop is
    C(skipped) with the reason and the settings are judged on the memory as it is.
  - Never fails because a setting does not fit; the caller decides what to do with RV(problems).
version_added: "0.2.0"
author:
  - sparkops (!UNKNOWN)
options:
  gpu:
    description: The node runs the engine on a unified-memory GPU (GB10). false is a CPU engine (simulation).
    type: bool
    required: true
  gpu_memory_utilization:
    description: The C(glm53_gpu_memory_utilization) to judge.
    type: float
    required: true
  kv_cache_memory_bytes:
    description: The C(glm53_kv_cache_memory_bytes) to judge; 0 means the utilization sizes the KV cache.
    type: int
    default: 0
  max_model_len:
    description: The C(glm53_max_model_len); the KV cache must hold one request of this length.
    type: int
    default: 0
  weights_bytes:
    description: Weights this rank loads (its share of the checkpoint and the draft); 0 when unknown.
    type: int
    default: 0
  overhead_bytes:
    description: Activations, CUDA graphs and workspaces of one rank besides weights and KV cache; 0 when unknown.
    type: int
    default: 0
  kv_bytes_per_token:
    description: KV-cache bytes one token costs this rank; 0 when unknown (the max_model_len check is left out).
    type: int
    default: 0
  reserve_bytes:
    description: Memory that must stay free for the OS and the node's other programs once the rank is up.
    type: int
    default: 0
  page_cache_dropped:
    description:
      - Count clean page cache as free because it will be dropped before the ranks start (preflight planning).
      - Ignored with O(drop_page_cache), which measures after its own drop instead.
    type: bool
    default: false
  drop_page_cache:
    description: Sync and drop the clean page cache first (needs root; use become when the SSH user is not root).
    type: bool
    default: false
  meminfo_path:
    description: Where to read meminfo (tests point it elsewhere).
    type: path
    default: /proc/meminfo
  drop_caches_path:
    description: The kernel's drop_caches switch.
    type: path
    default: /proc/sys/vm/drop_caches
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: full
    details: Reads and judges for real; the page cache is not dropped (the returned C(drop.status) is C(would drop)).
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
    support: none
  idempotent:
    description: When run twice in a row outside check mode, with the same arguments, the second invocation indicates no change.
    support: partial
    details: Without O(drop_page_cache) it only reads. With it, every run drops what was cached since and reports C(changed).
"""

EXAMPLES = r"""
- name: What fits on this node (preflight)
  sparkops.glm53.memory_budget:
    gpu: true
    gpu_memory_utilization: 0.85
    max_model_len: 850000
    weights_bytes: "{{ 82 * 1024 ** 3 }}"
    overhead_bytes: "{{ 5 * 1024 ** 3 }}"
    kv_bytes_per_token: 17014
    reserve_bytes: "{{ 4 * 1024 ** 3 }}"
    page_cache_dropped: true
  register: memory

- name: Drop clean page cache after the weight sync, then judge again
  sparkops.glm53.memory_budget:
    gpu: true
    gpu_memory_utilization: 0.85
    drop_page_cache: true
  become: true
"""

RETURN = r"""
meminfo:
  description:
    - The memory the settings were judged on (after the drop when one ran), in bytes, with C(cuda_free_now)
      (MemAvailable minus page cache) and C(cuda_free_after_drop) (minus only mapped file pages).
  returned: always
  type: dict
budget:
  description:
    - C(counted_free), C(requested) (utilization x total), C(max_utilization), C(max_kv_cache_memory_bytes)
      (null when the weights are unknown), C(kv_cache_bytes) the settings give, C(min_kv_cache_bytes) one
      max-length request needs, C(problems), C(unknown) (what could not be judged).
  returned: always
  type: dict
problems:
  description: Each setting that cannot boot on this node, naming its variable and a value that fits.
  returned: always
  type: list
  elements: str
drop:
  description:
    - C(status) (C(dropped), C(skipped), C(would drop), or C(not asked)), C(reason), C(page_cache_before),
      C(page_cache_after), C(freed_bytes), C(cuda_free_before), C(cuda_free_after).
  returned: always
  type: dict
summary:
  description: One line saying what the node has and what fits, then what the drop did.
  returned: always
  type: str
"""

import os
import platform

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sparkops.glm53.plugins.module_utils.memory_budget import (
    BudgetRequest,
    DropOutcome,
    MemInfo,
    drop_page_cache,
    parse_meminfo,
    plan_memory,
    summary,
)


def _read(path: str) -> MemInfo:
    with open(path, encoding="ascii") as handle:
        return parse_meminfo(handle.read())


def _write_one(path: str) -> None:
    with open(path, "w", encoding="ascii") as handle:
        handle.write("1\n")


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            gpu=dict(type="bool", required=True),
            gpu_memory_utilization=dict(type="float", required=True),
            kv_cache_memory_bytes=dict(type="int", default=0),
            max_model_len=dict(type="int", default=0),
            weights_bytes=dict(type="int", default=0),
            overhead_bytes=dict(type="int", default=0),
            # "token" here counts KV-cache positions, it is no credential.
            kv_bytes_per_token=dict(type="int", default=0, no_log=False),
            reserve_bytes=dict(type="int", default=0),
            page_cache_dropped=dict(type="bool", default=False),
            drop_page_cache=dict(type="bool", default=False),
            meminfo_path=dict(type="path", default="/proc/meminfo"),
            drop_caches_path=dict(type="path", default="/proc/sys/vm/drop_caches"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    try:
        if p["drop_page_cache"]:
            drop = drop_page_cache(lambda: _read(p["meminfo_path"]), os.sync, lambda: _write_one(p["drop_caches_path"]),
                                   path=p["drop_caches_path"], euid=os.geteuid(), check_mode=module.check_mode)
        else:
            drop = DropOutcome("not asked", "drop_page_cache is false", _read(p["meminfo_path"]))
    except (OSError, ValueError) as exc:
        module.fail_json(msg=f"cannot read {p['meminfo_path']}: {exc}")
    mem = drop.after or drop.before
    request = BudgetRequest(
        gpu=p["gpu"], gpu_memory_utilization=p["gpu_memory_utilization"],
        kv_cache_memory_bytes=p["kv_cache_memory_bytes"], max_model_len=p["max_model_len"],
        weights_bytes=p["weights_bytes"], overhead_bytes=p["overhead_bytes"],
        kv_bytes_per_token=p["kv_bytes_per_token"], reserve_bytes=p["reserve_bytes"],
        # After a real drop the meminfo already shows it and a skipped one must not be counted as done; a drop
        # that check mode only announces is planned for.
        page_cache_dropped=drop.status == "would drop" or (p["page_cache_dropped"] and not p["drop_page_cache"]),
    )
    budget = plan_memory(mem, request)
    line = summary(platform.node(), mem, request, budget)
    if p["drop_page_cache"]:
        line += "; " + drop.describe()
    module.exit_json(changed=drop.status == "dropped", meminfo=mem.as_dict(), budget=budget.as_dict(),
                     problems=budget.problems, drop=drop.as_dict(), summary=line)


if __name__ == "__main__":
    main()
