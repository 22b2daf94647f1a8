"""Cut the shipped EXL3 vector subsets out of exllamav3-made vectors (run again if those vectors change).

    python overlay/scripts/subset_exl3_vectors.py [path/to/exl3_kernel_vectors.safetensors]
        [--extra path/to/exl3_extra_vectors.safetensors]

Writes overlay/tests/data/exl3_vectors_subset.safetensors (all entries, ~250 KB) and the package's
self-check file (the production codebook mcg only, ~50 KB) from shared/testdata/exl3; with --extra, also
overlay/tests/data/exl3_extra_vectors_subset.safetensors from the vectors overlay/gpu/make_vectors.py made
(half-integer K and the other K/codebook pairs). Trellis/suh/svh/x/y stay whole because every output row
depends on all of them; big outputs keep only their leading rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import load_file, save_file

OVERLAY = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = OVERLAY.parent.parent / "shared" / "testdata" / "exl3" / "exl3_kernel_vectors.safetensors"
WHOLE = ("trellis", "suh", "svh", "mcg", "mul1", "y", "y_f32ref")


def cut(source: dict, entries: tuple[str, ...], row_parts: dict[str, int], lut_stride: int) -> dict:
    codebooks = {entry.split("_")[0] for entry in entries}
    out = {"x": source["x"]}
    for codebook in codebooks:
        if f"{codebook}_lut" in source:
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, nargs="?", default=DEFAULT_SOURCE)
    parser.add_argument("--extra", type=Path)
    args = parser.parse_args()
    if args.extra:
        extra = load_file(str(args.extra))
        entries = tuple(sorted(key.removesuffix("_trellis") for key in extra if key.endswith("_trellis")))
        save_file(cut(extra, entries, {"states": 1, "W_hat": 16, "W": 16}, 1),
                  str(OVERLAY / "tests" / "data" / "exl3_extra_vectors_subset.safetensors"), {"lut_stride": "1"})
    source = load_file(str(args.source))
    tests = cut(source, ("3inst_K2", "mcg_K4", "mul1_K4"), {"states": 1, "W_hat": 16, "W": 16}, 16)
    save_file(tests, str(OVERLAY / "tests" / "data" / "exl3_vectors_subset.safetensors"), {"lut_stride": "16"})
    package = cut(source, ("mcg_K4",), {"W": 16}, 64)
    save_file(package, str(OVERLAY / "src" / "glm53_overlay" / "data" / "exl3_selfcheck_vectors.safetensors"),
              {"lut_stride": "64"})


if __name__ == "__main__":
    main()
