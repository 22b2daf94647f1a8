"""The reference decoder against exllamav3's own GPU outputs.

Tolerances (measured values in brackets, both vector files):
- W_hat: bit exact [0 differing values].
- W: at most 1 fp16 ulp, because fp32 Hadamard sums may be ordered differently than in exllamav3
  [measured: 0 ulps, bit exact].
- x @ W in fp32 vs exllamav3's fp32 reference `y_f32ref` (computed from its W on the GPU): relative
  RMS 1e-6, i.e. only fp32 summation order [measured ~1e-7].
- y vs exllamav3's `exl3_gemm`: the kernel rounds rotated intermediates to fp16 and is itself 6-7e-4
  relative RMS from fp32 x @ W, so relative RMS <= 1.5e-3 and max abs <= 2 fp16 ulps of max |y|
  [measured: rel RMS 6.3-7.0e-4, max abs 0.047-0.0625 = 1 ulp at |y| ~ 64-128].
"""

from __future__ import annotations

import pytest
import torch

from glm53_overlay.exl3.reference import dequantize, matmul, reconstruct_rotated
from glm53_overlay.exl3.vectors import (
    W_MAX_ULPS,
    Y_MAX_ABS_ULPS_OF_MAX,
    Y_MAX_REL_RMS,
    VectorEntry,
    VectorSet,
    check_vectors,
    fp16_ulp,
    fp16_ulp_distance,
)


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_w_hat_is_bit_exact(vectors: VectorSet) -> None:
    for entry in vectors.entries:
        expected = entry.tensors["W_hat"]
        mine = reconstruct_rotated(entry.tensors["trellis"], codebook=entry.codebook)
        assert mine.dtype == torch.float16
        assert torch.equal(mine[: expected.shape[0]].view(torch.int16), expected.view(torch.int16)), entry.name


def test_w_within_one_ulp(vectors: VectorSet) -> None:
    for entry in vectors.entries:
        t = entry.tensors
        w = dequantize(t["trellis"], t["suh"], t["svh"], codebook=entry.codebook)
        assert w.dtype == torch.float16 and w.shape == (256, 256)
        assert int(fp16_ulp_distance(w[: t["W"].shape[0]], t["W"]).max()) <= W_MAX_ULPS, entry.name


def test_fp32_product_reproduces_exllamav3_fp32_reference(vectors: VectorSet) -> None:
    for entry in vectors.entries:
        t = entry.tensors
        w = dequantize(t["trellis"], t["suh"], t["svh"], codebook=entry.codebook)
        assert _rel_rms(vectors.x.float() @ w.float(), t["y_f32ref"]) < 1e-6, entry.name


def test_matmul_matches_exl3_gemm(vectors: VectorSet) -> None:
    for entry in vectors.entries:
        t = entry.tensors
        y = matmul(vectors.x, t["trellis"], t["suh"], t["svh"], codebook=entry.codebook)
        assert y.dtype == torch.float16 and y.shape == t["y"].shape
        assert _rel_rms(y, t["y"]) <= Y_MAX_REL_RMS, entry.name
        max_abs = float((y.float() - t["y"].float()).abs().max())
        assert max_abs <= Y_MAX_ABS_ULPS_OF_MAX * fp16_ulp(float(t["y"].float().abs().max())), entry.name


def test_check_vectors_reports_nothing(vectors: VectorSet) -> None:
    assert check_vectors(vectors) == []


def test_check_vectors_reports_a_corrupted_weight(vectors: VectorSet) -> None:
    entry = vectors.entries[0]
    broken = dict(entry.tensors, W=entry.tensors["W"] * 1.01)
    corrupted = VectorSet(vectors.x, {}, vectors.lut_stride, [VectorEntry(entry.name, entry.codebook, entry.bits, broken)])
    assert any("W:" in failure for failure in check_vectors(corrupted))


@pytest.mark.parametrize("k_bits", range(1, 9))
@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_every_k_decodes_to_a_unit_scale_weight(k_bits: int, codebook: str) -> None:
    generator = torch.Generator().manual_seed(k_bits)
    trellis = torch.randint(-32768, 32768, (8, 8, 16 * k_bits), generator=generator).to(torch.int16)
    ones = torch.ones(128, dtype=torch.float16)
    w = dequantize(trellis, ones, ones, codebook=codebook)  # type: ignore[arg-type]
    assert w.shape == (128, 128) and torch.isfinite(w).all()
    # Codebooks are built to be ~unit Gaussian and the rotations are orthonormal.
    assert 0.7 < float(w.float().std()) < 1.4


@pytest.mark.parametrize("k_bits", [1.5, 2.5, 3.5])
def test_half_integer_k_decodes_with_mul1_only(k_bits: float) -> None:
    generator = torch.Generator().manual_seed(int(k_bits * 2))
    trellis = torch.randint(-32768, 32768, (8, 8, int(16 * k_bits)), generator=generator).to(torch.int16)
    ones = torch.ones(128, dtype=torch.float16)
    w = dequantize(trellis, ones, ones, codebook="mul1")
    assert w.shape == (128, 128) and 0.7 < float(w.float().std()) < 1.4
    with pytest.raises(ValueError, match="mul1"):
        dequantize(trellis, ones, ones, codebook="mcg")


def test_mismatched_scales_are_refused() -> None:
    trellis = torch.zeros(8, 8, 32, dtype=torch.int16)
    with pytest.raises(ValueError, match="scales"):
        dequantize(trellis, torch.ones(64), torch.ones(128), codebook="mcg")
    with pytest.raises(ValueError, match="multiples of 128"):
        dequantize(torch.zeros(1, 8, 32, dtype=torch.int16), torch.ones(16), torch.ones(128), codebook="mcg")


def test_decoding_ignores_torch_default_dtype(vectors: VectorSet) -> None:
    # vLLM builds (and post-processes) models with a bf16 default dtype.
    from glm53_overlay.exl3.hadamard import hadamard_128

    entry = vectors.entries[0]
    t = entry.tensors
    hadamard_128.cache_clear()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        w = dequantize(t["trellis"], t["suh"], t["svh"], codebook=entry.codebook)
    finally:
        torch.set_default_dtype(previous)
    assert int(fp16_ulp_distance(w[: t["W"].shape[0]], t["W"]).max()) <= W_MAX_ULPS
