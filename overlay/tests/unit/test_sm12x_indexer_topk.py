"""The top-k choice against vLLM's real SparseIndexerTopk (the GLM-5.3 Flash kpool indexer's dispatcher)."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch

from glm53_overlay.sm12x import APPLIED, run_fix
from glm53_overlay.sm12x import indexer_topk


@pytest.fixture
def topk_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = importlib.import_module(indexer_topk.TARGET)
    monkeypatch.setattr(module.SparseIndexerTopk, "_resolve_auto", module.SparseIndexerTopk._resolve_auto)
    return module


def resolve(module: ModuleType, *, backend: str = "auto", cooperative: bool = False, rows: int = 4,
            topk_tokens: int = 2048) -> str:
    probe = indexer_topk._sm12x_probe(module)
    probe._backend, probe._cooperative_capable = backend, cooperative
    return probe.resolve_backend(torch.empty(rows, 8192), topk_tokens, rows)


def test_this_vllm_picks_persistent_topk_on_sm12x_so_the_fix_is_needed(topk_module):
    assert resolve(topk_module) == "persistent"
    assert indexer_topk.already_fixed(topk_module, (12, 1)) is None


def test_after_the_fix_sm12x_decodes_with_per_row(topk_module):
    status = run_fix(indexer_topk, topk_module, (12, 1))
    assert (status.state, status.detail) == (APPLIED, "automatic top-k: persistent -> per_row (now per_row)")
    assert resolve(topk_module) == "per_row"
    assert resolve(topk_module, rows=128) == "per_row"
    assert "already" in indexer_topk.patch(topk_module, (12, 1))


def test_other_choices_are_unchanged(topk_module):
    indexer_topk.patch(topk_module, (12, 1))
    # A cooperative-capable device (sm_90/sm_100) within the row limit, and an explicit backend, as before.
    assert resolve(topk_module, cooperative=True) == "cooperative"
    assert resolve(topk_module, backend="persistent") == "persistent"
    assert resolve(topk_module, topk_tokens=4096) == "per_row"
