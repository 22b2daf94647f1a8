# SPDX-License-Identifier: MIT
from pathlib import Path

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.build_context import context_files, context_hash


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker/Dockerfile").write_text("FROM base\n")
    src = tmp_path / "overlay/src/pkg"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("x = 1\n")
    (tmp_path / "overlay/pyproject.toml").write_text("[project]\nversion = '0.1.0'\n")
    return tmp_path


PATHS = ["docker/Dockerfile", "overlay/pyproject.toml", "overlay/src"]


def test_lists_the_context_sorted_without_build_leftovers(tree: Path) -> None:
    (tree / "overlay/src/pkg/__pycache__").mkdir()
    (tree / "overlay/src/pkg/__pycache__/x.cpython-311.pyc").write_bytes(b"\0")
    (tree / "overlay/src/pkg.egg-info").mkdir()
    (tree / "overlay/src/pkg.egg-info/PKG-INFO").write_text("x")
    (tree / "overlay/tests").mkdir()
    (tree / "overlay/tests/test_x.py").write_text("x")
    assert context_files(str(tree), PATHS) == ["docker/Dockerfile", "overlay/pyproject.toml", "overlay/src/pkg/__init__.py"]


def test_leftovers_do_not_change_the_hash_but_any_source_byte_or_name_does(tree: Path) -> None:
    def digest(extra: str = "") -> str:
        return context_hash(str(tree), context_files(str(tree), PATHS), extra)

    first = digest()
    assert first.startswith("sha256:") and len(first) == 71
    (tree / "overlay/src/pkg/__pycache__").mkdir()
    (tree / "overlay/src/pkg/__pycache__/y.pyc").write_bytes(b"\1")
    assert digest() == first
    (tree / "overlay/src/pkg/__init__.py").write_text("x = 2\n")
    changed = digest()
    assert changed != first
    (tree / "overlay/src/pkg/__init__.py").rename(tree / "overlay/src/pkg/other.py")
    assert digest() not in (first, changed)
    assert digest('{"TORCH_CUDA_ARCH_LIST": "9.0"}') != digest()


def test_a_missing_context_path_is_an_error(tree: Path) -> None:
    with pytest.raises(FileNotFoundError, match="overlay/absent"):
        context_files(str(tree), ["overlay/absent"])
