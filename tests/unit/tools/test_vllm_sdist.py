# SPDX-License-Identifier: MIT
"""The vLLM 0.33.0 sdist the GB10 tests read: pinned by sha256, unpacked once."""
from __future__ import annotations

from pathlib import Path

import pytest

from tools import vllm_sdist


def test_a_file_with_another_hash_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    wrong = tmp_path / "vllm-0.33.0.tar.gz"
    wrong.write_bytes(b"not the sdist")
    monkeypatch.setenv("GLM53_VLLM_SDIST", str(wrong))
    with pytest.raises(RuntimeError, match="expected f4c33c2503d52bb4"):
        vllm_sdist.tarball()


def test_the_source_tree_holds_the_files_the_fixes_read():
    root = vllm_sdist.source_tree()
    assert all((root / member).is_file() for member in vllm_sdist.MEMBERS)
    assert (root / ".complete").read_text().splitlines() == [vllm_sdist.SHA256, *vllm_sdist.MEMBERS]
    text = vllm_sdist.function_text("vllm/models/glm5next/common/model.py", "get_sparse_topk_buffer_width")
    assert text.startswith("def get_sparse_topk_buffer_width(config: Glm5NextTextConfig) -> int:")
    with pytest.raises(LookupError):
        vllm_sdist.function_text("vllm/config/kernel.py", "no_such_function")
