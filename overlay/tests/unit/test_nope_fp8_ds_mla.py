"""The fp8_ds_mla record stand-in (fp8_ds_mla_layout.py, which test_nope_sm120.py uses in place of vLLM's
CUDA-only cache write and FlashInfer's decode) against a packing written here from the layout alone: 512
e4m3 bytes (nearest value, ties to even, found in a table built from the bit format), 4 little-endian fp32
scales (amax/448 per 128 values), 64 bf16 rope values (round to nearest even from the fp32 bits)."""

from __future__ import annotations

import struct

import pytest
import torch

from fp8_ds_mla_layout import RECORD_BYTES, pack_fp8_ds_mla, unpack_fp8_ds_mla, write_records


def _e4m3_table() -> torch.Tensor:
    """Value of every byte 0..255 as e4m3fn (bias 7, no infinities, S.1111.111 is NaN)."""
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            values.append(float("nan"))
        elif exponent == 0:
            values.append(sign * mantissa / 8 * 2.0**-6)
        else:
            values.append(sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return torch.tensor(values, dtype=torch.float64)


def _encode_e4m3(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    finite = ~table.isnan()
    codes = torch.arange(256)[finite]
    distance = (x.double().unsqueeze(-1) - table[finite]).abs()
    best = distance.min(dim=-1, keepdim=True).values
    # Among equally near codes prefer an even mantissa (round half to even); argmax then takes +0 over -0.
    ties = distance == best
    even = ties & ((codes & 1) == 0)
    pick = torch.where(even.any(dim=-1, keepdim=True), even, ties)
    return codes[pick.int().argmax(dim=-1)].to(torch.uint8)


def _bf16_bytes(x: torch.Tensor) -> bytes:
    out = bytearray()
    for value in x.tolist():
        bits = struct.unpack("<I", struct.pack("<f", value))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out += struct.pack("<H", bits)
    return bytes(out)


def _independent_record(kv_c: torch.Tensor, k_pe: torch.Tensor, table: torch.Tensor) -> bytes:
    latent, scales = bytearray(), bytearray()
    for tile in kv_c.view(4, 128):
        scale = float(tile.abs().max()) / 448.0
        scale = struct.unpack("<f", struct.pack("<f", scale))[0]  # the fp32 the record carries
        latent += bytes(_encode_e4m3(tile.double() / scale, table).tolist())
        scales += struct.pack("<f", scale)
    return bytes(latent) + bytes(scales) + _bf16_bytes(k_pe)


@pytest.fixture(scope="module")
def table() -> torch.Tensor:
    return _e4m3_table()


def test_record_is_656_bytes_and_matches_independent_packing(table: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(3)
    kv_c = torch.randn(5, 512, generator=gen) * torch.tensor([0.01, 1.0, 30.0, 0.5]).repeat_interleave(128)
    k_pe = torch.randn(5, 64, generator=gen)
    packed = pack_fp8_ds_mla(kv_c, k_pe)
    assert RECORD_BYTES == 656 and packed.shape == (5, 656) and packed.dtype == torch.uint8
    for token in range(5):
        assert bytes(packed[token].tolist()) == _independent_record(kv_c[token], k_pe[token], table), token


def test_nope_record_has_zero_rope_bytes_and_dequantizes(table: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(4)
    kv_c = torch.randn(3, 512, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    packed = pack_fp8_ds_mla(kv_c, torch.zeros(3, 64, dtype=torch.bfloat16))
    assert not packed[:, 528:].any()
    scales = packed[:, 512:528].contiguous().view(torch.float32)
    torch.testing.assert_close(scales, kv_c.float().view(3, 4, 128).abs().amax(-1) / 448.0)
    values = table[packed[:, :512].long()].float().view(3, 4, 128) * scales.unsqueeze(-1)
    # e4m3 keeps 3 mantissa bits: relative error up to 2^-4 of each tile's largest value.
    assert ((values.view(3, 512) - kv_c.float()).abs().view(3, 4, 128) <= scales.unsqueeze(-1) * 448 / 16).all()


def test_write_records_skips_padding_slots() -> None:
    cache = torch.full((8, 656), 0xAB, dtype=torch.uint8)
    kv_c, k_pe = torch.randn(3, 512), torch.randn(3, 64)
    write_records(cache, torch.tensor([6, -1, 2]), kv_c, k_pe)
    expected = pack_fp8_ds_mla(kv_c[[0, 2]], k_pe[[0, 2]])
    assert torch.equal(cache[6], expected[0]) and torch.equal(cache[2], expected[1])
    assert (cache[[0, 1, 3, 4, 5, 7]] == 0xAB).all()


def test_unpack_reads_back_what_the_independent_packing_wrote(table: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(5)
    kv_c, k_pe = torch.randn(2, 512, generator=gen) * 7, torch.randn(2, 64, generator=gen)
    records = torch.tensor([list(_independent_record(kv_c[t], k_pe[t], table)) for t in range(2)], dtype=torch.uint8)
    latent, rope = unpack_fp8_ds_mla(records)
    scales = kv_c.view(2, 4, 128).abs().amax(-1) / 448.0
    expected = table[records[:, :512].long()].float().view(2, 4, 128) * scales.unsqueeze(-1)
    torch.testing.assert_close(latent, expected.view(2, 512), rtol=0, atol=0)
    torch.testing.assert_close(rope, k_pe.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_pack_refuses_wrong_geometry() -> None:
    with pytest.raises(ValueError):
        pack_fp8_ds_mla(torch.zeros(2, 512), torch.zeros(2, 0))
