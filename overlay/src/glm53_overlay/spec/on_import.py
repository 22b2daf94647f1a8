"""Run a patch when a module is first imported, so register() does not import heavy vLLM modules itself.

vLLM calls register() in every process (API server, engine core, workers); a patch target such as
`vllm.v1.spec_decode.dflash` costs seconds to import and is only ever imported by the worker that
drafts. A finder placed first on sys.meta_path lets the normal finders locate the module, then runs
the patch right after the module body has executed, before anyone else sees the module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

Patch = Callable[[ModuleType], None]


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Patch) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_code, is_package... stay the real loader's (inspect and pickle use them).
        return getattr(self._loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, patch: Patch) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self.patch)
                return spec
        return None


def when_imported(name: str, patch: Patch) -> None:
    """Call patch(module) now if `name` is already imported, else right after its first import."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
        return
    if not any(isinstance(f, _PatchOnImport) and f.name == name and f.patch is patch for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(name, patch))
