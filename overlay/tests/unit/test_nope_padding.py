"""NoPE padding: attention in the kernels' 576 geometry (q and k_pe padded with 64 zeros, latent absorbed)
equals plain NoPE multi-head attention over the expanded keys and values, for prefill, decode and a
sparse top-k selection. fp32 throughout; tolerance atol 1e-5 / rtol 1e-4 (only summation order differs).
"""

from __future__ import annotations

import pytest
import torch

from glm53_overlay.nope.geometry import (
    KERNEL_LATENT_DIM,
    KERNEL_ROPE_DIM,
    choose_nope_path,
    needs_rope_padding,
    pad_q_rope,
    zero_k_pe,
)
from glm53_overlay.nope.sm120 import _pad_mqa_query

HEADS, NOPE, V_DIM = 4, 32, 24
ATOL, RTOL = 1e-5, 1e-4


def _weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj split as vLLM does: W_UK [H, nope, 512], W_UV [H, v, 512]."""
    w_uk = torch.randn(HEADS, NOPE, KERNEL_LATENT_DIM, generator=gen) / KERNEL_LATENT_DIM**0.5
    w_uv = torch.randn(HEADS, V_DIM, KERNEL_LATENT_DIM, generator=gen) / KERNEL_LATENT_DIM**0.5
    return w_uk, w_uv


def _mask(queries: int, keys: int, topk: torch.Tensor | None) -> torch.Tensor:
    """Causal (the last `queries` positions of `keys`), or only the selected indices (-1 = unused slot)."""
    if topk is None:
        positions = torch.arange(keys - queries, keys).unsqueeze(1)
        return torch.arange(keys).unsqueeze(0) <= positions
    allowed = torch.zeros(queries, keys + 1, dtype=torch.bool)
    allowed.scatter_(1, torch.where(topk < 0, keys, topk), True)
    return allowed[:, :keys]


def reference_nope_attention(q_nope: torch.Tensor, kv_c: torch.Tensor, w_uk: torch.Tensor,
                             w_uv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What transformers computes for NoPE MLA: expand keys/values per head, no rope anywhere."""
    k = torch.einsum("sl,hdl->shd", kv_c, w_uk)
    v = torch.einsum("sl,hdl->shd", kv_c, w_uv)
    scores = torch.einsum("thd,shd->hts", q_nope, k) * NOPE**-0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", probs, v)


