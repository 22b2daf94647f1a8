"""vLLM's `fp8_ds_mla` KV record (656 B/token) in plain torch: the CPU stand-in for the CUDA-only parts that
read or write it (vLLM's `concat_and_cache_mla` with kv_cache_dtype "fp8_ds_mla", FlashInfer's SM120 sparse
MLA decode), checked byte for byte against an independent packing in test_nope_fp8_ds_mla.py.

Layout per token: bytes 0..511 the latent as float8_e4m3fn, quantized per 128-value tile; bytes 512..527
the 4 tile scales as float32 (dequantized value = fp8 * scale); bytes 528..655 the 64 rope values as bf16.
Scales here are amax / 448 (vLLM's "arbitrary_fp32", which it uses for GLM models); `pow2_scales` rounds
them up to a power of two (vLLM's "pow2_fp32"). A reader needs neither: it multiplies by the stored scale.
"""

from __future__ import annotations

import torch

from glm53_overlay.nope.geometry import FP8_DS_MLA_TILE, KERNEL_LATENT_DIM, KERNEL_ROPE_DIM, fp8_ds_mla_record_bytes

RECORD_BYTES = fp8_ds_mla_record_bytes(KERNEL_ROPE_DIM)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALES_END = KERNEL_LATENT_DIM + 4 * (KERNEL_LATENT_DIM // FP8_DS_MLA_TILE)
# Keeps an all-zero tile from dividing by 0.
_MIN_SCALE = torch.finfo(torch.float32).tiny


def tile_scales(kv_c: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """[T, 512] -> [T, 4] fp32 scales, one per 128-value tile."""
    amax = kv_c.float().abs().view(kv_c.shape[0], -1, FP8_DS_MLA_TILE).amax(dim=-1)
    scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    return torch.exp2(torch.ceil(torch.log2(scale))) if pow2 else scale


def pack_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, pow2_scales: bool = False) -> torch.Tensor:
    """kv_c [T, 512], k_pe [T, 64] -> uint8 [T, 656] records."""
    tokens = kv_c.shape[0]
    if kv_c.shape != (tokens, KERNEL_LATENT_DIM) or k_pe.shape != (tokens, KERNEL_ROPE_DIM):
        raise ValueError(f"want kv_c [T,{KERNEL_LATENT_DIM}] and k_pe [T,{KERNEL_ROPE_DIM}], got "
                         f"{tuple(kv_c.shape)} and {tuple(k_pe.shape)}")
    scales = tile_scales(kv_c, pow2_scales)
    tiles = kv_c.float().view(tokens, -1, FP8_DS_MLA_TILE) / scales.unsqueeze(-1)
    latent = tiles.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(tokens, KERNEL_LATENT_DIM)
    return torch.cat(
        [latent.view(torch.uint8), scales.contiguous().view(torch.uint8),
         k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)],
        dim=-1,
    )


def unpack_fp8_ds_mla(records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, 656] -> (latent [N, 512], rope [N, 64]) in fp32, as a kernel reading the record sees them."""
    records = records.contiguous()
    scales = records[:, KERNEL_LATENT_DIM:SCALES_END].contiguous().view(torch.float32)
    fp8 = records[:, :KERNEL_LATENT_DIM].contiguous().view(torch.float8_e4m3fn).float()
    latent = (fp8.view(-1, 4, FP8_DS_MLA_TILE) * scales.unsqueeze(-1)).view(-1, KERNEL_LATENT_DIM)
    rope = records[:, SCALES_END:].contiguous().view(torch.bfloat16).float()
    return latent, rope


def write_records(cache_rows: torch.Tensor, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
    """Write tokens into a flat uint8 [slots, 656] cache; slot -1 is padding and is skipped."""
    keep = slot_mapping >= 0
    cache_rows[slot_mapping[keep].long()] = pack_fp8_ds_mla(kv_c[keep], k_pe[keep])
