"""EXL3 trellis layout: packed int16 bitstreams -> 16-bit states -> 16x16 weight tiles.

Each 16x16 tile is a ring of 256*K bits, stored as 16*K int16 words whose pairs are swapped inside
each 32-bit word, so reading the words as little-endian uint32 gives an MSB-first bitstream. The
state of position t is the 16 bits ending where position t's fresh bits end, wrapping around the ring.
Integer K: every position adds K bits. Half-integer K = KA + 0.5 (exllamav3's `frac` layout, mul1
codebook only): positions alternate KA and KA + 1 fresh bits (odd positions get the extra bit, mask
0xAAAA), so 16 positions take 16*KA + 8 bits and a tile is 16*KA + 8 int16 words.
"""

from __future__ import annotations

from functools import lru_cache

import torch

TILE = 16
TILE_POSITIONS = TILE * TILE
STATE_BITS = 16
SUPPORTED_BITS = range(1, 9)
# Half-integer rates exllamav3 instantiates: KA + 0.5 for KA in 1..7 (1.5 .. 7.5).
SUPPORTED_HALF_BITS = tuple(ka + 0.5 for ka in range(1, 8))
_HALF_BIT_MASK = 0xAAAA


def bits_per_weight(trellis: torch.Tensor) -> float:
    """K from a trellis shaped [k/16, n/16, 16*K]: an integer 1..8 or a half-integer 1.5..7.5."""
    if trellis.dim() != 3:
        raise ValueError(f"EXL3 trellis must be 3-D [k/16, n/16, 16*K], got shape {tuple(trellis.shape)}")
    words = trellis.shape[-1]
    k_bits = words / TILE
    if k_bits not in SUPPORTED_BITS and k_bits not in SUPPORTED_HALF_BITS:
        raise ValueError(
            f"EXL3 trellis last dim {words} is not 16*K for K in 1..8 or a half-integer K in 1.5..7.5"
        )
    return int(k_bits) if k_bits.is_integer() else k_bits


def position_ends(k_bits: float) -> torch.Tensor:
    """Ring bit where each of a tile's 256 positions ends (exllamav3's S(i)), int64 [256]."""
    ka = int(k_bits)
    fresh = torch.full((TILE,), ka, dtype=torch.int64)
    if not float(k_bits).is_integer():
        fresh += torch.tensor([(_HALF_BIT_MASK >> i) & 1 for i in range(TILE)])
    per_group = int(fresh.sum())
    group = torch.arange(TILE_POSITIONS) // TILE
    return group * per_group + fresh.cumsum(0).repeat(TILE_POSITIONS // TILE)


@lru_cache(maxsize=len(SUPPORTED_BITS) + len(SUPPORTED_HALF_BITS))
def _state_gather_plan(k_bits: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each position: the 32-bit word holding its first bit, its last bit, and the right shift."""
    ring_bits = int(TILE_POSITIONS * k_bits)
    ring_words = ring_bits // 32
    # Offset by one full ring so the first positions, which wrap to the end, stay non-negative.
    end = position_ends(k_bits) + ring_bits
    start = end - STATE_BITS
    first_word = start // 32
    last_word = (end - 1) // 32
    shift = (last_word + 1) * 32 - end
    return first_word % ring_words, last_word % ring_words, shift


def unpack_states(trellis: torch.Tensor) -> torch.Tensor:
    """Trellis int16 [k/16, n/16, 16*K] -> states int16 [k/16, n/16, 256] in tensor-core position order."""
    k_bits = bits_per_weight(trellis)
    u16 = trellis.to(torch.int64) & 0xFFFF
    words = u16[..., 0::2] | (u16[..., 1::2] << 16)
    first_word, last_word, shift = (t.to(trellis.device) for t in _state_gather_plan(k_bits))
    # int64 wrap-around in the high word only touches bits far above the 16 we keep.
    window = (words[..., first_word] << 32) | words[..., last_word]
    states = (window >> shift) & 0xFFFF
    return torch.where(states >= 0x8000, states - 0x10000, states).to(torch.int16)


@lru_cache(maxsize=1)
def tile_position_index() -> torch.Tensor:
    """[16, 16] long: the trellis position that lands at (row, col) of a decoded tile.

    The kernels decode 8 consecutive positions per lane into mma fragments; this is where each lands
    once the fragments are written out row-major (row = input feature, col = output feature).
    """
    row = torch.arange(TILE).view(TILE, 1)
    col = torch.arange(TILE).view(1, TILE)
    lane = (row % 8) // 2 + 8 * ((col % 8) // 2) + 4 * (col % 2)
    slot = row % 2 + 2 * (row // 8) + 4 * (col // 8)
    return 8 * lane + slot


def states_to_tiles(states: torch.Tensor) -> torch.Tensor:
    """Per-position values [k/16, n/16, 256] -> matrix [k, n] (works for states or decoded weights)."""
    tiles_k, tiles_n = states.shape[:2]
    tiles = states[..., tile_position_index().flatten().to(states.device)].view(tiles_k, tiles_n, TILE, TILE)
    return tiles.permute(0, 2, 1, 3).reshape(tiles_k * TILE, tiles_n * TILE)
