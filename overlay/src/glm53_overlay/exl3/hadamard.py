"""Block-diagonal 128x128 Hadamard rotations as exllamav3 applies them (fp32 math, caller's dtype out)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch

HADAMARD_BLOCK = 128


@lru_cache(maxsize=1)
def hadamard_128() -> torch.Tensor:
    """Sylvester Hadamard of order 128 scaled by 1/sqrt(128), fp32 (symmetric, orthonormal)."""
    # Explicit dtype: vLLM changes torch's default dtype while it builds models.
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < HADAMARD_BLOCK:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    # Scaling the fp32 ±1 matrix by a Python float matches exllamav3's rounding of the scale.
    return h * (1 / math.sqrt(HADAMARD_BLOCK))


def rotate_rows(w: torch.Tensor) -> torch.Tensor:
    """H · W per 128-row block (exllamav3's `preapply_had_l`)."""
    k, n = w.shape
    rotated = hadamard_128().to(w.device) @ w.float().view(k // HADAMARD_BLOCK, HADAMARD_BLOCK, n)
    return rotated.view(k, n).to(w.dtype)


def rotate_cols(w: torch.Tensor) -> torch.Tensor:
    """W · H per 128-column block (exllamav3's `preapply_had_r`; also rotates activations x · H)."""
    lead = w.shape[:-1]
    n = w.shape[-1]
    rotated = w.float().reshape(-1, n // HADAMARD_BLOCK, HADAMARD_BLOCK) @ hadamard_128().to(w.device)
    return rotated.reshape(*lead, n).to(w.dtype)
