"""Cut the shipped EXL3 vector subsets out of shared/testdata/exl3 (run again if those vectors change).

    python overlay/scripts/subset_exl3_vectors.py [path/to/exl3_kernel_vectors.safetensors]

Writes overlay/tests/data/exl3_vectors_subset.safetensors (all entries, ~250 KB) and the package's
self-check file (the production codebook mcg only, ~50 KB). Trellis/suh/svh/x/y stay whole because
every output row depends on all of them; big outputs keep only their leading rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

OVERLAY = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = OVERLAY.parent.parent / "shared" / "testdata" / "exl3" / "exl3_kernel_vectors.safetensors"
WHOLE = ("trellis", "suh", "svh", "mcg", "mul1", "y", "y_f32ref")


def cut(source: dict, entries: tuple[str, ...], row_parts: dict[str, int], lut_stride: int) -> dict:
    codebooks = {entry.split("_")[0] for entry in entries}
    out = {"x": source["x"]}
    for codebook in codebooks:
        out[f"{codebook}_lut"] = source[f"{codebook}_lut"][::lut_stride].clone()
    for entry in entries:
        for key, tensor in source.items():
            part = key.removeprefix(entry + "_")
            if part == key:
                continue
            if part in WHOLE:
                out[key] = tensor
            elif part in row_parts:
                out[key] = tensor[: row_parts[part]].clone()
    return out


def main() -> None:
    source_path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_SOURCE
    source = load_file(str(source_path))
    tests = cut(source, ("3inst_K2", "mcg_K4", "mul1_K4"), {"states": 1, "W_hat": 16, "W": 16}, 16)
    save_file(tests, str(OVERLAY / "tests" / "data" / "exl3_vectors_subset.safetensors"), {"lut_stride": "16"})
    package = cut(source, ("mcg_K4",), {"W": 16}, 64)
    save_file(package, str(OVERLAY / "src" / "glm53_overlay" / "data" / "exl3_selfcheck_vectors.safetensors"),
              {"lut_stride": "64"})


if __name__ == "__main__":
    main()
