"""Trellis unpacking: bit-exact against exllamav3's `unpack_trellis`, and against a bit-by-bit
Python reading of the format for every K in 1..8 (the shipped vectors cover K = 2 and 4)."""

from __future__ import annotations

import pytest
import torch

from glm53_overlay.exl3.trellis import bits_per_weight, tile_position_index, unpack_states
from glm53_overlay.exl3.vectors import VectorSet


def test_states_are_bit_exact(vectors: VectorSet) -> None:
    for entry in vectors.entries:
        expected = entry.get("states")
        assert expected is not None, entry.name
        assert torch.equal(unpack_states(entry.tensors["trellis"])[: expected.shape[0]], expected), entry.name


def _states_bit_by_bit(words: list[int], k_bits: float) -> list[int]:
    """The format read literally: uint16 pairs swapped per 32-bit word, MSB-first ring of bits; position
    t takes K fresh bits, or for K = KA + 0.5 KA bits at even t and KA + 1 at odd t (exllamav3's frac.cu)."""
    stream = "".join(f"{words[i + 1] & 0xFFFF:016b}{words[i] & 0xFFFF:016b}" for i in range(0, len(words), 2))
    ring = len(stream)
    ends, end = [], 0
    for t in range(256):
        end += int(k_bits) + (t % 2 if k_bits % 1 else 0)
        ends.append(end)
    return [int("".join(stream[(end - 16 + j) % ring] for j in range(16)), 2) for end in ends]


@pytest.mark.parametrize("k_bits", [*range(1, 9), 1.5, 2.5, 3.5, 7.5])
def test_states_match_bit_by_bit_reading(k_bits: float) -> None:
    generator = torch.Generator().manual_seed(int(k_bits * 2))
    trellis = torch.randint(-32768, 32768, (2, 1, int(16 * k_bits)), generator=generator).to(torch.int16)
    assert bits_per_weight(trellis) == k_bits
    states = unpack_states(trellis).to(torch.int32) & 0xFFFF
    for tile_k in range(2):
        assert states[tile_k, 0].tolist() == _states_bit_by_bit(trellis[tile_k, 0].tolist(), k_bits)


def test_tile_position_index_is_a_permutation() -> None:
    assert sorted(tile_position_index().flatten().tolist()) == list(range(256))


@pytest.mark.parametrize("shape", [(1, 1, 36), (1, 1, 0), (1, 1, 144), (1, 1, 136), (1, 1, 8), (16, 64)])
def test_bits_per_weight_refuses_unsupported_shapes(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        bits_per_weight(torch.zeros(shape, dtype=torch.int16))
