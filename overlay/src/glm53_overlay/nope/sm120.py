"""FLASHINFER_MLA_SPARSE_SM120 wrapper for NoPE MLA (vLLM 0.33 on GB10; the class also exists in 0.32).

It keeps the backend's name, so every name-keyed rule in vLLM still applies to it: auto/fp8 KV becomes
the packed fp8_ds_mla format (the only one the SM12x sparse kernel reads), 64-row pages, flat KV rows.
What it adds: whatever rope reaches it, the cache gets zero rope bytes, and a q without its rope part is
padded, so the kernel's q·k over 576 values equals the NoPE q·k over 512.
Built lazily: importing vLLM's attention backends at plugin time would slow every process start.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from glm53_overlay.nope.geometry import KERNEL_ROPE_DIM, pad_q_rope, zero_k_pe


def _pad_mqa_query(q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], latent_dim: int) -> Any:
    """Decode q arrives as (ql_nope [T,H,512], q_pe [T,H,rope]) or concatenated [T,H,512+rope]."""
    if isinstance(q, tuple):
        ql_nope, q_pe = q
        if q_pe.shape[-1] == 0:
            return ql_nope, ql_nope.new_zeros(*ql_nope.shape[:-1], KERNEL_ROPE_DIM)
        return q
    return pad_q_rope(q) if q.shape[-1] == latent_dim else q


@cache
def nope_sm120_impl() -> type:
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120 import FlashInferMLASparseSM120Impl

    class NopeFlashInferMLASparseSM120Impl(FlashInferMLASparseSM120Impl):  # type: ignore[misc, valid-type]
        def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, *args: Any) -> None:
            # Rope bytes must be exact zeros: any leftover there would add q_pe·k_pe to every score.
            super().do_kv_cache_update(kv_c_normed, zero_k_pe(kv_c_normed.shape[0], kv_c_normed), *args)

        def forward_mqa(self, q: Any, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: Any, layer: Any) -> Any:
            return super().forward_mqa(_pad_mqa_query(q, self.kv_lora_rank), kv_c_and_k_pe_cache,
                                       attn_metadata, layer)

    return NopeFlashInferMLASparseSM120Impl


@cache
def nope_sm120_backend() -> type:
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseSM120Backend

    class NopeFlashInferMLASparseSM120Backend(FlashInferMLASparseSM120Backend):  # type: ignore[misc, valid-type]
        @staticmethod
        def get_impl_cls() -> type:
            return nope_sm120_impl()

    return NopeFlashInferMLASparseSM120Backend
