"""Where the ablation enters vLLM: right after DefaultModelLoader.load_weights, on every rank.

That point is after the checkpoint is in the parameters and before `process_weights_after_loading`
(which on CPU repacks o_proj into a oneDNN layout and drops `.weight`) and before any CUDA-graph
capture. `load_weights(self, model, model_config)` is BaseModelLoader's abstract API, stable across
vLLM 0.32 and 0.33, and the draft model goes through the same call with its own ModelConfig object,
which is how the target is told apart from a drafter.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from glm53_overlay.ablation.edit import ablate_model
from glm53_overlay.ablation.settings import AblationSettingError, AblationSettings

_logger = logging.getLogger(f"vllm.{__name__}")
_INSTALLED_MARK = "_glm53_ablation_hook"


def _model_role(model_config: Any, settings: AblationSettings) -> str | None:
    """"target", "mtp" (only when included) or None for a model the ablation must leave alone."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:
        # The worker sets the config around load_model; without it target and drafter look alike.
        raise AblationSettingError(
            "GLM53_ABLATION_ENABLED", "vLLM loaded weights outside a config context; cannot tell target from draft"
        )
    spec = vllm_config.speculative_config
    if spec is not None and model_config is spec.draft_model_config:
        # MTP blocks are part of the target checkpoint; an independent drafter (DFlash, EAGLE) never is.
        return "mtp" if settings.include_mtp and spec.method == "mtp" else None
    return "target" if model_config is vllm_config.model_config else None


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def install_ablation_hook(settings: AblationSettings) -> None:
    """Wrap DefaultModelLoader.load_weights once per process (register() may run more than once)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.load_weights
    if getattr(original, _INSTALLED_MARK, False):
        return

    @functools.wraps(original)
    def load_weights_then_ablate(self: DefaultModelLoader, model: torch.nn.Module, model_config: Any) -> Any:
        loaded = original(self, model, model_config)
        role = _model_role(model_config, settings)
        if role is not None:
            result = ablate_model(
                model, settings, role=role, hidden_size=model_config.get_hidden_size(),
                num_hidden_layers=model_config.hf_text_config.num_hidden_layers,
            )
            # Warning, not info: served weights now differ from the checkpoint, which must show at any log level.
            _logger.warning("%s", result.log_line(_rank()))
        return loaded

    setattr(load_weights_then_ablate, _INSTALLED_MARK, True)
    DefaultModelLoader.load_weights = load_weights_then_ablate  # type: ignore[method-assign]
