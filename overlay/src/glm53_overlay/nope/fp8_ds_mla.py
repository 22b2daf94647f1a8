"""Pure-torch packer of vLLM's `fp8_ds_mla` KV record (656 B/token), the spec the SM120 path writes.

Layout per token: bytes 0..511 the latent as float8_e4m3fn, quantized per 128-value tile; bytes 512..527
the 4 tile scales as float32 (dequantized value = fp8 * scale); bytes 528..655 the 64 rope values as bf16.
GLM models use an arbitrary fp32 scale (amax / 448, vLLM's "arbitrary_fp32"), others a power of two.
"""

from __future__ import annotations

import torch

from glm53_overlay.nope.geometry import FP8_DS_MLA_TILE, KERNEL_LATENT_DIM, KERNEL_ROPE_DIM, fp8_ds_mla_record_bytes

RECORD_BYTES = fp8_ds_mla_record_bytes(KERNEL_ROPE_DIM)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Keeps an all-zero tile (every padded rope token has one only if its latent is zero) from dividing by 0.
_MIN_SCALE = torch.finfo(torch.float32).tiny


def tile_scales(kv_c: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """[T, 512] -> [T, 4] fp32 scales, one per 128-value tile."""
    amax = kv_c.float().abs().view(kv_c.shape[0], -1, FP8_DS_MLA_TILE).amax(dim=-1)
    scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    return torch.exp2(torch.ceil(torch.log2(scale))) if pow2 else scale


def pack_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, pow2_scales: bool = False) -> torch.Tensor:
    """kv_c [T, 512], k_pe [T, 64] -> uint8 [T, 656] records (NoPE passes zero k_pe)."""
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


def write_nope_records(cache_rows: torch.Tensor, slot_mapping: torch.Tensor, kv_c: torch.Tensor) -> None:
    """Write NoPE tokens into a flat uint8 [slots, 656] cache: zero rope bytes; slot -1 means padding."""
    keep = slot_mapping >= 0
    kv_c = kv_c[keep]
    records = pack_fp8_ds_mla(kv_c, kv_c.new_zeros(kv_c.shape[0], KERNEL_ROPE_DIM), pow2_scales=False)
    cache_rows[slot_mapping[keep].long()] = records
