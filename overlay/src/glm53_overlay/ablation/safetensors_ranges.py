"""Read single tensors out of a remote .safetensors file by byte range, and write one-tensor files.

A GLM-5.3 checkpoint shard is several GB and the donor needs a few MB of it per layer, so the fetcher
reads the header (8-byte length + JSON) and then only each tensor's own byte range.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass

# (start, end) -> the file's bytes [start, end); an fsspec filesystem's cat_file fits this directly.
ByteReader = Callable[[int, int], bytes]

# safetensors has no header-size limit of its own; anything this big is a corrupt or non-safetensors file.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_ALIGNMENT = 8


@dataclass(frozen=True)
class TensorLocation:
    name: str
    dtype: str  # safetensors code: BF16, F16, F32, ...
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


def read_safetensors_header(read: ByteReader) -> dict[str, TensorLocation]:
    (header_len,) = struct.unpack("<Q", _exact(read, 0, 8))
    if header_len > _MAX_HEADER_BYTES:
        raise ValueError(f"safetensors header claims {header_len} bytes; not a safetensors file")
    header = json.loads(_exact(read, 8, 8 + header_len))
    data_start = 8 + header_len
    return {
        name: TensorLocation(
            name=name,
            dtype=info["dtype"],
            shape=tuple(info["shape"]),
            start=data_start + info["data_offsets"][0],
            end=data_start + info["data_offsets"][1],
        )
        for name, info in header.items()
        if name != "__metadata__"
    }


def read_tensor_bytes(read: ByteReader, location: TensorLocation) -> bytes:
    return _exact(read, location.start, location.end)


def single_tensor_safetensors(key: str, dtype: str, shape: tuple[int, ...], data: bytes) -> bytes:
    """A complete .safetensors file holding `data` as tensor `key`, byte-for-byte as in the source."""
    header = json.dumps({key: {"dtype": dtype, "shape": list(shape), "data_offsets": [0, len(data)]}}).encode()
    # Pad with spaces (allowed by the format) so the data starts aligned, as readers that mmap expect.
    header += b" " * (-len(header) % _ALIGNMENT)
    return struct.pack("<Q", len(header)) + header + data


def _exact(read: ByteReader, start: int, end: int) -> bytes:
    data = read(start, end)
    if len(data) != end - start:
        raise ValueError(f"short read: bytes [{start}, {end}) gave {len(data)} bytes")
    return data
