"""The EXL3 MoE kernel runtime: binds exllamav3's kernels (and ours, `mcg4_moe`), picks the kernels by
token count, and runs a layer's packed experts through them. Torch only; the vLLM method is in `moe.py`,
the packed layout and tensor-parallel slicing in `packing.py`.

Each projection (gate, up, down) keeps its experts' trellis / suh / svh stacked in one tensor, with
int64 device tables of per-expert pointers, the layout exllamav3's multi-expert kernels read.
`Exl3CudaExperts.apply` computes, for each token t,

    out[t] = sum_j topk_weights[t, j] * down(act(gate(x[t]), up(x[t])))  for e = topk_ids[t, j]

with act = SiLU(g) * u (exllamav3's `act_limit` clamp when set: SiLU(g) clamped from above, u
clamped symmetrically). Routed scaling (GLM's routed_scaling_factor) is NOT applied here: the
caller applies it, as it does for vLLM's unquantized method. Activations run in fp16 (the kernels'
dtype); bf16 in, bf16 out.

Paths, by token count T:
- T <= MCG4_MAX_TOKENS and K=4 mcg experts (GLM-5.3 Flash's format): our decode kernels
  (`mcg4_moe.py`, csrc/mcg4_moe.cu), three launches, no host sync, graph safe. Set
  GLM53_EXL3_MOE_DECODE=exllamav3 to use exllamav3's kernels instead.
- T <= DECODE_MAX_TOKENS: `exl3_moe_coop`, two or three launches, no host sync, fixed scratch:
  safe to capture in a CUDA graph.
- DECODE_MAX_TOKENS < T <= COOP_CHUNKED_MAX_TOKENS: the coop kernels on chunks of
  DECODE_MAX_TOKENS tokens (still no host sync).
- COOP_CHUNKED_MAX_TOKENS < T <= FUSED_ROWS: `exl3_moe` over device-built routing tables. An expert
  gets at most one row per token, so no expert can exceed the fused kernel's row capacity and the
  counts never leave the device.
- T > FUSED_ROWS (prefill), exllamav3 1.6.5's plan: one host read of the per-expert counts; experts
  within the fused capacity run through `exl3_moe`, heavier ones through our tiles (`prefill_moe`:
  exllamav3's batched reconstruct + our Triton grouped GEMMs; per-expert `exl3_gemm` calls when our
  prefill path is off). Inside a CUDA graph capture, `exl3_moe` on chunks of FUSED_ROWS tokens instead.
- Prefill sizes where the GPU's PREFILL_MEASURED table says ours won: our sync-free path (`prefill_moe.py`:
  every expert decoded a tile at a time, Triton grouped GEMMs, no host read, graph safe).
  Set GLM53_EXL3_MOE_PREFILL=exllamav3 to keep exllamav3's kernels everywhere (per-expert exl3_gemm above
  the fused capacity).

Imports only torch at module import; exllamav3's extension is loaded on first use and its
absence (or a missing kernel) is an error, never a silent fallback.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from functools import lru_cache
from typing import Any

import torch

from glm53_overlay.exl3 import mcg4_moe, prefill_moe
from glm53_overlay.exl3.hadamard import HADAMARD_BLOCK
from glm53_overlay.exl3.packing import PackedProjection, slice_for_rank

# Our K=4 mcg decode kernels run up to here; above, exllamav3's exl3_moe decodes each routed expert once
# for all its rows and wins (H200, 2026-11-30: see benchmarks/README.md).
MCG4_MAX_TOKENS = 64
DECODE_KERNEL_ENV = "GLM53_EXL3_MOE_DECODE"
DECODE_KERNELS = ("ours", "exllamav3")
# exllamav3's MAX_BSZN: the coop kernels' token bound (scratch holds MAX_BSZN * top_k slots).
DECODE_MAX_TOKENS = 8
# Up to here, coop calls on chunks of DECODE_MAX_TOKENS beat one exl3_moe call (H200, 2026-11-30:
# 2 x 376 us against 987 us at 16 tokens; at 64 tokens exl3_moe wins, 2142 against ~3000 us).
COOP_CHUNKED_MAX_TOKENS = 16
# exllamav3's CUDA default for the fused kernel's rows per expert (EXL3_MOE_FUSED_ROWS).
FUSED_ROWS = 128
COOP_MAX_SLOTS = 256
# Kernel ids shared by exl3_moe (MOE_ACT_SILU) and exl3_moe_coop (MOE_COOP_ACT_SILU).
ACT_SILU = 0
REQUIRED_KERNELS = (
    "exl3_moe_coop",
    "exl3_moe",
    "exl3_moe_max_concurrency",
    "exl3_gemm",
    "silu_mul",
)
PROJECTIONS = ("gate", "up", "down")
# What `Exl3CudaExperts.path_for` names (reports and checks print them).
PATH_OURS = "ours (mcg4)"
PATH_COOP = "exl3_moe_coop"
PATH_FUSED = "exl3_moe"
PATH_PREFILL = "ours (tiled decode + grouped GEMM)"
PREFILL_KERNEL_ENV = "GLM53_EXL3_MOE_PREFILL"
PREFILL_KERNELS = ("ours", "exllamav3")
# Which prefill path won at each measured size on the H200, random routing, one TP=2 rank of GLM-5.3 Flash:
# PATH_PREFILL is our sync-free path (row `ours_syncfree`), PATH_FUSED exllamav3's plan with our GEMMs for the
# heavy experts (row `ours_plan`), by event time in overlay/benchmarks/results/prefill/bench_prefill.json;
# tests/unit/test_exl3_prefill_moe.py re-derives this table from that file and fails when they disagree. A token
# count uses the winner of the largest measured count at or below it; below the smallest, PATH_FUSED.
PREFILL_MEASURED: tuple[tuple[int, str], ...] = (
    (512, PATH_FUSED),
    (1024, PATH_FUSED),
    (2048, PATH_PREFILL),
    (4096, PATH_PREFILL),
    (7168, PATH_PREFILL),
    (8192, PATH_PREFILL),
)
# Per GPU (compute capability). Not measured elsewhere; GB10 (12, 1) is an estimate from bytes moved at its
# ~273 GB/s: our sync-free path writes and re-reads every expert decoded to fp16 (2 x 7.25 GB, plus 1.8 GB packed,
# per layer call at this shape: >= 60 ms), exl3_moe reads each packed expert once (1.8 GB: >= 6.6 ms), so
# exllamav3's plan at every size there. Other GPUs: the same, until measured.
PREFILL_MEASURED_BY_ARCH: dict[tuple[int, int], tuple[tuple[int, str], ...]] = {(9, 0): PREFILL_MEASURED, (12, 1): ()}


def prefill_measured(capability: tuple[int, int] | None) -> tuple[tuple[int, str], ...]:
    """The prefill table for a GPU; None (the CPU stand-ins of the tests) gets the H200's."""
    return PREFILL_MEASURED if capability is None else PREFILL_MEASURED_BY_ARCH.get(capability, ())


