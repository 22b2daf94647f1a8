"""W' = (I − α r rᵀ/‖r‖²) W: remove (α=1) or reverse (α>1) a direction from a layer's output space."""

from __future__ import annotations

import math

import torch


def _checked_direction(direction: torch.Tensor, out_features: int) -> torch.Tensor:
    if direction.ndim != 1 or direction.numel() != out_features:
        raise ValueError(f"direction has shape {tuple(direction.shape)}, expected ({out_features},)")
    r = direction.to(torch.float32)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("direction has non-finite entries")
    if float(r.dot(r)) == 0.0:
        raise ValueError("direction has zero norm")
    return r


def project_out(weight: torch.Tensor, direction: torch.Tensor, alpha: float) -> torch.Tensor:
    """Edit a [out, in] weight along a direction of length `out`; fp32 math, result in weight's dtype.

    The projector acts on the output dimension only, so a RowParallelLinear shard (a slice of the input
    dimension) can be edited on its own and the shards still add up to the edit of the full weight.
    """
    if weight.ndim != 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected [out, in]")
    if not math.isfinite(alpha):
        raise ValueError(f"alpha {alpha} is not finite")
    r = _checked_direction(direction, weight.shape[0]).to(weight.device)
    w = weight.to(torch.float32)
    # Rank-1 update instead of building the [out, out] projector: hidden is 4-6k on the real model.
    component = (r @ w) / r.dot(r)
    return (w - alpha * torch.outer(r, component)).to(weight.dtype)


def direction_residual(weight: torch.Tensor, direction: torch.Tensor) -> float:
    """max |rᵀW| / ‖r‖: how much of the direction the weight can still write (≈0 after α=1)."""
    r = _checked_direction(direction, weight.shape[0]).to(weight.device)
    return float((r @ weight.to(torch.float32)).abs().max() / r.norm())
