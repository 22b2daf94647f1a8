"""Produce EXL3 test vectors with exllamav3's own CUDA kernels (the format of /shared/testdata/exl3).

    PYTHONPATH=overlay/src python3 overlay/gpu/make_vectors.py --out DIR [--entries mul1_K2.5 mcg_K3 ...]

For each entry `{codebook}_K{K}` a random 256 x 256 linear (any trellis bit pattern is a valid encoding):
`_trellis`, `_suh`, `_svh`, the codebook marker, `_states` (ext.unpack_trellis / unpack_trellis_frac),
`_W_hat` (ext.reconstruct), `_W` (LinearEXL3.get_weight_tensor), `_y` (LinearEXL3.forward, exl3_gemm) and
`_y_f32ref` (fp32 x @ W). The default entries are the ones the shared vectors lack: the half-integer
rates (mul1 only) and integer K the shared file does not cover.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from glm53_overlay.exl3.codebook import MCG_MULTIPLIER, MUL1_MULTIPLIER

FEATURES = 256
DEFAULT_ENTRIES = ("mul1_K1.5", "mul1_K2.5", "mul1_K3.5", "mcg_K3", "mcg_K5", "mul1_K6", "3inst_K8")
HALF_BIT_MASK = 0xAAAA
SEED = 20261130


def _entry(name: str, x: torch.Tensor, seed: int, ext, linear_cls) -> dict[str, torch.Tensor]:
    codebook, k_text = name.split("_K")
    bits = float(k_text)
    k_int = int(bits) if bits.is_integer() else bits
    gen = torch.Generator().manual_seed(seed)
    tiles = FEATURES // 16
    trellis = torch.randint(-32768, 32768, (tiles, tiles, int(16 * bits)), generator=gen, dtype=torch.int32)
    trellis = trellis.to(torch.int16)

    def scales() -> torch.Tensor:
        magnitude = torch.rand(FEATURES, generator=gen) + 0.5
        sign = torch.where(torch.rand(FEATURES, generator=gen) < 0.5, -1.0, 1.0)
        return (magnitude * sign).half()

    suh, svh = scales(), scales()
    markers = {"mcg": MCG_MULTIPLIER, "mul1": MUL1_MULTIPLIER}
    marker = torch.tensor(markers[codebook] - (1 << 32), dtype=torch.int32) if codebook in markers else None
    cuda = {"trellis": trellis.cuda(), "suh": suh.cuda(), "svh": svh.cuda()}
    linear = linear_cls(None, FEATURES, FEATURES, suh=cuda["suh"], svh=cuda["svh"], trellis=cuda["trellis"],
                        mcg=marker.cuda() if codebook == "mcg" else None,
                        mul1=marker.cuda() if codebook == "mul1" else None)
    states = torch.empty((tiles, tiles, 256), dtype=torch.int16, device="cuda")
    if bits.is_integer():
        ext.unpack_trellis(states, cuda["trellis"], int(bits))
    else:
        ext.unpack_trellis_frac(states, cuda["trellis"], int(bits), HALF_BIT_MASK)
    w_hat = torch.empty((FEATURES, FEATURES), dtype=torch.half, device="cuda")
    ext.reconstruct(w_hat, cuda["trellis"], k_int, codebook == "mcg", codebook == "mul1")
    w = linear.get_weight_tensor()
    y = linear.forward(x.cuda(), {})
    tensors = {"trellis": trellis, "suh": suh, "svh": svh, "states": states.cpu(), "W_hat": w_hat.cpu(),
               "W": w.cpu().half(), "y": y.cpu().half(), "y_f32ref": (x.cuda().float() @ w.float()).cpu()}
    if marker is not None:
        tensors[codebook] = marker
    return {f"{name}_{key}": value.contiguous() for key, value in tensors.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--entries", nargs="+", default=list(DEFAULT_ENTRIES))
    args = parser.parse_args()
    from exllamav3.ext import exllamav3_ext as ext
    from exllamav3.modules.quant.exl3 import LinearEXL3

    x = torch.randn(4, FEATURES, generator=torch.Generator().manual_seed(777)).half()
    tensors: dict[str, torch.Tensor] = {"x": x}
    from exllamav3.version import __version__ as exllamav3_version

    manifest: dict[str, object] = {"exllamav3_version": exllamav3_version, "torch": torch.__version__,
                                   "device": torch.cuda.get_device_name(),
                                   "generator": "overlay/gpu/make_vectors.py", "entries": {}}
    for index, name in enumerate(args.entries):
        tensors |= _entry(name, x, SEED + index, ext, LinearEXL3)
        y, ref = tensors[f"{name}_y"].float(), tensors[f"{name}_y_f32ref"]
        rel = float((y - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
        manifest["entries"][name] = {"seed": SEED + index, "y_vs_f32ref_rel_rms": rel}  # type: ignore[index]
        print(f"{name}: y vs fp32 x@W relative RMS {rel:.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / "exl3_extra_vectors.safetensors"), metadata={"lut_stride": "1"})
    (args.out / "exl3_extra_vectors.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
