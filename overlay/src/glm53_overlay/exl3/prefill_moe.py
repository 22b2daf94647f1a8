"""Our prefill MoE path: decode the routed experts into a bounded fp16 scratch, tile by tile, and run
library GEMMs over them, with the experts still stored packed.

For one call (x [T, hidden], top-k routing):
1. the T*k assignments are sorted by expert on the device; the per-expert counts are read back to the
   host once (so this path is for eager prefill, never inside a CUDA graph capture: `runtime` keeps the
   exllamav3 path there);
2. the touched experts are taken `tile_experts` at a time: exllamav3's `reconstruct_had_batch` decodes
   each projection of the tile into fp16 W = diag(suh) . H . W_hat . H . diag(svh) (the reference
   decoder's weight, in one launch per projection from the pointer tables), then gate and up run as
   grouped GEMMs over the tile's rows (one strided-batched fp16 GEMM over rows padded to the tile's
   largest expert; torch._grouped_mm on fp16 measured slower), SwiGLU with exllamav3's clamp (`silu_mul`),
   and the down GEMM;
3. each row's output, times its routing weight, is summed into the fp32 result (index_add_).

Peak scratch: the tile's decoded weights, 3 * tile_experts * hidden * intermediate * 2 bytes (16 experts
at GLM-5.3 Flash's TP=2 rank shape: 403 MB), plus the gathered rows and activations of the call.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from glm53_overlay.exl3.packing import PackedProjection

TILE_ENV = "GLM53_EXL3_MOE_PREFILL_TILE"
DEFAULT_TILE_EXPERTS = 16


def tile_experts_setting() -> int:
    """GLM53_EXL3_MOE_PREFILL_TILE: experts decoded at once (bounds the fp16 scratch), default 16."""
    raw = os.environ.get(TILE_ENV, str(DEFAULT_TILE_EXPERTS))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{TILE_ENV}={raw!r}: expected a positive number of experts")
    return value


def scratch_bytes(hidden: int, intermediate: int, tile_experts: int) -> int:
    """Bytes of the decoded-weight scratch: gate, up and down of one tile in fp16."""
    return 3 * tile_experts * hidden * intermediate * 2


def tiles(counts: list[int], tile_experts: int) -> list[tuple[list[int], int, int]]:
    """The touched experts in groups of `tile_experts`: (experts, first sorted row, row count) each.

    Rows are sorted by expert, so each group's rows are one contiguous range.
    """
    out: list[tuple[list[int], int, int]] = []
    start = 0
    group: list[int] = []
    group_start = 0
    rows = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        if not group:
            group_start = start
        group.append(expert)
        rows += count
        start += count
        if len(group) == tile_experts:
            out.append((group, group_start, rows))
            group, rows = [], 0
    if group:
        out.append((group, group_start, rows))
    return out


class PrefillExperts:
    """Tile-decoded grouped-GEMM MoE over one layer's packed experts (CUDA; exllamav3's extension)."""

    def __init__(
        self, gate: PackedProjection, up: PackedProjection, down: PackedProjection, *, codebook: str, ext: Any,
        act_limit: float = 0.0, tile_experts: int | None = None,
    ) -> None:
        self.projections = {"gate": gate, "up": up, "down": down}
        self.ptrs = {name: p.pointer_tables() for name, p in self.projections.items()}
        self.mcg, self.mul1 = codebook == "mcg", codebook == "mul1"
        self.ext = ext
        self.act_limit = float(act_limit)
        self.tile = tile_experts if tile_experts is not None else tile_experts_setting()
        self.num_experts = gate.num_experts
        self.hidden, self.intermediate = gate.in_features, gate.out_features
        self.device = gate.trellis.device
        self._scratch: dict[str, torch.Tensor] | None = None
        # Padded strided-batched GEMM: measured faster than fp16 torch._grouped_mm at every size and tile on the
        # H200 (benchmarks/results/prefill/prefill_gemm_probe.json); `grouped_mm` stays selectable for that probe.
        self.gemm = "bmm_padded"

    def scratch(self) -> dict[str, torch.Tensor]:
        if self._scratch is None:
            kw = {"dtype": torch.float16, "device": self.device}
            h, i, t = self.hidden, self.intermediate, self.tile
            self._scratch = {"gate": torch.empty((t, h, i), **kw), "up": torch.empty((t, h, i), **kw),
                             "down": torch.empty((t, i, h), **kw)}
        return self._scratch

    def _decode(self, name: str, experts: torch.Tensor, count: int) -> torch.Tensor:
        p = self.projections[name]
        w = self.scratch()[name][:count]
        trellis, suh, svh = (t.index_select(0, experts) for t in self.ptrs[name])
        self.ext.reconstruct_had_batch(w, trellis, suh, svh, float(p.bits), self.mcg, self.mul1)
        return w

    def apply(self, x16: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """fp32 [T, hidden] routed sum for fp16 x16 [T, hidden]; one host read of the expert counts."""
        tokens, top_k = topk_ids.shape
        flat = topk_ids.reshape(-1).to(torch.int64)
        # Ids of experts not on this rank sort into a last bin that no tile reads.
        flat = torch.where((flat >= 0) & (flat < self.num_experts), flat, torch.full_like(flat, self.num_experts))
        order = torch.argsort(flat, stable=True)
        rows = order // top_k
        counts_dev = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=x16.device)
        counts_dev.scatter_add_(0, flat, torch.ones_like(flat))
        counts = counts_dev.tolist()[: self.num_experts]  # the one host read (eager prefill only)
        xs = x16.index_select(0, rows)
        ws = topk_weights.reshape(-1).float()[order].unsqueeze(1)
        out = torch.zeros((tokens, self.hidden), dtype=torch.float32, device=x16.device)
        plan = tiles(counts, self.tile)
        touched = torch.tensor([e for group, _s, _n in plan for e in group], dtype=torch.int64, device=x16.device)
        done = 0
        for group, start, nrows in plan:
            experts = touched[done : done + len(group)]
            done += len(group)
            group_counts = [counts[e] for e in group]
            w_gate = self._decode("gate", experts, len(group))
            w_up = self._decode("up", experts, len(group))
            w_down = self._decode("down", experts, len(group))
            xt = xs[start : start + nrows]
            mm = _GroupedRows(group_counts, x16.device, self.gemm)
            gate = mm(xt, w_gate)
            up = mm(xt, w_up)
            act = torch.empty_like(gate)
            self.ext.silu_mul(gate, up, act, self.act_limit)
            y = mm(act, w_down)
            out.index_add_(0, rows[start : start + nrows], y.float() * ws[start : start + nrows])
        return out


class _GroupedRows:
    """y[rows of group g] = x[rows of group g] @ w[g], groups contiguous with host-known counts."""

    def __init__(self, counts: list[int], device: torch.device, how: str) -> None:
        self.counts, self.how = counts, how
        counts_t = torch.tensor(counts, dtype=torch.int64, device=device)
        if how == "grouped_mm":
            self.offs = torch.cumsum(counts_t, 0).to(torch.int32)
        else:
            self.cmax = max(counts)
            starts = torch.cumsum(counts_t, 0) - counts_t
            self.gid = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t,
                                               output_size=sum(counts))
            self.pos = torch.arange(sum(counts), device=device) - starts[self.gid]

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.how == "grouped_mm":
            return torch._grouped_mm(x, w, offs=self.offs)
        slab = torch.zeros((len(self.counts), self.cmax, x.shape[1]), dtype=x.dtype, device=x.device)
        slab[self.gid, self.pos] = x
        return torch.bmm(slab, w)[self.gid, self.pos]
