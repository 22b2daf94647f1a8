"""The pure part of the NoPE padding: when to pad, how q and k_pe are padded, what it costs per token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM's MLA kernels (CPU decode, FlashInfer sparse SM120, FlashMLA) are built for DeepSeek's geometry.
KERNEL_LATENT_DIM = 512
KERNEL_ROPE_DIM = 64

# fp8_ds_mla record: 512 fp8 latent values, one fp32 scale per 128 of them, the rope part in bf16.
FP8_DS_MLA_TILE = 128


def needs_rope_padding(kv_lora_rank: int, qk_rope_head_dim: int) -> bool:
    """True for NoPE MLA whose latent already has the kernel width, so only the rope part is missing."""
    return qk_rope_head_dim == 0 and kv_lora_rank == KERNEL_LATENT_DIM


def pad_q_rope(q: torch.Tensor, pad: int = KERNEL_ROPE_DIM) -> torch.Tensor:
    """[T, H, nope] -> [T, H, nope + pad] with a zero rope part (a new tensor; q may be a view)."""
    return torch.cat([q, q.new_zeros(*q.shape[:-1], pad)], dim=-1)


def zero_k_pe(num_tokens: int, like: torch.Tensor, pad: int = KERNEL_ROPE_DIM) -> torch.Tensor:
    """The cached rope key of a NoPE token: [T, 1, pad] zeros, so k_pe·q_pe adds exactly 0."""
    return like.new_zeros(num_tokens, 1, pad)


def fp8_ds_mla_record_bytes(rope_dim: int) -> int:
    """Bytes per token of the packed record: fp8 latent + fp32 tile scales + bf16 rope."""
    return KERNEL_LATENT_DIM + 4 * (KERNEL_LATENT_DIM // FP8_DS_MLA_TILE) + 2 * rope_dim


def kv_bytes_per_token(kv_cache_dtype: str, model_dtype_bytes: int, rope_dim: int) -> int:
    """KV cache bytes one MLA layer stores per token for `rope_dim` rope values next to the 512 latent."""
    if kv_cache_dtype == "fp8_ds_mla":
        return fp8_ds_mla_record_bytes(rope_dim)
    if kv_cache_dtype.startswith("fp8"):
        return KERNEL_LATENT_DIM + rope_dim
    return (KERNEL_LATENT_DIM + rope_dim) * model_dtype_bytes


@dataclass(frozen=True)
class NopePath:
    """Which NoPE path a layer takes and what the padding costs, for the one start-up log line."""

    name: str  # "cpu-mla-pad", "sm120-sparse-pad", "mla-pad" (other platforms) or "none"
    kv_cache_dtype: str
    padded_bytes: int
    unpadded_bytes: int

    def log_line(self) -> str:
        if self.name == "none":
            return "glm53-nope: path=none (model has a rope part or a non-512 latent; no padding)"
        extra = self.padded_bytes - self.unpadded_bytes
        return (
            f"glm53-nope: path={self.name} kv_cache_dtype={self.kv_cache_dtype} "
            f"kv_bytes_per_token_per_mla_layer={self.padded_bytes} (unpadded {self.unpadded_bytes}, "
            f"+{extra} B = +{100.0 * extra / self.unpadded_bytes:.1f}% for the zero rope part)"
        )


def choose_nope_path(
    *,
    pad: bool,
    is_cpu: bool,
    cuda_major: int | None,
    use_sparse: bool,
    kv_cache_dtype: str,
    model_dtype_bytes: int,
) -> NopePath:
    """Pick the path from platform facts; kept free of vLLM so it is unit-tested here."""
    if not pad:
        return NopePath("none", kv_cache_dtype, 0, 0)
    if is_cpu:
        name = "cpu-mla-pad"
    elif cuda_major == 12 and use_sparse:
        # SM12x has no bf16/nvfp4 sparse MLA kernel: the only one there reads fp8_ds_mla records.
        name, kv_cache_dtype = "sm120-sparse-pad", "fp8_ds_mla"
    else:
        name = "mla-pad"
    return NopePath(
        name,
        kv_cache_dtype,
        kv_bytes_per_token(kv_cache_dtype, model_dtype_bytes, KERNEL_ROPE_DIM),
        kv_bytes_per_token(kv_cache_dtype, model_dtype_bytes, 0),
    )
