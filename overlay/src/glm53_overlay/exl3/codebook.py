"""EXL3 procedural codebooks: a 16-bit trellis state -> one fp16 weight.

Each function reproduces exllamav3's `decode_3inst<cb>` bit for bit. Intermediate fp16 sums and
FMAs are computed in fp32 and rounded once, which is exact here because every operand pair fits in
fp32's 24-bit mantissa (the masks confine both halves to exponents 2^-3..2^0).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Literal, get_args

import torch

Codebook = Literal["3inst", "mcg", "mul1"]
CODEBOOKS: tuple[str, ...] = get_args(Codebook)

# Checkpoint marker tensors (`.mcg` / `.mul1`) hold these multipliers; absent both, the codebook is 3inst.
MCG_MULTIPLIER = 0xCBAC1FED
MUL1_MULTIPLIER = 0x83DCD12D
_3INST_MULTIPLIER = 89226354
_3INST_INCREMENT = 64248484
HALF_PAIR_MASK = 0x8FFF8FFF
_HALF_PAIR_XOR = 0x3B603B60
_MUL1_BYTE_SUM_BASE = 0x6400  # fp16 bits of 1024.0
_MUL1_SCALE_BITS = 0x1EEE  # fp16 ~1/147.7
_MUL1_BIAS_BITS = 0xC931  # fp16 ~-10.39
_U32 = 0xFFFFFFFF
# TEST ONLY (molecule verify_quality.yml proves the quality gate fails a wrong overlay): a nonzero
# integer here is XORed into the mcg multiplier of the reference decode, so every mcg weight decodes
# wrong while the engine still serves. Unset in production; the CUDA kernels never read it.
TEST_FAULT_ENV = "GLM53_TEST_EXL3_CODEBOOK_FAULT"


def _test_fault() -> int:
    return int(os.environ.get(TEST_FAULT_ENV) or "0", 0)


def _u16_as_half(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret integer tensor values in [0, 65535] as fp16 bit patterns."""
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits)
    return signed.to(torch.int16).view(torch.float16)


def _half_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask/xor a 32-bit hash into its two fp16 halves, as fp32 (3inst and mcg)."""
    x = (x & HALF_PAIR_MASK) ^ _HALF_PAIR_XOR
    return _u16_as_half(x & 0xFFFF).float(), _u16_as_half(x >> 16).float()


def _half_pair_sum(x: torch.Tensor) -> torch.Tensor:
    low, high = _half_pair(x)
    return (low + high).half()


def mcg_halves(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two fp16 halves (as fp32) whose sum, rounded to fp16, is each state's mcg weight."""
    return _half_pair(((states.to(torch.int64) & 0xFFFF) * MCG_MULTIPLIER) & _U32)


def _mul1(x: torch.Tensor) -> torch.Tensor:
    """Byte-sum of the hash mapped through one fp16 FMA."""
    byte_sum = sum(((x >> shift) & 0xFF) for shift in (0, 8, 16, 24))
    h = _u16_as_half(byte_sum + _MUL1_BYTE_SUM_BASE).float()
    scale = _u16_as_half(torch.tensor(_MUL1_SCALE_BITS)).float()
    bias = _u16_as_half(torch.tensor(_MUL1_BIAS_BITS)).float()
    return (h * scale + bias).half()


def decode_states(states: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """Decode 16-bit trellis states (any integer dtype; int16 is read as unsigned) to fp16 weights."""
    x = states.to(torch.int64) & 0xFFFF
    if codebook == "3inst":
        return _half_pair_sum((x * _3INST_MULTIPLIER + _3INST_INCREMENT) & _U32)
    if codebook == "mcg":
        return _half_pair_sum((x * (MCG_MULTIPLIER ^ _test_fault())) & _U32)
    if codebook == "mul1":
        return _mul1((x * MUL1_MULTIPLIER) & _U32)
    raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")


@lru_cache(maxsize=len(CODEBOOKS))
def decode_lut(codebook: Codebook) -> torch.Tensor:
    """All 65,536 codebook values, indexed by the unsigned 16-bit state (fp16, CPU, read-only use)."""
    return decode_states(torch.arange(1 << 16), codebook)


def codebook_from_marker(mcg: torch.Tensor | int | None, mul1: torch.Tensor | int | None) -> Codebook:
    """Name the codebook from a checkpoint's optional `.mcg` / `.mul1` marker tensors."""
    if mcg is not None and mul1 is not None:
        raise ValueError("EXL3 tensor carries both .mcg and .mul1 markers")
    if mcg is not None:
        _check_marker(mcg, MCG_MULTIPLIER, "mcg")
        return "mcg"
    if mul1 is not None:
        _check_marker(mul1, MUL1_MULTIPLIER, "mul1")
        return "mul1"
    return "3inst"


def _check_marker(marker: torch.Tensor | int, expected: int, name: str) -> None:
    value = int(marker.item()) if isinstance(marker, torch.Tensor) else int(marker)
    if value & _U32 != expected:
        raise ValueError(f"EXL3 .{name} marker is {value & _U32:#x}, expected {expected:#x}")
