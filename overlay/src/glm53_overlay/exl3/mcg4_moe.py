"""Our CUDA decode path for K=4 mcg EXL3 experts (csrc/mcg4_moe.cu), for a few tokens per step.

Each (token, routed expert) pair is decoded on its own, so the work is T * top_k experts where
exllamav3's kernels decode each distinct expert once: 4% more at 4 tokens of GLM-5.3 Flash's top-8 of
288, 10% more at 8, twice as much at 64 (why exl3_moe takes over above 64). Three launches, no host sync, scratch allocated per call
from torch's caching allocator: safe to capture in a CUDA graph.

Numerics: the codebook value lo + hi of each weight is summed in fp32 by the tensor core instead of
rounded to fp16 first, so each weight is within half an fp16 ulp of the reference decoder's (see
`exact_mcg_values`); activations are rounded to fp16 after each input rotation, as exllamav3 does.

The extension is built by torch's JIT on first use (TORCH_CUDA_ARCH_LIST picks the targets;
sm_90 for an H200, 12.1a for a GB10) and cached under TORCH_EXTENSIONS_DIR.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from glm53_overlay.exl3.codebook import HALF_PAIR_MASK, mcg_halves
from glm53_overlay.exl3.packing import PackedProjection

SOURCE = Path(__file__).with_name("csrc") / "mcg4_moe.cu"
EXTENSION_NAME = "glm53_exl3_mcg4_moe"
BITS = 4
# Shared memory holds the rotated input at 4 bytes per feature next to 8 KiB of split-K sums.
MAX_FEATURES = 8192
FEATURE_MULTIPLE = 128


@dataclass(frozen=True)
class LaunchShape:
    """Warps per block of the gate/up and down kernels, and whether down and combine start as
    programmatic dependents of the kernel before them."""

    gate_up_warps: int = 8
    down_warps: int = 8
    pdl: bool = True

    def check(self) -> None:
        for name, warps in (("gate_up_warps", self.gate_up_warps), ("down_warps", self.down_warps)):
            if warps not in WARP_CHOICES:
                raise ValueError(f"{name}={warps}: expected one of {WARP_CHOICES}")


WARP_CHOICES = (4, 8, 16)
# Programmatic dependent launch only on SM 9.x (Hopper) and 10.x (datacenter Blackwell). The recipe gates
# vLLM's PDL the same way because on SM12x (GB10 is sm_121) it races the KDA state kernels; our kernels
# share the stream with them, so ours stay off there too. Below 9.0 the hardware has none.
PDL_MAJORS = (9, 10)
# Fastest shape per token count, from benchmarks/tune_mcg4.py on the H200 (sm_90, 132 SMs;
# results/tune_mcg4.json); a count takes the shape of the largest entry at or below it.
H200_SHAPES: dict[int, LaunchShape] = {
    1: LaunchShape(gate_up_warps=8, down_warps=8),
    8: LaunchShape(gate_up_warps=8, down_warps=4),
}
# Tuned tables by compute capability. Every other device (GB10's sm_121 with 48 SMs included) runs the H200
# shapes as a fallback: the grids do not depend on the shape (blocks = columns/16 x pairs), only the
# warps that share one block's K loop do, and the register budget (24 warps per SM) is the same on both,
# so the H200 choice is a sound start, not a measured optimum. tune_mcg4.py on a GB10 fills an entry.
TUNED_SHAPES: dict[tuple[int, int], dict[int, LaunchShape]] = {(9, 0): H200_SHAPES}


def pdl_allowed(capability: tuple[int, int] | None) -> bool:
    """Whether PDL may be used on a device of this compute capability (None: not a CUDA device)."""
    return capability is not None and capability[0] in PDL_MAJORS


def shapes_for(capability: tuple[int, int] | None) -> tuple[dict[int, LaunchShape], str]:
    """The launch-shape table for a device and where it comes from (reports print it)."""
    if capability in TUNED_SHAPES:
        return TUNED_SHAPES[capability], f"tuned on sm_{capability[0]}{capability[1]}"
    where = f"sm_{capability[0]}{capability[1]}" if capability else "a non-CUDA device"
    return H200_SHAPES, f"H200 (sm_90) shapes as the fallback on {where} (not tuned there)"


def launch_shape(tokens: int, capability: tuple[int, int] | None = (9, 0)) -> LaunchShape:
    """The launch options for this many tokens on a device of this capability: its tuned (or fallback)
    shape, with PDL only where `pdl_allowed`."""
    table = shapes_for(capability)[0]
    shape = table[max(t for t in table if t <= max(tokens, 1))]
    return replace(shape, pdl=shape.pdl and pdl_allowed(capability))


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device; None for any other device (the CPU stand-ins in tests)."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None  # type: ignore[return-value]


class Mcg4Unavailable(RuntimeError):
    """The extension could not be built or loaded."""


def unsupported_reason(gate: PackedProjection, up: PackedProjection, down: PackedProjection, codebook: str) -> str | None:
    """Why these experts cannot run on this path (None when they can)."""
    if codebook != "mcg":
        return f"codebook {codebook!r} (this path decodes mcg only)"
    for name, p in (("gate", gate), ("up", up), ("down", down)):
        if p.bits != BITS:
            return f"{name} experts are K={p.bits} (this path decodes K={BITS} only)"
    for name, size in (("hidden", gate.in_features), ("intermediate", gate.out_features)):
        if size % FEATURE_MULTIPLE or size > MAX_FEATURES:
            return f"{name} size {size} (needs a multiple of {FEATURE_MULTIPLE}, at most {MAX_FEATURES})"
    return None


@lru_cache(maxsize=1)
def load_extension() -> Any:
    from torch.utils.cpp_extension import load

    try:
        return load(name=EXTENSION_NAME, sources=[str(SOURCE)], extra_cuda_cflags=["-O3"], verbose=False)
    except Exception as exc:  # the compiler's own errors, or a missing toolkit
        raise Mcg4Unavailable(
            f"building {SOURCE.name} failed (needs nvcc and TORCH_CUDA_ARCH_LIST for this GPU; "
            f"GLM53_EXL3_MOE_DECODE=exllamav3 runs without it): {exc}"
        ) from exc


class Mcg4Experts:
    """One MoE layer's packed K=4 mcg experts (this rank's share) and the decode-path apply over them."""

    def __init__(
        self, gate: PackedProjection, up: PackedProjection, down: PackedProjection, *, act_limit: float, pdl: bool = True
    ) -> None:
        reason = unsupported_reason(gate, up, down, "mcg")
        if reason is not None:
            raise ValueError(f"mcg4 decode path cannot run these experts: {reason}")
        self.gate, self.up, self.down = gate, up, down
        self.act_limit = float(act_limit)
        self.hidden = gate.in_features
        self.intermediate = gate.out_features
        self.ext = load_extension()
        self.capability = device_capability(gate.trellis.device)
        # False forces PDL off where the device would allow it (benchmarks/bench_moe.py times its cost).
        self.pdl = pdl
        # Read by the kernels from memory, not as an immediate: see mcg_hash in the source. int64 -> int32
        # keeps the 32 bits.
        self.consts = torch.tensor([HALF_PAIR_MASK], dtype=torch.int64).to(torch.int32).to(gate.trellis.device)

    def apply(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, shape: LaunchShape | None = None
    ) -> torch.Tensor:
        """sum_j w[t, j] * expert_j(x[t]) for x [T, hidden] fp16/bf16 (fp32 is cast to bf16); returns x's dtype."""
        tokens, top_k = topk_ids.shape
        shape = shape or launch_shape(tokens, self.capability)
        shape.check()
        # An explicit shape (the tuner, the PDL benchmark) may ask for PDL; the device gate still applies.
        pdl = shape.pdl and self.pdl and pdl_allowed(self.capability)
        xin = x if x.dtype in (torch.float16, torch.bfloat16) else x.to(torch.bfloat16)
        ids = topk_ids if topk_ids.dtype in (torch.int32, torch.int64) else topk_ids.to(torch.int64)
        pairs = tokens * top_k
        gu = torch.empty((2, pairs, self.intermediate), dtype=torch.float32, device=x.device)
        y = torch.empty((pairs, self.hidden), dtype=torch.float32, device=x.device)
        out = torch.empty((tokens, self.hidden), dtype=x.dtype, device=x.device)
        g, u, d = self.gate, self.up, self.down
        self.ext.mcg4_moe(
            xin.contiguous(), ids.contiguous(), topk_weights.to(torch.float32).contiguous(),
            g.trellis, g.suh, g.svh, u.trellis, u.suh, u.svh, d.trellis, d.suh, d.svh,
            gu, y, out, self.consts, self.act_limit, shape.gate_up_warps, shape.down_warps,
            pdl, _stream_handle(x.device),
        )
        return out


def _stream_handle(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def exact_mcg_values(states: torch.Tensor) -> torch.Tensor:
    """What this path multiplies by: lo + hi of each state's masked mcg hash, in fp32 (no fp16 rounding)."""
    low, high = mcg_halves(states)
    return low + high
