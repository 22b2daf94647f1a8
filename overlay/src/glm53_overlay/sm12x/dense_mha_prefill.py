"""No dense-MHA prefill on the SM120 sparse-MLA backend.

FlashInfer's SM120 sparse-MLA impl has no forward_mha, so prefill must take the top-k MQA path; the recipe
sets `supports_dense_mha_prefill = False` on it. vLLM 0.32 already does; this fix checks that and would
set it on a release that does not.
"""

from __future__ import annotations

from types import ModuleType

NAME = "sm120-no-dense-mha-prefill"
SOURCE = "recipe (vLLM 487ecf187 base): supports_dense_mha_prefill=False on SM120 (forward_mha not implemented)"
TARGET = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120"
SUPPORTED_VLLM = frozenset({(0, 32), (0, 33)})


def already_fixed(module: ModuleType, capability: tuple[int, int]) -> str | None:
    impl = module.FlashInferMLASparseSM120Impl
    if impl.supports_dense_mha_prefill is False and "supports_dense_mha_prefill" in vars(impl):
        return "vLLM's FlashInferMLASparseSM120Impl already sets supports_dense_mha_prefill = False"
    return None


def patch(module: ModuleType, capability: tuple[int, int]) -> str:
    module.FlashInferMLASparseSM120Impl.supports_dense_mha_prefill = False
    return "FlashInferMLASparseSM120Impl.supports_dense_mha_prefill = False"
