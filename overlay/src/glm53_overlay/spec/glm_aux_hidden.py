"""EAGLE3-style auxiliary hidden states for Glm4MoeLiteForCausalLM (the simulation's tiny GLM target).

DFlash drafts attend to the target's hidden states after the layers in `dflash_config.target_layer_ids`;
vLLM collects them from targets implementing `SupportsEagle3` (the model returns `(hidden, [aux...])`).
vLLM 0.32 implements it for GLM-5.3's `Glm5NextForConditionalGeneration` but not for
`Glm4MoeLiteForCausalLM`, which then fails at load with "Model does not support EAGLE3 interface but
aux_hidden_state_outputs was requested". This module is registered under that architecture name:

- if the installed vLLM's class already supports EAGLE3, the name resolves to vLLM's class unchanged;
- otherwise to a subclass whose inner model records the residual stream (hidden + residual) at the
  input of each requested layer, and after the last layer, exactly as vLLM's DeepSeek-V2 does. The
  recording model is built only when the speculative method consumes aux states; every other launch
  (no speculation, MTP, ngram) builds vLLM's own model.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch
from vllm.distributed import get_pp_group
from vllm.model_executor.models import glm4_moe_lite as _glm
from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3, supports_eagle3
from vllm.sequence import IntermediateTensors

_logger = logging.getLogger(f"vllm.{__name__}")

ARCHITECTURE = "Glm4MoeLiteForCausalLM"
# Speculative methods whose proposer reads the target's aux hidden states.
AUX_METHODS = frozenset({"eagle3", "dflash", "extract_hidden_states"})


def wants_aux_hidden_states(vllm_config: Any) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and spec.method in AUX_METHODS


class Glm4MoeLiteModelWithAux(_glm.Glm4MoeLiteModel, EagleModelMixin):
    """vLLM's Glm4MoeLiteModel.forward plus the aux capture of DeepseekV2Model.forward."""

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]

        aux_hidden_states: list[torch.Tensor] = []
        for index, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
            if index in self.aux_hidden_state_layers:
                aux_hidden_states.append(hidden_states if residual is None else hidden_states + residual)
            hidden_states, residual = layer(positions, hidden_states, residual)

        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        # DFlash's target_layer_ids count from 0 and vLLM adds 1, so the last layer's output is end_layer.
        if self.end_layer in self.aux_hidden_state_layers:
            aux_hidden_states.append(hidden_states + residual)
        hidden_states = self.norm(hidden_states, residual)[0]
        if aux_hidden_states:
            return hidden_states, aux_hidden_states
        return hidden_states


@contextlib.contextmanager
def _inner_model_class(cls: type) -> Iterator[None]:
    # Glm4MoeLiteForCausalLM.__init__ builds the module-global Glm4MoeLiteModel; building the subclass
    # in its place (rather than re-classing the instance afterwards) keeps torch.compile's wrapper, set
    # up in the decorated __init__, bound to the subclass's forward.
    original = _glm.Glm4MoeLiteModel
    _glm.Glm4MoeLiteModel = cls
    try:
        yield
    finally:
        _glm.Glm4MoeLiteModel = original


class Glm4MoeLiteForCausalLMWithAux(_glm.Glm4MoeLiteForCausalLM, SupportsEagle3):
    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        if wants_aux_hidden_states(vllm_config):
            with _inner_model_class(Glm4MoeLiteModelWithAux):
                super().__init__(vllm_config=vllm_config, prefix=prefix)
        else:
            super().__init__(vllm_config=vllm_config, prefix=prefix)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        if not isinstance(self.model, EagleModelMixin):
            raise RuntimeError("glm53-spec: aux hidden states requested but the target was built without them")
        self.model._set_aux_hidden_state_layers(layers)
        _logger.info("glm53-spec: %s records aux hidden states at layers %s", ARCHITECTURE, layers)


def _resolve() -> type:
    if supports_eagle3(_glm.Glm4MoeLiteForCausalLM):
        _logger.info("glm53-spec: this vLLM's %s supports EAGLE3; using it unchanged", ARCHITECTURE)
        return _glm.Glm4MoeLiteForCausalLM
    return Glm4MoeLiteForCausalLMWithAux


# The registry loads "glm53_overlay.spec.glm_aux_hidden:Glm4MoeLiteForCausalLM".
Glm4MoeLiteForCausalLM = _resolve()
