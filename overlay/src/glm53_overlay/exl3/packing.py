"""How EXL3 experts sit in memory: the checkpoint's per-tensor parts, one projection of every local expert
stacked as exllamav3's kernels read it, and a tensor-parallel rank's slice of it.

Torch only (no vLLM, no kernels): the vLLM methods (`moe.py`, `config.py`) and the kernel runtime
(`runtime.py`) both build on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from glm53_overlay.exl3.codebook import Codebook, codebook_from_marker
from glm53_overlay.exl3.hadamard import HADAMARD_BLOCK
from glm53_overlay.exl3.trellis import TILE, bits_per_weight

# The tensors one EXL3 linear is stored as; at most one of the codebook markers mcg / mul1 is present.
EXL3_PARTS = ("trellis", "suh", "svh", "mcg", "mul1")
REQUIRED_PARTS = ("trellis", "suh", "svh")


def codebook_of(parts: Mapping[str, torch.Tensor], where: str) -> Codebook:
    """The codebook of one stored EXL3 tensor, after checking it has every required part."""
    absent = [part for part in REQUIRED_PARTS if part not in parts]
    if absent:
        raise ValueError(f"{where} lacks EXL3 {absent}")
    return codebook_from_marker(parts.get("mcg"), parts.get("mul1"))


@dataclass(frozen=True)
class PackedProjection:
    """One projection of every local expert, stacked: trellis [E, k/16, n/16, 16K], suh [E, k], svh [E, n]."""

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    bits: int | float

    @classmethod
    def stack(cls, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], device: torch.device | str) -> PackedProjection:
        if not parts:
            raise ValueError("no experts to stack")
        bits = {bits_per_weight(part[0]) for part in parts}
        shapes = {tuple(part[0].shape) for part in parts}
        if len(bits) != 1 or len(shapes) != 1:
            raise ValueError(f"experts of one projection differ in shape {sorted(shapes)} or bits {sorted(bits)}")
        if not float(next(iter(bits))).is_integer():
            # The MoE kernels this path calls are instantiated for integer K only.
            raise ValueError(f"half-integer EXL3 experts (K={bits.pop()}) are not supported by the CUDA MoE path")
        trellis = torch.stack([part[0].to(device=device, dtype=torch.int16) for part in parts]).contiguous()
        suh = torch.stack([part[1].to(device=device, dtype=torch.float16) for part in parts]).contiguous()
        svh = torch.stack([part[2].to(device=device, dtype=torch.float16) for part in parts]).contiguous()
        projection = cls(trellis, suh, svh, bits.pop())
        projection.check()
        return projection

    @property
    def num_experts(self) -> int:
        return self.trellis.shape[0]

    @property
    def in_features(self) -> int:
        return self.trellis.shape[1] * TILE

    @property
    def out_features(self) -> int:
        return self.trellis.shape[2] * TILE

    def check(self) -> None:
        e, k, n = self.num_experts, self.in_features, self.out_features
        if k % HADAMARD_BLOCK or n % HADAMARD_BLOCK:
            raise ValueError(f"EXL3 expert shape [{k}, {n}] is not a multiple of {HADAMARD_BLOCK}")
        if tuple(self.suh.shape) != (e, k) or tuple(self.svh.shape) != (e, n):
            raise ValueError(f"suh {tuple(self.suh.shape)} / svh {tuple(self.svh.shape)} do not fit [{e}, {k}, {n}]")

    def pointer_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int64 device tables of each expert's trellis / suh / svh address."""
        return tuple(_row_pointers(t) for t in (self.trellis, self.suh, self.svh))  # type: ignore[return-value]

    def expert_bytes(self) -> int:
        """Bytes one expert's projection occupies (what a kernel must read to use it)."""
        per = self.trellis[0].numel() * self.trellis.element_size()
        return per + (self.in_features + self.out_features) * self.suh.element_size()


def _row_pointers(stacked: torch.Tensor) -> torch.Tensor:
    stride = stacked.stride(0) * stacked.element_size()
    base = stacked.data_ptr()
    return torch.tensor([base + e * stride for e in range(stacked.shape[0])], dtype=torch.int64, device=stacked.device)


def slice_for_rank(
    trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, projection: str, rank: int, size: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's share of one expert projection, in exllamav3's [in, out] storage.

    gate/up split their output columns, down its input rows, each `width` wide. The Hadamard
    rotations are block-diagonal over 128, so a 128-aligned slice is exact.
    """
    if size == 1:
        return trellis, suh, svh
    if width % HADAMARD_BLOCK:
        raise ValueError(f"per-rank intermediate {width} is not a multiple of {HADAMARD_BLOCK}: EXL3 cannot be split there")
    lo, hi = rank * width, (rank + 1) * width
    if projection == "down":
        return trellis[lo // TILE : hi // TILE], suh[lo:hi], svh
    if projection in ("gate", "up"):
        return trellis[:, lo // TILE : hi // TILE], suh, svh[lo:hi]
    raise ValueError(f"unknown projection {projection!r}")


def touched_bytes(projections: dict[str, PackedProjection], topk_ids: torch.Tensor, hidden: int) -> int:
    """Fewest device bytes one apply must move: each routed expert's packed weights once, x in, out out."""
    distinct = int(torch.unique(topk_ids.reshape(-1)).numel())
    weights = distinct * sum(p.expert_bytes() for p in projections.values())
    tokens = topk_ids.shape[0]
    # bf16 in, bf16 out, ids int64 + weights fp32 per slot
    return weights + tokens * hidden * 2 * 2 + topk_ids.numel() * (8 + 4)
