"""GLM-specific glue for vLLM's own DFlash2 drafter; each piece is installed only where vLLM lacks it.

- glm_aux_hidden: EAGLE3 aux hidden states for Glm4MoeLiteForCausalLM (GLM-5.3's class has them).
- draft_defaults: draft KV dtype `auto` next to an fp8 target; DFlash2 drafts non-causal in a block.
- candidate_walk: DFlash2's candidate walk on the V1 runner when there is no Triton (CPU simulation).
- cpu_expand: a working stand-in for the rejection sampler's expand kernel when there is no Triton, where
  vLLM's own leaves sampled requests' per-token temperatures unwritten.

Everything is patched lazily (registry strings, post-import hooks), so register() stays cheap.
"""

from __future__ import annotations

import logging

from glm53_overlay.vllm_compat import SPEC_GLUE_RELEASES, find_vllm, unchecked_reason

_logger = logging.getLogger(f"vllm.{__name__}")

GLM_AUX_ARCHITECTURE = "Glm4MoeLiteForCausalLM"


def _triton_available() -> bool:
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


def install_spec_glue() -> list[str]:
    """Install what this vLLM needs; returns the names of the installed pieces (empty if none)."""
    reason = unchecked_reason(find_vllm(), SPEC_GLUE_RELEASES)
    if reason is not None:
        _logger.warning("glm53-spec: nothing installed (%s)", reason)
        return []
    from vllm import ModelRegistry

    from glm53_overlay.spec.candidate_walk import (
        allow_candidate_drafts_on_v1, patch_dflash_proposer, patch_logits_processor,
    )
    from glm53_overlay.spec.cpu_expand import patch_cpu_triton_utils
    from glm53_overlay.spec.draft_defaults import patch_engine_args
    from glm53_overlay.spec.on_import import when_imported

    installed = ["glm-aux-hidden-states", "dflash-draft-defaults"]
    # A string registration: the module is imported only when a model of that architecture loads, and
    # resolves to vLLM's own class where that already supports EAGLE3.
    ModelRegistry.register_model(GLM_AUX_ARCHITECTURE, f"glm53_overlay.spec.glm_aux_hidden:{GLM_AUX_ARCHITECTURE}")
    when_imported("vllm.engine.arg_utils", lambda module: patch_engine_args(module.EngineArgs))
    if not _triton_available():
        when_imported("vllm.config.vllm", lambda module: allow_candidate_drafts_on_v1(module.VllmConfig))
        when_imported("vllm.v1.spec_decode.dflash", patch_dflash_proposer)
        when_imported("vllm.model_executor.layers.logits_processor", patch_logits_processor)
        installed.append("dflash2-v1-candidate-walk")
        # Before the CPU platform registers its kernel stand-ins (worker start, after the plugins load).
        when_imported("vllm.utils.cpu_triton_utils", patch_cpu_triton_utils)
        installed.append("cpu-expand-kernel-check")
    return installed
