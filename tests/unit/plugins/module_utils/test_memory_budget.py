# SPDX-License-Identifier: MIT
from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.memory_budget import (
    GIB,
    BudgetRequest,
    MemInfo,
    drop_page_cache,
    parse_meminfo,
    plan_memory,
    summary,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "meminfo"
# One TP=2 rank of GLM-5.3 Flash EXL3 as the role passes it (roles/glm53/vars/main.yml has the sources).
RANK = dict(weights_bytes=82 * GIB, overhead_bytes=5 * GIB, kv_bytes_per_token=17014, reserve_bytes=4 * GIB)


def sample(name: str) -> MemInfo:
    return parse_meminfo((FIXTURES / f"{name}.txt").read_text())


def gpu(util: float = 0.85, **overrides: object) -> BudgetRequest:
    fields = dict(RANK, gpu=True, gpu_memory_utilization=util, max_model_len=850000)
    fields.update(overrides)
    return BudgetRequest(**fields)  # type: ignore[arg-type]


def named_utilization(message: str) -> float:
    return float(re.search(r"at most ([0-9.]+) fits", message).group(1))


def test_a_gb10_reports_about_121_gib_and_the_page_cache_lists():
    idle = sample("gb10-idle")
    assert 120 * GIB < idle.total < 122 * GIB
    assert idle.page_cache == (1245184 + 1900544) * 1024
    rsync = sample("gb10-after-rsync")
    assert rsync.page_cache > 100 * GIB and rsync.available > 110 * GIB


def test_page_cache_is_not_free_for_cuda_until_dropped():
    rsync = sample("gb10-after-rsync")
    assert rsync.cuda_free(page_cache_dropped=False) < 7 * GIB
    # Only the file pages mapped by running programs survive a drop.
    assert rsync.cuda_free(page_cache_dropped=True) == rsync.available - rsync.mapped


def test_boot_right_after_the_rsync_is_refused_naming_a_utilization_that_fits_now():
    budget = plan_memory(sample("gb10-after-rsync"), gpu(0.85))
    assert len(budget.problems) == 1
    message = budget.problems[0]
    assert message.startswith("glm53_gpu_memory_utilization=0.85 asks for")
    assert "page cache" in message
    assert named_utilization(message) == budget.max_utilization < 0.1
    assert message.endswith("(up to 0.9 once the page cache is dropped: glm53_drop_page_cache)")


def test_the_same_node_fits_once_the_page_cache_will_have_been_dropped():
    budget = plan_memory(sample("gb10-after-rsync"), gpu(0.85, page_cache_dropped=True))
    assert budget.problems == []
    assert budget.max_utilization >= 0.9


def test_a_cpu_node_counts_page_cache_as_vllm_cpu_does():
    rsync = sample("gb10-after-rsync")
    budget = plan_memory(rsync, BudgetRequest(gpu=False, gpu_memory_utilization=0.85))
    assert budget.counted_free == rsync.available
    assert budget.problems == []


def test_busy_spark_refuses_0_87_and_the_named_value_boots():
    busy = sample("gb10-busy")
    refused = plan_memory(busy, gpu(0.87))
    assert len(refused.problems) == 1
    fits = named_utilization(refused.problems[0])
    assert 0.7 < fits < 0.85
    assert plan_memory(busy, gpu(fits, max_model_len=0)).problems == []
    assert plan_memory(busy, gpu(round(fits + 0.01, 2))).problems != []


def test_idle_spark_boots_the_stock_defaults_with_room_for_850k_tokens():
    idle = sample("gb10-idle")
    budget = plan_memory(idle, gpu(0.85))
    assert budget.problems == [], budget.problems
    assert budget.kv_cache_bytes is not None and budget.kv_cache_bytes >= 850000 * 17014
    assert "utilization up to 0.89 fits" in summary("spark1", idle, gpu(0.85), budget)


def test_a_utilization_that_leaves_too_little_kv_cache_names_both_fixes():
    budget = plan_memory(sample("gb10-idle"), gpu(0.78))
    assert len(budget.problems) == 1
    message = budget.problems[0]
    assert "glm53_gpu_memory_utilization=0.78 leaves" in message
    needed = float(re.search(r"at least ([0-9.]+) is needed", message).group(1))
    assert plan_memory(sample("gb10-idle"), gpu(needed)).problems == []
    max_len = int(re.search(r"lower glm53_max_model_len to (\d+)", message).group(1))
    assert plan_memory(sample("gb10-idle"), gpu(0.78, max_model_len=max_len)).problems == []


def test_kv_cache_bytes_too_small_for_one_max_length_request_is_refused():
    budget = plan_memory(sample("gb10-idle"), gpu(kv_cache_memory_bytes=11811160064))
    assert len(budget.problems) == 1
    assert "glm53_kv_cache_memory_bytes=11811160064 holds about 694" in budget.problems[0]
    needed = int(re.search(r"at least (\d+) is needed", budget.problems[0]).group(1))
    assert plan_memory(sample("gb10-idle"), gpu(kv_cache_memory_bytes=needed)).problems == []


def test_kv_cache_bytes_larger_than_the_node_holds_names_what_fits():
    idle = sample("gb10-idle")
    budget = plan_memory(idle, gpu(kv_cache_memory_bytes=40 * GIB))
    assert len(budget.problems) == 1
    fits = int(re.search(r"at most (\d+) \(", budget.problems[0]).group(1))
    assert fits == budget.max_kv_cache_memory_bytes
    assert plan_memory(idle, gpu(kv_cache_memory_bytes=fits)).problems == []
    assert plan_memory(idle, gpu(kv_cache_memory_bytes=fits + 1)).problems != []


def test_kv_cache_bytes_still_meet_vllms_start_up_gate():
    busy = sample("gb10-busy")
    budget = plan_memory(busy, gpu(0.9, kv_cache_memory_bytes=15 * GIB))
    assert any(p.startswith("vLLM's start-up gate needs glm53_gpu_memory_utilization=0.9") for p in budget.problems)


def test_unknown_weights_are_reported_not_guessed():
    budget = plan_memory(sample("gb10-idle"), BudgetRequest(gpu=True, gpu_memory_utilization=0.85))
    assert budget.kv_cache_bytes is None and budget.max_kv_cache_memory_bytes is None
    assert budget.unknown == ["weights per rank", "activation and CUDA-graph overhead", "KV bytes per token"]


def test_sim_node_sample_parses():
    mem = sample("sim-node")
    assert mem.total > mem.available > mem.free > 0


@pytest.mark.parametrize("text, complaint", [
    ("MemTotal: 100 kB\nMemFree: 10 kB\n", "lacks MemAvailable"),
    ("MemTotal: lots kB\n", "cannot read 'MemTotal: lots kB'"),
])
def test_unreadable_meminfo_is_refused(text: str, complaint: str):
    with pytest.raises(ValueError, match=re.escape(complaint)):
        parse_meminfo(text)


class Node:
    """A node's meminfo that a successful drop turns from the after-rsync sample into the idle one."""

    def __init__(self, error: OSError | None = None):
        self.error = error
        self.dropped = False
        self.synced = False

    def read(self) -> MemInfo:
        return sample("gb10-idle" if self.dropped else "gb10-after-rsync")

    def sync(self) -> None:
        self.synced = True

    def write(self) -> None:
        assert self.synced, "dirty pages must be written before the drop"
        if self.error:
            raise self.error
        self.dropped = True


def test_drop_reports_its_effect():
    node = Node()
    outcome = drop_page_cache(node.read, node.sync, node.write, path="/proc/sys/vm/drop_caches", euid=0,
                              check_mode=False)
    assert outcome.status == "dropped"
    effect = outcome.as_dict()
    assert effect["freed_bytes"] > 100 * GIB
    assert effect["cuda_free_after"] > 110 * GIB > 7 * GIB > effect["cuda_free_before"]
    assert outcome.describe().startswith("page cache dropped: 109.")


@pytest.mark.parametrize("error, euid, reason", [
    (OSError(errno.EROFS, "Read-only file system"), 0, "/proc/sys is mounted read-only"),
    (OSError(errno.EACCES, "Permission denied"), 1000, "the SSH user is not root"),
    (OSError(errno.EPERM, "Operation not permitted"), 0, "lacks CAP_SYS_ADMIN"),
])
def test_drop_without_privilege_is_skipped_with_the_reason(error: OSError, euid: int, reason: str):
    node = Node(error)
    outcome = drop_page_cache(node.read, node.sync, node.write, path="/proc/sys/vm/drop_caches", euid=euid,
                              check_mode=False)
    assert outcome.status == "skipped"
    assert reason in outcome.reason and "nothing was dropped" in outcome.reason
    assert outcome.as_dict()["freed_bytes"] == 0


def test_check_mode_drops_nothing():
    node = Node()
    outcome = drop_page_cache(node.read, node.sync, node.write, path="/x", euid=0, check_mode=True)
    assert outcome.status == "would drop" and not node.synced and not node.dropped


def test_weights_larger_than_the_node_name_no_utilization():
    budget = plan_memory(sample("sim-node"), gpu(0.3))
    assert len(budget.problems) == 1
    assert "no utilization fits: weights, overhead and that KV cache need 100.5 GiB" in budget.problems[0]