def prefill_kernel_choice() -> str:
    """GLM53_EXL3_MOE_PREFILL: `ours` (default: where PREFILL_MEASURED says it wins) or `exllamav3`."""
    choice = os.environ.get(PREFILL_KERNEL_ENV, "ours")
    if choice not in PREFILL_KERNELS:
        raise ValueError(f"{PREFILL_KERNEL_ENV}={choice!r}: expected one of {', '.join(PREFILL_KERNELS)}")
    return choice


def prefill_wins(tokens: int, measured: tuple[tuple[int, str], ...] = PREFILL_MEASURED) -> bool:
    """True when our prefill path was measured fastest at the largest measured count <= tokens."""
    winner = None
    for count, path in sorted(measured):
        if count <= tokens:
            winner = path
    return winner == PATH_PREFILL


def decode_kernel_choice() -> str:
    """GLM53_EXL3_MOE_DECODE: `ours` (default) or `exllamav3` for the decode-sized MoE calls."""
    choice = os.environ.get(DECODE_KERNEL_ENV, "ours")
    if choice not in DECODE_KERNELS:
        raise ValueError(f"{DECODE_KERNEL_ENV}={choice!r}: expected one of {', '.join(DECODE_KERNELS)}")
    return choice


class Exl3KernelsUnavailable(RuntimeError):
    """exllamav3's CUDA extension (or one of the kernels this path needs) cannot be used."""


