# -*- coding: utf-8 -*-
# SPDX-License-Identifier: MIT
"""The files of the engine image's build context and one hash over them.

The head rebuilds the engine image only when this hash (with the base digest and the overlay version)
differs from the image's labels, so it must change with any byte of the context and never with files a
checkout accumulates beside it (bytecode, egg-info, test caches).
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
from collections.abc import Iterable, Sequence

# Never part of an image build: what Python, pip and pytest leave in a source tree.
EXCLUDED = ("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache")


def _excluded(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def context_files(root: str, paths: Iterable[str], excluded: Sequence[str] = EXCLUDED) -> list[str]:
    """Every file under `paths` (files or directories, relative to root), relative and sorted; names matching
    `excluded` are skipped at any depth. A path that does not exist is an error: the build would miss it."""
    found: list[str] = []
    for rel in paths:
        full = os.path.join(root, rel)
        if os.path.isfile(full):
            found.append(rel)
            continue
        if not os.path.isdir(full):
            raise FileNotFoundError(f"{full}: part of the engine image's build context, missing")
        for current, dirs, files in os.walk(full):
            dirs[:] = [d for d in dirs if not _excluded(d, excluded)]
            for name in files:
                if not _excluded(name, excluded):
                    found.append(os.path.relpath(os.path.join(current, name), root))
    return sorted(set(found))


def context_hash(root: str, files: Sequence[str], extra: str = "") -> str:
    """sha256 over each file's path and content (so renames count), then `extra` (the build arguments)."""
    digest = hashlib.sha256()
    for rel in files:
        with open(os.path.join(root, rel), "rb") as handle:
            content = hashlib.sha256(handle.read()).hexdigest()
        digest.update(f"{rel.replace(os.sep, '/')}\0{content}\n".encode("utf-8"))
    digest.update(extra.encode("utf-8"))
    return "sha256:" + digest.hexdigest()
