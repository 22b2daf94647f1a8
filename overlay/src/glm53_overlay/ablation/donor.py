"""The donor directory for method=transplant: one .safetensors per o_proj plus manifest.json.

manifest.json: {"source": {...}, "tensors": {"model.layers.N.self_attn.o_proj.weight":
{"file": ..., "shape": [out, in], "dtype": "BF16", "sha256": <of the file>}}}. The shapes are the
full (un-sharded) checkpoint shapes; each TP rank slices its own columns at load time.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors_bytes

from glm53_overlay.ablation.settings import AblationSettingError

MANIFEST_NAME = "manifest.json"
DONOR_TENSOR_KEY = "weight"
TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_SETTING = "GLM53_ABLATION_DONOR_DIR"


@dataclass(frozen=True)
class DonorEntry:
    file: str
    shape: tuple[int, ...]
    dtype: str
    sha256: str


def o_proj_tensor_name(layer: int) -> str:
    """The checkpoint name of a layer's o_proj (the MTP block uses index num_hidden_layers + i)."""
    return f"model.layers.{layer}.self_attn.o_proj.weight"


def donor_file_name(tensor_name: str) -> str:
    return f"{tensor_name}.safetensors"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(donor_dir: Path) -> dict[str, DonorEntry]:
    path = donor_dir / MANIFEST_NAME
    if not path.is_file():
        raise AblationSettingError(_SETTING, f"{path} does not exist in this container")
    try:
        tensors: dict[str, Any] = json.loads(path.read_text())["tensors"]
        return {
            name: DonorEntry(file=e["file"], shape=tuple(e["shape"]), dtype=e["dtype"], sha256=e["sha256"])
            for name, e in tensors.items()
        }
    except (ValueError, KeyError, TypeError) as exc:
        raise AblationSettingError(_SETTING, f"{path} is not a donor manifest: {exc!r}") from exc


def write_manifest(donor_dir: Path, entries: dict[str, DonorEntry], source: dict[str, str]) -> None:
    """Atomic, so an interrupted fetch leaves the previous manifest and a resume can trust it."""
    body = {"source": source, "tensors": {name: asdict(e) | {"shape": list(e.shape)} for name, e in entries.items()}}
    tmp = donor_dir / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, donor_dir / MANIFEST_NAME)


def load_donor_shard(
    donor_dir: Path, manifest: dict[str, DonorEntry], layer: int, shard_shape: tuple[int, int],
    tp_rank: int, tp_size: int, dtype: torch.dtype,
) -> torch.Tensor:
    """This rank's [out, in/tp] slice of the donor o_proj, verified against the manifest first."""
    name = o_proj_tensor_name(layer)
    entry = manifest.get(name)
    if entry is None:
        raise AblationSettingError(_SETTING, f"manifest has no {name}; fetch it with tools/fetch_donor.py")
    out_features, shard_in = shard_shape
    if entry.shape != (out_features, shard_in * tp_size):
        raise AblationSettingError(
            _SETTING, f"{name} has shape {list(entry.shape)}, the model needs [{out_features}, {shard_in * tp_size}]"
        )
    if TORCH_DTYPES.get(entry.dtype) != dtype:
        raise AblationSettingError(_SETTING, f"{name} is {entry.dtype}, the model's o_proj is {dtype}")
    data = (donor_dir / entry.file).read_bytes()
    if sha256_bytes(data) != entry.sha256:
        raise AblationSettingError(_SETTING, f"{entry.file} sha256 differs from the manifest; re-fetch it")
    full = load_safetensors_bytes(data)[DONOR_TENSOR_KEY]
    if tuple(full.shape) != entry.shape or full.dtype != dtype:
        raise AblationSettingError(_SETTING, f"{entry.file} content does not match its manifest entry")
    # RowParallelLinear splits the input dimension: rank k holds columns [k*w, (k+1)*w).
    return full[:, tp_rank * shard_in:(tp_rank + 1) * shard_in].contiguous()
