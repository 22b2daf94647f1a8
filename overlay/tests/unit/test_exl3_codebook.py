"""Codebooks must match exllamav3's `ext.decode` for all 65,536 states, bit for bit."""

from __future__ import annotations

import pytest
import torch

from glm53_overlay.exl3.codebook import (
    MCG_MULTIPLIER,
    MUL1_MULTIPLIER,
    codebook_from_marker,
    decode_lut,
    decode_states,
)
from glm53_overlay.exl3.vectors import VectorSet


def test_lut_is_bit_exact(vectors: VectorSet) -> None:
    if not vectors.luts:
        pytest.skip("this vector file carries no LUTs (make_vectors.py entries only)")
    assert set(vectors.luts) == {"3inst", "mcg", "mul1"}
    for codebook, expected in vectors.luts.items():
        mine = decode_lut(codebook)[:: vectors.lut_stride]  # type: ignore[arg-type]
        assert torch.equal(mine.view(torch.int16), expected.view(torch.int16)), codebook


def test_int16_states_are_read_unsigned() -> None:
    states = torch.tensor([-1, -32768, 0, 32767], dtype=torch.int16)
    unsigned = torch.tensor([65535, 32768, 0, 32767])
    assert torch.equal(decode_states(states, "mcg"), decode_states(unsigned, "mcg"))


def test_markers_name_the_codebook(vectors: VectorSet) -> None:
    for entry in vectors.entries:
        assert codebook_from_marker(entry.get("mcg"), entry.get("mul1")) == entry.codebook


def test_bad_markers_are_refused() -> None:
    with pytest.raises(ValueError, match="expected"):
        codebook_from_marker(torch.tensor(1, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="both"):
        codebook_from_marker(MCG_MULTIPLIER, MUL1_MULTIPLIER)
    with pytest.raises(ValueError, match="unknown"):
        decode_states(torch.zeros(1), "e8p")  # type: ignore[arg-type]
