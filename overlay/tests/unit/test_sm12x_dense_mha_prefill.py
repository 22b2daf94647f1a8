"""The SM120 sparse-MLA prefill path against vLLM's real FlashInferMLASparseSM120Impl."""

from __future__ import annotations

import importlib

import pytest

from glm53_overlay.sm12x import APPLIED, NOT_NEEDED, run_fix
from glm53_overlay.sm12x import dense_mha_prefill


def test_this_vllm_already_has_no_dense_mha_prefill_on_sm120():
    module = importlib.import_module(dense_mha_prefill.TARGET)
    status = run_fix(dense_mha_prefill, module, (12, 1))
    assert status.state == NOT_NEEDED
    assert "already sets supports_dense_mha_prefill = False" in status.detail


def test_a_release_without_it_gets_it(monkeypatch: pytest.MonkeyPatch):
    module = importlib.import_module(dense_mha_prefill.TARGET)
    impl = module.FlashInferMLASparseSM120Impl
    monkeypatch.setattr(impl, "supports_dense_mha_prefill", True)
    status = run_fix(dense_mha_prefill, module, (12, 1))
    assert status.state == APPLIED and impl.supports_dense_mha_prefill is False
