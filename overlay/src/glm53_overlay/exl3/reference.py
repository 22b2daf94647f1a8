"""Exact PyTorch reference for EXL3 linears: the slow twin of exllamav3's CUDA kernels.

W = diag(suh) · H · Ŵ · H · diag(svh), stored [in_features, out_features]. `dequantize` keeps
exllamav3's fp16 rounding points (`LinearEXL3.get_weight_tensor`), so it matches the kernels'
reconstruction bit for bit except where fp32 summation order inside the Hadamard differs.
"""

from __future__ import annotations

import torch

from glm53_overlay.exl3.codebook import CODEBOOKS, Codebook, decode_lut, decode_states
from glm53_overlay.exl3.hadamard import HADAMARD_BLOCK, rotate_cols, rotate_rows
from glm53_overlay.exl3.trellis import TILE, bits_per_weight, states_to_tiles, unpack_states

__all__ = [
    "Codebook",
    "bits_per_weight",
    "decode_lut",
    "decode_states",
    "dequantize",
    "matmul",
    "reconstruct_rotated",
    "unpack_states",
]


def reconstruct_rotated(trellis: torch.Tensor, *, codebook: Codebook) -> torch.Tensor:
    """Ŵ: the decoded weights in the rotated basis, fp16 [k, n] (exllamav3's `ext.reconstruct`)."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")
    k_bits = bits_per_weight(trellis)
    if not float(k_bits).is_integer() and codebook != "mul1":
        raise ValueError(f"half-integer EXL3 rate K={k_bits} needs the mul1 codebook, not {codebook!r}")
    states = unpack_states(trellis)
    values = decode_lut(codebook).to(trellis.device)[states.to(torch.int64) & 0xFFFF]
    return states_to_tiles(values)


def dequantize(
    trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, *, codebook: Codebook
) -> torch.Tensor:
    """The real weight W, fp16 [in_features, out_features]."""
    k = trellis.shape[0] * TILE
    n = trellis.shape[1] * TILE
    _check_scales(k, n, suh, svh)
    w = rotate_rows(reconstruct_rotated(trellis, codebook=codebook))
    w = w * suh.to(w).unsqueeze(1)
    w = rotate_cols(w)
    return w * svh.to(w).unsqueeze(0)


def matmul(
    x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, *, codebook: Codebook
) -> torch.Tensor:
    """y = x @ W in fp16 out, accumulated in fp32 from the exact fp16 W."""
    w = dequantize(trellis, suh, svh, codebook=codebook)
    return (x.float() @ w.float()).to(torch.float16)


def _check_scales(k: int, n: int, suh: torch.Tensor, svh: torch.Tensor) -> None:
    if k % HADAMARD_BLOCK or n % HADAMARD_BLOCK:
        raise ValueError(f"EXL3 shape [{k}, {n}] is not padded to multiples of {HADAMARD_BLOCK}")
    if tuple(suh.shape) != (k,) or tuple(svh.shape) != (n,):
        raise ValueError(
            f"EXL3 scales suh {tuple(suh.shape)} / svh {tuple(svh.shape)} do not match trellis [{k}, {n}]"
        )
