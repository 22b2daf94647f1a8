"""Fill a donor directory with the o_proj tensors of chosen layers, reading only their byte ranges.

Works on any fsspec filesystem (HfFileSystem in production, the local one in tests). Resumable: a
tensor whose file is already there with the manifest's sha256 and the source's shape/dtype is skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from glm53_overlay.ablation.donor import (
    DONOR_TENSOR_KEY, MANIFEST_NAME, DonorEntry, donor_file_name, o_proj_tensor_name, read_manifest,
    sha256_bytes, write_manifest,
)
from glm53_overlay.ablation.safetensors_ranges import (
    ByteReader, TensorLocation, read_safetensors_header, read_tensor_bytes, single_tensor_safetensors,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"


def tensor_files(fs: Any, root: str, names: Iterable[str]) -> dict[str, str]:
    """Which checkpoint file holds each tensor: the index's weight_map, or the single model.safetensors."""
    names = list(names)
    if fs.exists(f"{root}/{INDEX_NAME}"):
        weight_map: dict[str, str] = json.loads(fs.cat_file(f"{root}/{INDEX_NAME}"))["weight_map"]
        missing = [name for name in names if name not in weight_map]
        if missing:
            raise KeyError(f"{root} has no tensors {', '.join(missing)}")
        return {name: weight_map[name] for name in names}
    return {name: SINGLE_FILE_NAME for name in names}


def _range_reader(fs: Any, path: str) -> ByteReader:
    def read(start: int, end: int) -> bytes:
        return bytes(fs.cat_file(path, start=start, end=end))

    return read


def _already_fetched(out_dir: Path, entry: DonorEntry | None, location: TensorLocation) -> bool:
    if entry is None or entry.shape != location.shape or entry.dtype != location.dtype:
        return False
    path = out_dir / entry.file
    return path.is_file() and sha256_bytes(path.read_bytes()) == entry.sha256


def fetch_donor(fs: Any, root: str, layers: Iterable[int], out_dir: Path, source: dict[str, str]) -> list[str]:
    """Fetch each layer's o_proj into out_dir; returns the tensor names actually downloaded."""
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = read_manifest(out_dir) if (out_dir / MANIFEST_NAME).is_file() else {}
    files = tensor_files(fs, root, (o_proj_tensor_name(layer) for layer in layers))
    headers: dict[str, dict[str, TensorLocation]] = {}
    fetched: list[str] = []
    for name, file in files.items():
        read = _range_reader(fs, f"{root}/{file}")
        if file not in headers:
            headers[file] = read_safetensors_header(read)
        location = headers[file][name]
        if _already_fetched(out_dir, entries.get(name), location):
            continue
        content = single_tensor_safetensors(DONOR_TENSOR_KEY, location.dtype, location.shape,
                                            read_tensor_bytes(read, location))
        target = out_dir / donor_file_name(name)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(content)
        os.replace(tmp, target)
        entries[name] = DonorEntry(file=target.name, shape=location.shape, dtype=location.dtype,
                                   sha256=sha256_bytes(content))
        # After every tensor, so an interrupted run resumes from here rather than from the start.
        write_manifest(out_dir, entries, source)
        fetched.append(name)
    return fetched