def padded_absorbed_attention(q_nope: torch.Tensor, kv_c: torch.Tensor, w_uk: torch.Tensor,
                              w_uv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What the MLA decode kernels compute once the overlay padded q and k_pe: MQA over 576-wide rows."""
    q = pad_q_rope(q_nope)
    assert q.shape[-1] == NOPE + KERNEL_ROPE_DIM
    q_latent = torch.einsum("thd,hdl->thl", q[..., :NOPE], w_uk)
    q576 = torch.cat([q_latent, q[..., NOPE:]], dim=-1)
    cache576 = torch.cat([kv_c, zero_k_pe(kv_c.shape[0], kv_c).squeeze(1)], dim=-1)
    # The scale stays the model's (nope dim), not 576's: the layer is handed it from the model.
    scores = torch.einsum("thc,sc->hts", q576, cache576) * NOPE**-0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out_latent = torch.einsum("hts,sl->thl", probs, cache576[:, :KERNEL_LATENT_DIM])
    return torch.einsum("thl,hdl->thd", out_latent, w_uv)


def padded_mha_attention(q_nope: torch.Tensor, kv_c: torch.Tensor, w_uk: torch.Tensor,
                         w_uv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """vLLM's dense prefill: keys = [k_nope | k_pe broadcast over heads], here with the zero k_pe."""
    q = pad_q_rope(q_nope)
    k_nope = torch.einsum("sl,hdl->shd", kv_c, w_uk)
    k_pe = zero_k_pe(kv_c.shape[0], kv_c).expand(-1, HEADS, -1)
    k = torch.cat([k_nope, k_pe], dim=-1)
    v = torch.einsum("sl,hdl->shd", kv_c, w_uv)
    scores = torch.einsum("thd,shd->hts", q, k) * NOPE**-0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", probs, v)


@pytest.mark.parametrize(
    ("queries", "keys", "topk"),
    [(37, 37, 0), (1, 53, 0), (5, 70, 0), (6, 90, 16)],
    ids=["prefill", "decode", "multi-token-decode", "sparse-topk"],
)
def test_padded_attention_equals_nope_reference(queries: int, keys: int, topk: int) -> None:
    gen = torch.Generator().manual_seed(queries * 1000 + keys)
    w_uk, w_uv = _weights(gen)
    kv_c = torch.randn(keys, KERNEL_LATENT_DIM, generator=gen)
    q_nope = torch.randn(queries, HEADS, NOPE, generator=gen) * 3.0
    selected = None
    if topk:
        selected = torch.stack([torch.randperm(keys, generator=gen)[:topk] for _ in range(queries)])
        selected[:, -3:] = -1  # a short selection leaves unused slots
    mask = _mask(queries, keys, selected)
    reference = reference_nope_attention(q_nope, kv_c, w_uk, w_uv, mask)
    torch.testing.assert_close(padded_absorbed_attention(q_nope, kv_c, w_uk, w_uv, mask), reference,
                               atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(padded_mha_attention(q_nope, kv_c, w_uk, w_uv, mask), reference,
                               atol=ATOL, rtol=RTOL)


def test_sparse_selection_ignores_unselected_keys() -> None:
    gen = torch.Generator().manual_seed(7)
    w_uk, w_uv = _weights(gen)
    kv_c = torch.randn(40, KERNEL_LATENT_DIM, generator=gen)
    q_nope = torch.randn(2, HEADS, NOPE, generator=gen)
    selected = torch.tensor([[3, 9, 27, -1], [0, 39, 12, 5]])
    mask = _mask(2, 40, selected)
    poisoned = kv_c.clone()
    poisoned[~mask.any(dim=0)] = 1e4
    torch.testing.assert_close(padded_absorbed_attention(q_nope, poisoned, w_uk, w_uv, mask),
                               padded_absorbed_attention(q_nope, kv_c, w_uk, w_uv, mask), atol=ATOL, rtol=RTOL)


def test_padding_is_exact_zeros_and_keeps_q() -> None:
    q = torch.randn(3, HEADS, NOPE, dtype=torch.bfloat16)
    padded = pad_q_rope(q)
    assert padded.shape == (3, HEADS, NOPE + KERNEL_ROPE_DIM) and padded.dtype == torch.bfloat16
    assert torch.equal(padded[..., :NOPE], q) and not padded[..., NOPE:].any()
    k_pe = zero_k_pe(3, torch.empty(3, KERNEL_LATENT_DIM, dtype=torch.bfloat16))
    assert k_pe.shape == (3, 1, KERNEL_ROPE_DIM) and k_pe.dtype == torch.bfloat16 and not k_pe.any()


def test_mqa_query_padding_for_the_sm120_kernel() -> None:
    ql_nope = torch.randn(2, HEADS, KERNEL_LATENT_DIM)
    nope_pair = _pad_mqa_query((ql_nope, ql_nope[..., :0]), KERNEL_LATENT_DIM)
    assert nope_pair[0] is ql_nope and nope_pair[1].shape == (2, HEADS, 64) and not nope_pair[1].any()
    assert _pad_mqa_query(ql_nope, KERNEL_LATENT_DIM).shape == (2, HEADS, 576)
    already = torch.randn(2, HEADS, 576)
    assert _pad_mqa_query(already, KERNEL_LATENT_DIM) is already


def test_only_nope_512_latents_are_padded() -> None:
    assert needs_rope_padding(512, 0)
    assert not needs_rope_padding(512, 64)
    assert not needs_rope_padding(256, 0)  # no kernel has a 256 latent; padding rope would not help


@pytest.mark.parametrize(
    ("kwargs", "name", "dtype", "padded", "unpadded"),
    [
        ({"is_cpu": True, "cuda_major": None, "use_sparse": False, "kv_cache_dtype": "auto"},
         "cpu-mla-pad", "auto", 1152, 1024),
        ({"is_cpu": False, "cuda_major": 12, "use_sparse": True, "kv_cache_dtype": "auto"},
         "sm120-sparse-pad", "fp8_ds_mla", 656, 528),
        ({"is_cpu": False, "cuda_major": 12, "use_sparse": True, "kv_cache_dtype": "fp8"},
         "sm120-sparse-pad", "fp8_ds_mla", 656, 528),
        ({"is_cpu": False, "cuda_major": 9, "use_sparse": False, "kv_cache_dtype": "fp8"},
         "mla-pad", "fp8", 576, 512),
    ],
)
def test_path_choice_and_kv_bytes(kwargs: dict, name: str, dtype: str, padded: int, unpadded: int) -> None:
    path = choose_nope_path(pad=True, model_dtype_bytes=2, **kwargs)
    assert (path.name, path.kv_cache_dtype, path.padded_bytes, path.unpadded_bytes) == (name, dtype, padded, unpadded)
    assert f"path={name}" in path.log_line() and f"kv_bytes_per_token_per_mla_layer={padded}" in path.log_line()
    none = choose_nope_path(pad=False, model_dtype_bytes=2, **kwargs)
    assert none.name == "none" and "path=none" in none.log_line()