def cuda_moe_supported() -> bool:
    """True when the CUDA path can be chosen: a CUDA device and an exllamav3 install are present."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    return any(importlib.util.find_spec(name) is not None for name in ("exllamav3_ext", "exllamav3"))


@lru_cache(maxsize=1)
def load_kernels() -> Any:
    """exllamav3's extension module: a prebuilt `exllamav3_ext`, else exllamav3's JIT build."""
    try:
        if importlib.util.find_spec("exllamav3_ext") is not None:
            ext = importlib.import_module("exllamav3_ext")
        else:
            ext = importlib.import_module("exllamav3.ext").exllamav3_ext
    except Exception as exc:  # ImportError, or the JIT compiler's own errors
        raise Exl3KernelsUnavailable(
            "EXL3 CUDA MoE needs exllamav3's CUDA extension (pip install exllamav3==1.6.5; its first import "
            f"JIT-builds the kernels, set TORCH_CUDA_ARCH_LIST): {exc}"
        ) from exc
    missing = [name for name in REQUIRED_KERNELS if not hasattr(ext, name)]
    if missing:
        raise Exl3KernelsUnavailable(f"exllamav3 extension lacks kernels {missing}; exllamav3 1.6.5 has them")
    return ext


def routing_tables(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """exl3_moe's routing inputs, built on the device with no host sync.

    Returns (expert_count [E+1] int64, token_sorted [T*k] int64, weight_sorted [T*k] fp16), the
    assignments grouped by expert in stable order. Ids outside [0, E) count in the last bin.
    """
    tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    flat_ids = torch.where((flat_ids >= 0) & (flat_ids < num_experts), flat_ids, torch.full_like(flat_ids, num_experts))
    order = torch.argsort(flat_ids, stable=True)
    flat_tokens = torch.arange(tokens, device=topk_ids.device).repeat_interleave(top_k)
    token_sorted = flat_tokens[order]
    weight_sorted = topk_weights.reshape(-1).to(torch.float16)[order]
    # scatter_add_, not bincount: CUDA bincount reads the max back to the host.
    expert_count = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_ids.device)
    expert_count.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    return expert_count, token_sorted, weight_sorted


def coop_counter_len(slots: int, rows: int, intermediate: int, hidden_out: int) -> int:
    """Length of exl3_moe_coop's int32 counter + run-table scratch (exl3_moe_coop_ctr_len)."""
    return slots * (intermediate // HADAMARD_BLOCK) + rows * (hidden_out // HADAMARD_BLOCK) + 2 + (slots + 1) + slots


class Exl3CudaExperts:
    """Packed EXL3 experts of one MoE layer (this rank's share) and the CUDA apply over them."""

    def __init__(
        self,
        gate: PackedProjection,
        up: PackedProjection,
        down: PackedProjection,
        *,
        codebook: str,
        top_k: int,
        act_limit: float = 0.0,
    ) -> None:
        if codebook not in ("mcg", "mul1"):
            raise Exl3KernelsUnavailable(f"exllamav3's fused MoE kernels support the mcg and mul1 codebooks, not {codebook!r}")
        if gate.bits != up.bits:
            raise ValueError(f"gate ({gate.bits} bits) and up ({up.bits} bits) must share a bit width")
        if gate.trellis.shape != up.trellis.shape or down.in_features != up.out_features or down.out_features != up.in_features:
            raise ValueError(
                f"expert shapes do not chain: gate {tuple(gate.trellis.shape)} up {tuple(up.trellis.shape)} "
                f"down {tuple(down.trellis.shape)}"
            )
        if not 1 <= top_k or DECODE_MAX_TOKENS * top_k > COOP_MAX_SLOTS:
            raise ValueError(f"top_k {top_k} out of range for exl3_moe_coop")
        self.gate, self.up, self.down = gate, up, down
        self.codebook = codebook
        self.top_k = top_k
        self.act_limit = float(act_limit)
        self.num_experts = gate.num_experts
        self.hidden = gate.in_features
        self.intermediate = gate.out_features
        self.device = gate.trellis.device
        self.ext = load_kernels()
        self.ptrs = {name: p.pointer_tables() for name, p in self.projections().items()}
        self._decode = _decode_scratch(self.device, self.hidden, self.intermediate, top_k)
        self._fused: dict[str, torch.Tensor] | None = None
        self.ours = self._our_decode_path()
        self.prefill = self._our_prefill_path()
        self.prefill_measured = prefill_measured(
            torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None)

    def _our_prefill_path(self) -> prefill_moe.PrefillExperts | None:
        # Older exllamav3 builds lack the batched reconstructs: then prefill stays on exl3_moe.
        decode = "reconstruct_batch" if prefill_moe.UNFOLDED else "reconstruct_had_batch"
        if prefill_kernel_choice() != "ours" or not hasattr(self.ext, decode):
            return None
        return prefill_moe.PrefillExperts(self.gate, self.up, self.down, codebook=self.codebook, ext=self.ext,
                                          act_limit=self.act_limit)

    def _our_decode_path(self) -> mcg4_moe.Mcg4Experts | None:
        if decode_kernel_choice() != "ours" or mcg4_moe.unsupported_reason(self.gate, self.up, self.down, self.codebook):
            return None
        return mcg4_moe.Mcg4Experts(self.gate, self.up, self.down, act_limit=self.act_limit)

    def projections(self) -> dict[str, PackedProjection]:
        return {"gate": self.gate, "up": self.up, "down": self.down}

    @property
    def mcg(self) -> bool:
        return self.codebook == "mcg"

    @property
    def mul1(self) -> bool:
        return self.codebook == "mul1"

    def apply(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Routed-expert sum for x [T, hidden] (any float dtype); returns x's dtype."""
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [tokens, {self.hidden}], got {tuple(x.shape)}")
        if topk_ids.shape != (x.shape[0], self.top_k) or topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"topk ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} must be [{x.shape[0]}, {self.top_k}]"
            )
        tokens = x.shape[0]
        if tokens == 0:
            return torch.zeros_like(x)
        path = self.path_for(tokens)
        if path == PATH_OURS:
            return self.ours.apply(x, topk_ids, topk_weights)
        x16 = x.to(torch.float16).contiguous()
        if path == PATH_COOP:
            # apply_decode returns a view of shared scratch: each chunk is copied out before the next.
            chunks = [
                self.apply_decode(x16[i : i + DECODE_MAX_TOKENS], topk_ids[i : i + DECODE_MAX_TOKENS],
                                  topk_weights[i : i + DECODE_MAX_TOKENS]).to(x.dtype, copy=True)
                for i in range(0, tokens, DECODE_MAX_TOKENS)
            ]
            return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        if path == PATH_PREFILL:
            # No host sync: also inside a CUDA graph capture.
            return self.prefill.apply(x16, topk_ids, topk_weights).to(x.dtype)
        return self.apply_fused(x16, topk_ids, topk_weights).to(x.dtype)

    def path_for(self, tokens: int) -> str:
        """Which kernels `apply` runs for this many tokens."""
        if self.ours is not None and tokens <= MCG4_MAX_TOKENS:
            return PATH_OURS
        if tokens <= COOP_CHUNKED_MAX_TOKENS:
            return PATH_COOP
        if self.prefill is not None and prefill_wins(tokens, self.prefill_measured):
            return PATH_PREFILL
        return PATH_FUSED

    def apply_decode(self, x16: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """exl3_moe_coop for <= DECODE_MAX_TOKENS tokens; fp32 [T, hidden] (a view of shared scratch)."""
        s = self._decode
        g, u, d = self.ptrs["gate"], self.ptrs["up"], self.ptrs["down"]
        self.ext.exl3_moe_coop(
            x16,
            topk_ids.to(torch.int64).contiguous(),
            topk_weights.to(torch.float16).contiguous(),
            -1,
            -1,
            self.hidden,
            *g,
            *u,
            *d,
            None,
            None,
            None,
            float(self.gate.bits),
            float(self.up.bits),
            float(self.down.bits),
            self.mcg,
            self.mul1,
            ACT_SILU,
            self.act_limit,
            True,
            s["had_g"],
            s["had_u"],
            s["gu_g"],
            s["gu_u"],
            s["act_out"],
            s["d_out"],
            s["ctr"],
            s["out"],
            None,
            None,
        )
        return s["out"][: x16.shape[0]]

    def apply_fused(self, x16: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """exllamav3 1.6.5's prefill plan: exl3_moe for experts within its row capacity, the heavier ones through
        our tiles (`prefill.apply_experts`; per-expert exl3_gemm when our prefill path is off); fp32 [T, hidden]."""
        tokens = x16.shape[0]
        if tokens > FUSED_ROWS and x16.is_cuda and torch.cuda.is_current_stream_capturing():
            # A CUDA graph cannot read the counts back; chunks of FUSED_ROWS tokens keep every expert within
            # exl3_moe's rows (slower than one call, but only graphs of > FUSED_ROWS tokens take it).
            return torch.cat([self.apply_fused(x16[i : i + FUSED_ROWS], topk_ids[i : i + FUSED_ROWS],
                                               topk_weights[i : i + FUSED_ROWS]) for i in range(0, tokens, FUSED_ROWS)])
        expert_count, token_sorted, weight_sorted = routing_tables(topk_ids, topk_weights, self.num_experts)
        out = torch.zeros((tokens, self.hidden), dtype=torch.float32, device=x16.device)
        if tokens <= FUSED_ROWS:
            self._run_fused(x16, out, expert_count, token_sorted, weight_sorted, num_active=-1)
            return out
        counts = expert_count.tolist()[: self.num_experts]  # the one host sync, prefill only
        light = sum(1 for c in counts if 0 < c <= FUSED_ROWS)
        if light:
            self._run_fused(x16, out, expert_count, token_sorted, weight_sorted, num_active=light)
        heavy = [expert for expert, count in enumerate(counts) if count > FUSED_ROWS]
        if heavy and self.prefill is not None:
            # exllamav3 1.6.5's plan (BlockSparseMLP.forward): the experts above exl3_moe's rows decoded a tile
            # at a time and run as grouped GEMMs; here our Triton GEMMs over exllamav3's reconstruct.
            starts = torch.cumsum(expert_count, 0) - expert_count
            self.prefill.apply_experts(x16, (expert_count, starts, token_sorted, weight_sorted), out, heavy)
            return out
        start = 0
        for expert, count in enumerate(counts):
            if count > FUSED_ROWS:
                rows = token_sorted[start : start + count]
                y = self.expert_forward(expert, x16.index_select(0, rows))
                out.index_add_(0, rows, y * weight_sorted[start : start + count].float().unsqueeze(1))
            start += count
        return out

    def _run_fused(self, x16, out, expert_count, token_sorted, weight_sorted, *, num_active: int) -> None:
        f = self._fused_scratch()
        g, u, d = self.ptrs["gate"], self.ptrs["up"], self.ptrs["down"]
        self.ext.exl3_moe(
            x16,
            out,
            expert_count,
            token_sorted,
            weight_sorted,
            f["state_g"],
            f["state_u"],
            f["inter_g"],
            f["inter_u"],
            ACT_SILU,
            float(self.gate.bits),
            float(self.up.bits),
            float(self.down.bits),
            *g,
            *u,
            *d,
            self.mcg,
            self.mul1,
            self.mcg,
            self.mul1,
            self.mcg,
            self.mul1,
            self.act_limit,
            num_active,
            None,
            None,
            1,
            FUSED_ROWS,
            16,
        )

    def _fused_scratch(self) -> dict[str, torch.Tensor]:
        if self._fused is None:
            self._fused = _fused_scratch(self.device, self.hidden, self.intermediate, self.ext)
        return self._fused

    def expert_forward(self, expert: int, x16: torch.Tensor) -> torch.Tensor:
        """One expert's MLP on rows x16 [m, hidden] through exl3_gemm; fp32 [m, hidden]."""
        rows = x16.shape[0]
        gate = self._gemm(self.gate, expert, x16, torch.float16)
        up = self._gemm(self.up, expert, x16, torch.float16)
        act = torch.empty((rows, self.intermediate), dtype=torch.float16, device=x16.device)
        self.ext.silu_mul(gate, up, act, self.act_limit)
        return self._gemm(self.down, expert, act, torch.float32)

    def _gemm(self, p: PackedProjection, expert: int, a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        c = torch.empty((a.shape[0], p.out_features), dtype=dtype, device=a.device)
        a_had = torch.empty_like(a)
        self.ext.exl3_gemm(a, p.trellis[expert], c, p.suh[expert], a_had, p.svh[expert], -1, self.mcg, self.mul1, 0)
        return c


_SCRATCH: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}


def _decode_scratch(device: torch.device, hidden: int, intermediate: int, top_k: int) -> dict[str, torch.Tensor]:
    """exl3_moe_coop scratch, shared by every layer of one shape (layers run one after another)."""
    key = ("coop", str(device), hidden, intermediate, top_k)
    if key not in _SCRATCH:
        slots = DECODE_MAX_TOKENS * top_k
        kw = {"device": device}
        _SCRATCH[key] = {
            "had_g": torch.empty((slots, hidden), dtype=torch.float16, **kw),
            "had_u": torch.empty((slots, hidden), dtype=torch.float16, **kw),
            "gu_g": torch.empty((slots, intermediate), dtype=torch.float32, **kw),
            "gu_u": torch.empty((slots, intermediate), dtype=torch.float32, **kw),
            "act_out": torch.empty((slots, intermediate), dtype=torch.float16, **kw),
            "d_out": torch.empty((slots, hidden), dtype=torch.float32, **kw),
            # The kernels zero each counter after use; they must start at zero once.
            "ctr": torch.zeros(coop_counter_len(slots, DECODE_MAX_TOKENS, intermediate, hidden), dtype=torch.int32, **kw),
            "out": torch.empty((DECODE_MAX_TOKENS, hidden), dtype=torch.float32, **kw),
        }
    return _SCRATCH[key]


def _fused_scratch(device: torch.device, hidden: int, intermediate: int, ext: Any) -> dict[str, torch.Tensor]:
    key = ("fused", str(device), hidden, intermediate)
    if key not in _SCRATCH:
        groups = int(ext.exl3_moe_max_concurrency(torch.device(device).index or 0))
        kw = {"dtype": torch.float16, "device": device}
        _SCRATCH[key] = {
            "state_g": torch.empty((groups, FUSED_ROWS, hidden), **kw),
            "state_u": torch.empty((groups, FUSED_ROWS, hidden), **kw),
            "inter_g": torch.empty((groups, FUSED_ROWS, intermediate), **kw),
            "inter_u": torch.empty((groups, FUSED_ROWS, intermediate), **kw),
        }
    return _SCRATCH[key]


def experts_from_packed(
    packed: dict[tuple[int, str], dict[str, torch.Tensor]],
    local_experts: list[int],
    *,
    codebook: str,
    top_k: int,
    tp_rank: int,
    tp_size: int,
    intermediate_per_rank: int,
    device: torch.device | str,
    act_limit: float = 0.0,
) -> Exl3CudaExperts:
    """Build a layer's packed experts from the loader's {(expert, w1|w3|w2): {trellis, suh, svh}}."""
    shards = {"gate": "w1", "up": "w3", "down": "w2"}
    stacked = {}
    for name, shard in shards.items():
        parts = []
        for expert in local_experts:
            p = packed[(expert, shard)]
            parts.append(slice_for_rank(p["trellis"], p["suh"], p["svh"], name, tp_rank, tp_size, intermediate_per_rank))
        stacked[name] = PackedProjection.stack(parts, device)
    return Exl3CudaExperts(
        stacked["gate"], stacked["up"], stacked["down"], codebook=codebook, top_k=top_k, act_limit=act_limit
    )
