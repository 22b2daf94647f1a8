"""Our prefill MoE path: decode routed experts into a bounded fp16 scratch, a tile of experts at a time, and run
Triton grouped GEMMs over them (`prefill_gemm.py`), with the experts still stored packed. No host sync.

For one call (x [T, hidden], top-k routing):
1. the T*k assignments are sorted by expert on the device, with the per-expert counts and starts (`routing`);
   nothing is read back, so the launch sequence is fixed by T alone and the call can be captured in a CUDA graph;
2. every expert of the layer is taken `tile_experts` at a time (at prefill sizes nearly all are touched: 512
   tokens x top-8 over 288 experts leave about 0.2% untouched) and decoded into fp16, one launch per projection;
3. Triton kernels per tile (`prefill_gemm.py`): gate and up over each expert's rows with SwiGLU and exllamav3's clamp
   fused in (fp16 activations), then down, weighted and added into the fp32 result.

Two formulations (`unfolded`):
- unfolded (the default, UNFOLDED): exllamav3's `reconstruct_batch` decodes W_hat, the rotated-basis weights, which
  fp16 holds exactly; the rotations run on the activations as exllamav3's exl3_gemm applies them, each routed
  row's input rotated once per call (`prefill_gemm.rotate_inputs`), the rest in the GEMMs' epilogues. The decode
  skips the Hadamard passes, and the weights carry no rounding of their own.
- folded: exllamav3's `reconstruct_had_batch` decodes W = diag(suh) . H . W_hat . H . diag(svh) into fp16 (its
  batched tier's default), plain GEMMs; the fold rounds the weights to fp16 (about 1.3x the error, see
  benchmarks/README.md) and the decode is slower.

`apply_experts` runs the same tiles over a host-given list of experts only: the engine's exllamav3-style plan
uses it for the experts above exl3_moe's row capacity (the counts are on the host there already).

Scratch: the tile's decoded weights, 3 * tile_experts * hidden * intermediate * 2 bytes (16 experts at GLM-5.3
Flash's TP=2 rank shape: 403 MB), twice when the next tile's decode overlaps (the default: 806 MB), shared by all
layers of one shape; plus the activations of the call (T * k * intermediate fp16; unfolded also both rotated
inputs, 2 * T * k * hidden fp16: 1.07 GB at 8192 tokens).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from glm53_overlay.exl3 import prefill_gemm
from glm53_overlay.exl3.packing import PackedProjection

TILE_ENV = "GLM53_EXL3_MOE_PREFILL_TILE"
DEFAULT_TILE_EXPERTS = 16
# Rotations on the activations (reconstruct_batch) rather than folded into the weights (reconstruct_had_batch):
# faster and more exact on the H200 (benchmarks/results/prefill/bench_prefill.json).
UNFOLDED = True


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


Routing = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_SCRATCH: dict[tuple[str, int, int, int, int], dict[str, torch.Tensor]] = {}


def routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> Routing:
    """(counts [E+1], starts [E+1], token of each sorted assignment, its weight fp32), all on the device.

    Assignments are sorted by expert (stable); ids outside [0, E) (experts of other ranks) sort into bin E,
    which no tile reads. No host sync: counts by scatter_add_ (CUDA bincount reads the max back).
    """
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).to(torch.int64)
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    return counts, starts, order // top_k, topk_weights.reshape(-1).float()[order]


class PrefillExperts:
    """Tile-decoded grouped-GEMM MoE over one layer's packed experts (CUDA: exllamav3's reconstruct + our
    Triton GEMMs; CPU: the extension's stand-ins + `prefill_gemm`'s torch twins, for the tests)."""

    def __init__(
        self, gate: PackedProjection, up: PackedProjection, down: PackedProjection, *, codebook: str, ext: Any,
        act_limit: float = 0.0, tile_experts: int | None = None, overlap: bool = True, unfolded: bool = UNFOLDED,
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
        self.all_ids = torch.arange(self.num_experts, dtype=torch.int64, device=self.device)
        self._stream: torch.cuda.Stream | None = None
        # Decode of the next tile overlaps this tile's GEMMs (CUDA; twice the scratch).
        self.overlap = overlap
        self.unfolded = unfolded
        cuda = self.device.type == "cuda"
        if unfolded:
            self.gemm = "triton grouped, rotated activations (prefill_gemm)"
            self.rotate_inputs = prefill_gemm.rotate_inputs if cuda else prefill_gemm.rotate_inputs_reference
            self.tile_mlp_rotated = prefill_gemm.tile_mlp_rotated if cuda else prefill_gemm.tile_mlp_rotated_reference
            self.scales = (gate.svh, up.svh, down.suh, down.svh)
            if cuda:
                # The kernels' Hadamard matrix reaches the device here, never first inside a CUDA graph capture
                # (which cannot capture its host-to-device copy).
                prefill_gemm.hadamard_pm1(self.device)
        else:
            self.gemm = "triton grouped (prefill_gemm)"
            self.tile_mlp = prefill_gemm.tile_mlp if cuda else prefill_gemm.tile_mlp_reference

    def scratch(self, buffer: int = 0) -> dict[str, torch.Tensor]:
        """Decoded-weight scratch for one tile (two buffers when decode overlaps the GEMMs), shared by every layer
        of one shape: layers run one after another on the stream, and each call's side stream first waits for
        everything queued before it."""
        key = (str(self.device), self.hidden, self.intermediate, self.tile, buffer)
        if key not in _SCRATCH:
            kw = {"dtype": torch.float16, "device": self.device}
            h, i, t = self.hidden, self.intermediate, self.tile
            _SCRATCH[key] = {"gate": torch.empty((t, h, i), **kw), "up": torch.empty((t, h, i), **kw),
                             "down": torch.empty((t, i, h), **kw)}
        return _SCRATCH[key]

    def _decode(self, name: str, lo: int, hi: int, ids: torch.Tensor | None, buffer: int) -> torch.Tensor:
        """Decode experts lo:hi of the layer (ids None) or the experts `ids` into the tile scratch."""
        p = self.projections[name]
        w = self.scratch(buffer)[name][: hi - lo]
        if ids is None:
            tables = tuple(t[lo:hi] for t in self.ptrs[name])
        else:
            tables = tuple(t.index_select(0, ids) for t in self.ptrs[name])
        if self.unfolded:
            self.ext.reconstruct_batch(w, tables[0], float(p.bits), self.mcg, self.mul1)
        else:
            self.ext.reconstruct_had_batch(w, *tables, float(p.bits), self.mcg, self.mul1)
        return w

    def _decode_tile(self, lo: int, hi: int, ids: torch.Tensor | None, buffer: int) -> tuple[torch.Tensor, ...]:
        return tuple(self._decode(name, lo, hi, ids, buffer) for name in ("gate", "up", "down"))

    def _tile_mlp(self, x16: torch.Tensor, route: Routing, experts: torch.Tensor) -> Callable[..., None]:
        """What runs the GEMMs of one tile: (tile's expert ids, its decoded weights, fp32 out) -> None."""
        counts, starts, tok_sorted, w_sorted = route
        rows = tok_sorted.shape[0]
        act = torch.empty((rows, self.intermediate), dtype=torch.float16, device=x16.device)
        if not self.unfolded:
            return lambda ids, weights, out: self.tile_mlp(x16, tok_sorted, w_sorted, ids, starts, counts, *weights,
                                                           act, out, self.act_limit)
        # Each routed row's input in gate's and up's bases, once per call, for the rows of `experts` only.
        num = self.num_experts
        exp_sorted = torch.repeat_interleave(torch.arange(num + 1, device=x16.device), counts, output_size=rows)
        selected = torch.zeros(num + 1, dtype=torch.int32, device=x16.device).index_fill_(0, experts, 1)
        xg = torch.empty((rows, self.hidden), dtype=torch.float16, device=x16.device)
        xu = torch.empty_like(xg)
        self.rotate_inputs(x16, tok_sorted, exp_sorted, selected, self.projections["gate"].suh,
                           self.projections["up"].suh, xg, xu)
        tokens = x16.shape[0]
        return lambda ids, weights, out: self.tile_mlp_rotated(xg, xu, tok_sorted, w_sorted, ids, starts, counts,
                                                               *weights, self.scales, act, out, self.act_limit, tokens)

    def _run_tiles(self, x16: torch.Tensor, route: Routing, out: torch.Tensor, experts: torch.Tensor,
                   select: bool) -> None:
        bounds = [(lo, min(lo + self.tile, experts.shape[0])) for lo in range(0, experts.shape[0], self.tile)]
        if not (self.overlap and x16.is_cuda and len(bounds) > 1):
            mlp = self._tile_mlp(x16, route, experts)
            for lo, hi in bounds:
                ids = experts[lo:hi]
                mlp(ids, self._decode_tile(lo, hi, ids if select else None, 0), out)
            return
        # Decode tile t+1 on a side stream while the GEMMs of tile t run: two scratch buffers, events between. The
        # side stream is released before the input rotation is queued, so the first tile's decode overlaps it.
        main = torch.cuda.current_stream(x16.device)
        side = self._side_stream()
        side.wait_stream(main)
        mlp = self._tile_mlp(x16, route, experts)
        ready = [torch.cuda.Event(), torch.cuda.Event()]
        free = [torch.cuda.Event(), torch.cuda.Event()]
        for t, (lo, hi) in enumerate(bounds):
            buffer = t % 2
            ids = experts[lo:hi]
            with torch.cuda.stream(side):
                if t >= 2:
                    side.wait_event(free[buffer])
                weights = self._decode_tile(lo, hi, ids if select else None, buffer)
                ready[buffer].record(side)
            main.wait_event(ready[buffer])
            mlp(ids, weights, out)
            free[buffer].record(main)
        main.wait_stream(side)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def apply(self, x16: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """fp32 [T, hidden] routed sum for fp16 x16 [T, hidden] over every expert; no host sync."""
        route = routing(topk_ids, topk_weights, self.num_experts)
        out = torch.zeros((x16.shape[0], self.hidden), dtype=torch.float32, device=x16.device)
        self._run_tiles(x16.contiguous(), route, out, self.all_ids, select=False)
        return out

    def apply_experts(self, x16: torch.Tensor, route: Routing, out: torch.Tensor, experts: list[int]) -> None:
        """Add the routed sum over `experts` only (host-known ids, e.g. the heavy ones) into fp32 out."""
        if experts:
            ids = torch.tensor(experts, dtype=torch.int64).to(x16.device, non_blocking=True)
            self._run_tiles(x16.contiguous(), route, out, ids, select=True)
