"""Reading exllamav3 kernel test vectors and judging the reference decoder against them.

Vector files hold, per entry `{codebook}_K{K}`: `_trellis`, `_suh`, `_svh`, and any of `_states`,
`_W_hat`, `_W`, `_y`, `_y_f32ref`; plus `x` and `{codebook}_lut`. Subsets keep only leading rows of
the big tensors and every `lut_stride`-th LUT value (file metadata); comparisons use the rows present.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors import safe_open

from glm53_overlay.exl3.codebook import Codebook, decode_lut
from glm53_overlay.exl3.reference import dequantize, matmul, reconstruct_rotated
from glm53_overlay.exl3.trellis import unpack_states

PACKAGED_VECTORS = "exl3_selfcheck_vectors.safetensors"
_ENTRY = re.compile(r"^(3inst|mcg|mul1)_K(\d+(?:\.5)?)_trellis$")

# Tolerances, and why:
# - LUT, states, W_hat: integer/bit manipulation plus one fp16 rounding per value -> bit exact.
# - W: two fp32 Hadamard products; exllamav3 and torch may sum the 128 terms in a different order,
#   which can move an fp16 result by one ulp.
# - y: exllamav3's exl3_gemm accumulates in its own order and rounds rotated intermediates to fp16;
#   measured against fp32 x @ W it is 6-7e-4 relative RMS, so we allow 1.5e-3 and 2 fp16 ulps of
#   the largest output.
W_MAX_ULPS = 1
Y_MAX_REL_RMS = 1.5e-3
Y_MAX_ABS_ULPS_OF_MAX = 2


@dataclass(frozen=True)
class VectorEntry:
    name: str
    codebook: Codebook
    bits: int | float
    tensors: dict[str, torch.Tensor]

    def get(self, part: str) -> torch.Tensor | None:
        return self.tensors.get(part)


@dataclass(frozen=True)
class VectorSet:
    x: torch.Tensor
    luts: dict[str, torch.Tensor]
    lut_stride: int
    entries: list[VectorEntry]


def packaged_vectors_path() -> Path:
    return Path(str(resources.files("glm53_overlay") / "data" / PACKAGED_VECTORS))


def load_vectors(path: Path) -> VectorSet:
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        tensors = {key: f.get_tensor(key) for key in keys}
        metadata = f.metadata() or {}
    entries = []
    for key in sorted(keys):
        match = _ENTRY.match(key)
        if not match:
            continue
        name = key.removesuffix("_trellis")
        parts = {k.removeprefix(name + "_"): v for k, v in tensors.items() if k.startswith(name + "_")}
        bits = float(match.group(2))
        entries.append(VectorEntry(name, match.group(1), int(bits) if bits.is_integer() else bits, parts))  # type: ignore[arg-type]
    luts = {k.removesuffix("_lut"): v for k, v in tensors.items() if k.endswith("_lut")}
    return VectorSet(tensors["x"], luts, int(metadata.get("lut_stride", "1")), entries)


def fp16_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in fp16 representable steps (0 = same value)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.to(torch.float16).contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def fp16_ulp(value: float) -> float:
    return float(torch.finfo(torch.float16).eps) * 2.0 ** torch.tensor(abs(value)).log2().floor().item()


def check_vectors(vectors: VectorSet) -> list[str]:
    """Every disagreement beyond the tolerances above, as readable lines (empty = all good)."""
    failures: list[str] = []
    for codebook, lut in vectors.luts.items():
        mine = decode_lut(codebook)[:: vectors.lut_stride]  # type: ignore[arg-type]
        if not torch.equal(mine.view(torch.int16), lut.view(torch.int16)):
            failures.append(f"{codebook} LUT: {int((mine != lut).sum())} values differ")
    for entry in vectors.entries:
        failures.extend(_check_entry(entry, vectors.x))
    return failures


def _check_entry(entry: VectorEntry, x: torch.Tensor) -> list[str]:
    failures = []
    trellis, suh, svh = entry.tensors["trellis"], entry.tensors["suh"], entry.tensors["svh"]
    exact = {
        "states": lambda: unpack_states(trellis),
        "W_hat": lambda: reconstruct_rotated(trellis, codebook=entry.codebook),
    }
    for part, compute in exact.items():
        ref = entry.get(part)
        if ref is not None and not torch.equal(compute()[: ref.shape[0]].view(torch.int16), ref.view(torch.int16)):
            failures.append(f"{entry.name} {part}: not bit-exact")
    ref_w = entry.get("W")
    if ref_w is not None:
        w = dequantize(trellis, suh, svh, codebook=entry.codebook)
        ulps = int(fp16_ulp_distance(w[: ref_w.shape[0]], ref_w).max())
        if ulps > W_MAX_ULPS:
            failures.append(f"{entry.name} W: {ulps} fp16 ulps off (allowed {W_MAX_ULPS})")
    ref_y = entry.get("y")
    if ref_y is not None:
        y = matmul(x, trellis, suh, svh, codebook=entry.codebook).float()
        rel_rms = float((y - ref_y.float()).norm() / ref_y.float().norm())
        max_abs = float((y - ref_y.float()).abs().max())
        allowed_abs = Y_MAX_ABS_ULPS_OF_MAX * fp16_ulp(float(ref_y.float().abs().max()))
        if rel_rms > Y_MAX_REL_RMS or max_abs > allowed_abs:
            failures.append(f"{entry.name} y: rel RMS {rel_rms:.2e}, max abs {max_abs:.3g} (allowed {allowed_abs:.3g})")
    return failures
