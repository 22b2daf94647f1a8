"""Refuse to patch code the fix was not written against.

A fix that wraps or replaces a vLLM function is only right for the text it was read on. Each such fix names
the function's signature and the sha256 of its source text per vLLM release it was read on; at apply time the
running function must match one of them, otherwise the fix raises and `run_fix` reports it `failed` (never
silently skipped). The text is hashed after `textwrap.dedent`, so a method and a module-level copy of the same
lines hash alike (the tests put 0.33.0's text into stand-in modules).
"""

from __future__ import annotations

import hashlib
import inspect
import textwrap
from collections.abc import Callable, Mapping
from typing import Any


def source_sha256(function: Callable[..., Any]) -> str:
    """sha256 of the dedented source text of a function (a Triton JITFunction: of the Python function it wraps)."""
    return hashlib.sha256(textwrap.dedent(inspect.getsource(_plain(function))).encode()).hexdigest()


def _plain(function: Any) -> Any:
    function = getattr(function, "fn", function)
    return getattr(function, "__func__", function)


def _annotation(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def signature_text(function: Callable[..., Any], annotations: bool = True) -> str:
    """Parameter names, defaults and annotation names: `(config: Glm5NextTextConfig) -> int`.

    Without annotations for Triton kernels: `tl.constexpr` is a class on CUDA and a stub off it."""
    signature = inspect.signature(_plain(function))
    parts = []
    for parameter in signature.parameters.values():
        text = parameter.name
        if annotations and parameter.annotation is not inspect.Parameter.empty:
            text += f": {_annotation(parameter.annotation)}"
        if parameter.default is not inspect.Parameter.empty:
            text += f" = {parameter.default!r}"
        parts.append(("*" if parameter.kind is parameter.VAR_POSITIONAL else "") + text)
    returns = _annotation(signature.return_annotation) if annotations else ""
    return f"({', '.join(parts)})" + (f" -> {returns}" if returns else "")


def require_source(function: Callable[..., Any], signature: str, digests: Mapping[str, str],
                   annotations: bool = True) -> str:
    """The release whose text `function` is (by digest); LookupError when signature or text differ."""
    plain = _plain(function)
    name = getattr(plain, "__qualname__", repr(plain))
    found = signature_text(plain, annotations)
    if found != signature:
        raise LookupError(f"{name} has signature {found}, the fix was written for {signature}")
    digest = source_sha256(plain)
    for release, known in digests.items():
        if digest == known:
            return release
    raise LookupError(f"{name}'s source text changed (sha256 {digest[:16]}…; the fix was written against "
                      f"{', '.join(f'{r} {d[:16]}…' for r, d in digests.items())})")
