"""The sparse indexer's automatic decode top-k takes top_k_per_row_decode on SM12x, not persistent_topk.

vLLM's `SparseIndexerTopk._resolve_auto` (used by the GLM-5.3 Flash kpool indexer through get_indexer_topk)
skips cooperative_topk on the SM12x family but then picks persistent_topk for top-k 512/1024/2048 on every
CUDA device. The recipe turns persistent_topk off on GB10 in favour of top_k_per_row_decode. Only the
automatic choice changes: an explicit --kernel-config sparse_indexer_topk_backend is still honoured.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from glm53_overlay.sm12x.source_guard import require_source

NAME = "indexer-topk-per-row"
SOURCE = "recipe (vLLM 487ecf187 base): persistent_topk off on SM12x in favour of top_k_per_row_decode"
TARGET = "vllm.model_executor.layers.indexer_topk"
# 0.32's _resolve_auto (and upstream's at the time of writing) return "persistent" on SM12x.
SUPPORTED_VLLM = frozenset({(0, 32), (0, 33)})
_PATCHED = "_glm53_sm12x_topk"
SIGNATURE = "(self, logits: Tensor, topk_tokens: int, num_rows: int) -> str"
SOURCE_SHA256 = {"vllm 0.32.0 / 0.33.0": "091bac0a3015e9790131d65c570c6f16614df21fd09178f61cf465a1059c3a88"}


def _sm12x_probe(module: ModuleType) -> Any:
    """A SparseIndexerTopk as vLLM builds it on an SM12x device with the automatic backend (no nn.Module setup)."""
    topk = module.SparseIndexerTopk.__new__(module.SparseIndexerTopk)
    vars(topk).update(_backend="auto", _is_cuda=True, _cooperative_capable=False, _has_deep_select=False,
                      _has_flashinfer_topk=False, _is_rocm=False, _aiter_enabled=False, _aiter_capable=False)
    return topk


def auto_choice(module: ModuleType, rows: int = 4, topk_tokens: int = 2048) -> str:
    import torch

    logits = torch.empty(rows, 8192, dtype=torch.float32)
    return module.SparseIndexerTopk.resolve_backend(_sm12x_probe(module), logits, topk_tokens, rows)


def already_fixed(module: ModuleType, capability: tuple[int, int]) -> str | None:
    if getattr(module.SparseIndexerTopk._resolve_auto, _PATCHED, False):
        return None
    require_source(module.SparseIndexerTopk._resolve_auto, SIGNATURE, SOURCE_SHA256)
    choice = auto_choice(module)
    return None if choice == "persistent" else f"vLLM's automatic choice on SM12x is already {choice}"


def patch(module: ModuleType, capability: tuple[int, int]) -> str:
    cls = module.SparseIndexerTopk
    original = cls._resolve_auto
    if getattr(original, _PATCHED, False):
        return "automatic top-k: persistent -> per_row (already)"
    require_source(original, SIGNATURE, SOURCE_SHA256)

    def _resolve_auto(self: Any, logits: Any, topk_tokens: int, num_rows: int) -> str:
        choice = original(self, logits, topk_tokens, num_rows)
        return "per_row" if choice == "persistent" else choice

    _resolve_auto.__doc__ = original.__doc__
    setattr(_resolve_auto, _PATCHED, True)
    cls._resolve_auto = _resolve_auto
    return f"automatic top-k: persistent -> per_row (now {auto_choice(module)})"
