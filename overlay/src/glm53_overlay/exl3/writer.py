"""Write an EXL3 checkpoint and its exact BF16 twin from a BF16 checkpoint (tests and the simulation).

    python -m glm53_overlay.exl3.writer SOURCE EXL3_DIR TWIN_DIR [--bits 4] [--codebook mcg]
        [--modules REGEX] [--seed 0]

Every linear whose module name matches `--modules` is replaced by a random trellis (any bit pattern
is a valid EXL3 encoding) with Hadamard sign scales `suh` and output scales `svh` chosen so the decoded
weight has the RMS of the weight it replaces; the model keeps its shape and rough behaviour but its
quantized weights are exactly what the reference decoder says. EXL3_DIR gets the packed tensors,
`quantization_config` in config.json and exllamav3's `quantization_config.json` (with its per-module
`tensor_storage` ledger); TWIN_DIR gets the same checkpoint with those weights decoded to BF16, so a
server running the EXL3 checkpoint must produce exactly what the twin produces.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm53_overlay.exl3.codebook import CODEBOOKS, MCG_MULTIPLIER, MUL1_MULTIPLIER, Codebook
from glm53_overlay.exl3.hadamard import HADAMARD_BLOCK
from glm53_overlay.exl3.reference import dequantize
from glm53_overlay.exl3.trellis import SUPPORTED_BITS, SUPPORTED_HALF_BITS, TILE

WEIGHTS_FILE = "model.safetensors"
# Routed experts, dense MLPs and shared experts: the linears exllamav3 quantizes in GLM MoE models
# that vLLM serves through the fused-MoE and linear methods of this package.
DEFAULT_MODULES = r"\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj$"
_MARKERS = {"mcg": MCG_MULTIPLIER, "mul1": MUL1_MULTIPLIER}


@dataclass(frozen=True)
class WrittenCheckpoint:
    exl3_dir: Path
    twin_dir: Path
    quantized_modules: tuple[str, ...]


def _padded(features: int) -> int:
    return -(-features // HADAMARD_BLOCK) * HADAMARD_BLOCK


def _signs(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)


def random_linear(
    out_features: int, in_features: int, *, bits: float, codebook: Codebook, rms: float, generator: torch.Generator
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Packed EXL3 tensors (suffix -> tensor) for an [out, in] linear, and its exact decoded weight [out, in].

    Storage is exllamav3's: [in, out] padded to multiples of 128; the padding's scales are 0 so the
    padded rows and columns decode to exact zeros.
    """
    k, n = _padded(in_features), _padded(out_features)
    words = int(TILE * bits)
    trellis = torch.randint(-(1 << 15), 1 << 15, (k // TILE, n // TILE, words), generator=generator)
    trellis = trellis.to(torch.int16)
    suh = torch.zeros(k)
    suh[:in_features] = _signs(in_features, generator)
    svh = torch.zeros(n)
    svh[:out_features] = _signs(out_features, generator)
    # The codebooks are only roughly unit-variance (0.7-1.4 by K and codebook): measure, then rescale.
    unit = dequantize(trellis, suh.half(), svh.half(), codebook=codebook)[:in_features, :out_features]
    svh *= rms / float(unit.float().pow(2).mean().sqrt())
    packed = {"trellis": trellis, "suh": suh.half(), "svh": svh.half()}
    if codebook in _MARKERS:
        packed[codebook] = torch.tensor(_MARKERS[codebook] - (1 << 32), dtype=torch.int32)
    weight = dequantize(trellis, packed["suh"], packed["svh"], codebook=codebook)
    return packed, weight.t()[:out_features, :in_features].contiguous()


def _storage_entry(name: str, tensor: torch.Tensor) -> dict[str, object]:
    return {name: {"shape": list(tensor.shape), "n_bytes": tensor.numel() * tensor.element_size(),
                   "dtype": str(tensor.dtype)}}


def quantize_checkpoint(
    source: Path,
    exl3_dir: Path,
    twin_dir: Path,
    *,
    bits: float = 4,
    codebook: Codebook = "mcg",
    modules: str = DEFAULT_MODULES,
    seed: int = 0,
) -> WrittenCheckpoint:
    if bits not in SUPPORTED_BITS and bits not in SUPPORTED_HALF_BITS:
        raise ValueError(f"bits must be an integer 1..8 or a half-integer 1.5..7.5, got {bits}")
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {CODEBOOKS}, got {codebook!r}")
    if not float(bits).is_integer() and codebook != "mul1":
        raise ValueError(f"half-integer bits ({bits}) need codebook mul1 (exllamav3 only instantiates that)")
    pattern = re.compile(modules)
    generator = torch.Generator().manual_seed(seed)
    with safe_open(str(source / WEIGHTS_FILE), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    exl3: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    storage: dict[str, dict[str, object]] = {}
    quantized: list[str] = []
    for name, tensor in sorted(tensors.items()):
        module, leaf = name.rpartition(".")[::2]
        if leaf == "weight" and tensor.dim() == 2 and pattern.search(module):
            rms = float(tensor.float().pow(2).mean().sqrt())
            packed, weight = random_linear(*tensor.shape, bits=bits, codebook=codebook, rms=rms, generator=generator)
            exl3 |= {f"{module}.{suffix}": value for suffix, value in packed.items()}
            twin[name] = weight.to(tensor.dtype)
            stored: dict[str, object] = {}
            for suffix, value in packed.items():
                stored |= _storage_entry(f"{module}.{suffix}", value)
            storage[module] = {"stored_tensors": stored, "quant_format": "exl3",
                               "bits_per_weight": int(bits) if float(bits).is_integer() else bits}
            if codebook in _MARKERS:
                storage[module][f"{codebook}_multiplier"] = _MARKERS[codebook]
            quantized.append(module)
        else:
            exl3[name] = twin[name] = tensor
            storage.setdefault(module, {"stored_tensors": {}})["stored_tensors"] |= _storage_entry(name, tensor)  # type: ignore[operator]
    if not quantized:
        raise ValueError(f"no linear weight in {source} matches --modules {modules!r}")
    settings = {"quant_method": "exl3", "version": "glm53-overlay-writer", "bits": float(bits), "codebook": codebook}
    config = json.loads((source / "config.json").read_text())
    for target, weights, extra in ((exl3_dir, exl3, {"quantization_config": settings}), (twin_dir, twin, {})):
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(WEIGHTS_FILE, "config.json"))
        (target / "config.json").write_text(json.dumps(config | extra, indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in weights.items()}, str(target / WEIGHTS_FILE), metadata={"format": "pt"})
    (exl3_dir / "quantization_config.json").write_text(
        json.dumps(settings | {"tensor_storage": storage}, indent=2) + "\n"
    )
    return WrittenCheckpoint(exl3_dir, twin_dir, tuple(quantized))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="BF16 checkpoint directory (config.json + model.safetensors)")
    parser.add_argument("exl3_dir", type=Path)
    parser.add_argument("twin_dir", type=Path)
    parser.add_argument("--bits", type=float, default=4)
    parser.add_argument("--codebook", choices=CODEBOOKS, default="mcg")
    parser.add_argument("--modules", default=DEFAULT_MODULES, help="regex on module names to quantize")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    bits = int(args.bits) if args.bits.is_integer() else args.bits
    written = quantize_checkpoint(args.source, args.exl3_dir, args.twin_dir, bits=bits, codebook=args.codebook,
                                  modules=args.modules, seed=args.seed)
    print(f"wrote {written.exl3_dir} ({len(written.quantized_modules)} EXL3 linears, K={bits} {args.codebook}) "
          f"and its BF16 twin {written.twin_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
