"""Where the ablation enters vLLM: right after DefaultModelLoader.load_weights, on every rank.

That point is after the checkpoint is in the parameters and before `process_weights_after_loading`
(which on CPU repacks o_proj into a oneDNN layout and drops `.weight`) and before any CUDA-graph
capture. `load_weights(self, model, model_config)` is BaseModelLoader's abstract API, stable across
vLLM 0.32 and 0.33, and the draft model goes through the same call with its own ModelConfig object,
which is how the target is told apart from a drafter. BaseModelLoader.load_model is wrapped too, so
that a load format which never calls DefaultModelLoader.load_weights fails instead of serving unedited.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from glm53_overlay.ablation.edit import ablate_model
from glm53_overlay.ablation.settings import AblationSettingError, AblationSettings

_logger = logging.getLogger(f"vllm.{__name__}")
_INSTALLED_MARK = "_glm53_ablation_hook"
_APPLIED_MARK = "_glm53_ablation_applied"


def _model_role(model_config: Any, settings: AblationSettings) -> str | None:
    """Which model is loading: "target", "mtp" (only when included), or None for one to leave alone."""
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


def ablating_load_weights(load_weights: Callable[..., Any], settings: AblationSettings) -> Callable[..., Any]:
    """`load_weights(self, model, model_config)` that ablates the model right after loading it."""

    @functools.wraps(load_weights)
    def load_weights_then_ablate(self: Any, model: torch.nn.Module, model_config: Any) -> Any:
        loaded = load_weights(self, model, model_config)
        role = _model_role(model_config, settings)
        if role is not None:
            result = ablate_model(
                model, settings, role=role, hidden_size=model_config.get_hidden_size(),
                num_hidden_layers=model_config.hf_text_config.num_hidden_layers,
            )
            setattr(model, _APPLIED_MARK, True)
            # Warning, not info: served weights now differ from the checkpoint, which must show at any log level.
            _logger.warning("%s", result.log_line(_rank()))
        return loaded

    setattr(load_weights_then_ablate, _INSTALLED_MARK, True)
    return load_weights_then_ablate


def checked_load_model(load_model: Callable[..., Any], settings: AblationSettings) -> Callable[..., Any]:
    """`load_model(self, vllm_config, model_config, ...)` that refuses a model the ablation should have edited."""

    @functools.wraps(load_model)
    def load_model_checked(self: Any, vllm_config: Any, model_config: Any, *args: Any, **kwargs: Any) -> Any:
        model = load_model(self, vllm_config, model_config, *args, **kwargs)
        # Another load format (sharded_state, runai, ...) skips DefaultModelLoader.load_weights; serving
        # the unedited model would look like success, so refuse instead.
        if _model_role(model_config, settings) is not None and not getattr(model, _APPLIED_MARK, False):
            raise AblationSettingError(
                "GLM53_ABLATION_ENABLED",
                f"load format {self.load_config.load_format!r} ({type(self).__name__}) bypasses the ablation hook",
            )
        return model

    return load_model_checked


def install_ablation_hook(settings: AblationSettings) -> None:
    """Wrap the loaders once per process (register() may run more than once)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    if getattr(DefaultModelLoader.load_weights, _INSTALLED_MARK, False):
        return
    DefaultModelLoader.load_weights = ablating_load_weights(  # type: ignore[method-assign]
        DefaultModelLoader.load_weights, settings)
    BaseModelLoader.load_model = checked_load_model(BaseModelLoader.load_model, settings)  # type: ignore[method-assign]
