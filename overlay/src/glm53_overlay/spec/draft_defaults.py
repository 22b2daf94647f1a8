"""Two draft settings vLLM gets wrong for GLM-5.3 Flash + DFlash2 unless told, filled in when unset.

KV dtype: vLLM gives the draft the target's `--kv-cache-dtype` unless `speculative_config.kv_cache_dtype`
is set. GLM-5.3's target KV must be fp8 (the SM12x sparse-MLA kernels take only packed fp8_ds_mla), but
the DFlash2 draft is a dense sliding-window model whose attention then runs on an fp8 cache it was not
trained for; the recipe keeps it at `auto` (the model dtype, BF16). So a dflash draft with no KV dtype
of its own gets `auto` when the target's is fp8. An explicit `kv_cache_dtype` in the speculative config
always wins.

Causality: DFlash2 drafts a whole block in one pass and its positions attend to each other (non-causal
inside the block). vLLM resolves a draft layer's causality from `is_causal`, then
`dflash_config.causal`, then falls back to "sliding_attention layers are causal" (written for DFlash1
drafts such as z-lab's Gemma-4 ones). A DFlash2 checkpoint whose layers are all sliding-window and that
states neither key would be run causally: no error, later draft positions just stop being accepted. A
DFlash2 draft that states nothing gets `is_causal = false`; one that states either key is left alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

_logger = logging.getLogger(f"vllm.{__name__}")

DFLASH2_ARCHITECTURES = frozenset({"DFlash2DraftModel"})
DRAFT_KV_DTYPE = "auto"
_PATCHED = "_glm53_draft_defaults"


def draft_kv_cache_dtype(method: str | None, draft_kv: str | None, target_kv: str | None) -> str | None:
    """The KV dtype the draft should get: unchanged unless a dflash draft would inherit an fp8 target's."""
    if method == "dflash" and draft_kv is None and str(target_kv or "auto").startswith("fp8"):
        return DRAFT_KV_DTYPE
    return draft_kv


def declared_causality(hf_config: Any) -> bool | None:
    """What the draft config says about causality through the keys vLLM reads first; None if nothing."""
    is_causal = getattr(hf_config, "is_causal", None)
    if is_causal is not None:
        return bool(is_causal)
    dflash_config = getattr(hf_config, "dflash_config", None)
    if isinstance(dflash_config, Mapping) and dflash_config.get("causal") is not None:
        return bool(dflash_config["causal"])
    return None


def make_dflash2_non_causal(hf_config: Any) -> bool:
    """Set `is_causal = False` on a DFlash2 draft config that states no causality; True if it did."""
    architectures = set(getattr(hf_config, "architectures", None) or ())
    if not architectures & DFLASH2_ARCHITECTURES or declared_causality(hf_config) is not None:
        return False
    hf_config.is_causal = False
    return True


def apply_draft_defaults(speculative_config: Any, target_kv_cache_dtype: str | None) -> list[str]:
    """Fill in the draft defaults on a SpeculativeConfig; returns what was changed, for the log."""
    changes: list[str] = []
    if speculative_config is None or speculative_config.method != "dflash":
        return changes
    kv = draft_kv_cache_dtype(speculative_config.method, speculative_config.kv_cache_dtype, target_kv_cache_dtype)
    if kv != speculative_config.kv_cache_dtype:
        speculative_config.kv_cache_dtype = kv
        changes.append(f"draft_kv_cache_dtype={kv} (target {target_kv_cache_dtype})")
    draft_model_config = getattr(speculative_config, "draft_model_config", None)
    if draft_model_config is not None and make_dflash2_non_causal(draft_model_config.hf_config):
        changes.append("draft is_causal=false (DFlash2 config stated no causality)")
    return changes


def patch_engine_args(engine_args_cls: type) -> None:
    """Apply the defaults where vLLM builds the speculative config from the engine arguments.

    `EngineArgs.create_speculative_config` is the one place that sees both the user's speculative
    config and the target's `kv_cache_dtype` (on `self`), before VllmConfig validates and ships the
    config to the workers, so every rank and both model runners see the same settings.
    """
    original = engine_args_cls.create_speculative_config
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def create_speculative_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        speculative_config = original(self, *args, **kwargs)
        changes = apply_draft_defaults(speculative_config, getattr(self, "kv_cache_dtype", None))
        if speculative_config is not None and speculative_config.method == "dflash":
            _logger.info("glm53-spec: dflash draft %s", "; ".join(changes) or "settings unchanged")
        return speculative_config

    setattr(create_speculative_config, _PATCHED, True)
    engine_args_cls.create_speculative_config = create_speculative_config
