"""Write a tiny DFlash2 draft (DFlash2DraftModel) for a tiny GLM target made by make_tiny_glm.

    python -m tools.sim_model.make_tiny_dflash TARGET_DIR OUTDIR [--seed N] [--if-changed]

Run from the repository root. The output is a few MB and byte-identical for a given target and seed:
config.json in the format vLLM's DFlash2 draft classes load (qwen3 layers + dflash_config with
target_layer_ids, mask_token_id, the grouped-convolution and candidate-selector sizes; non-causal
inside a block like GLM-5.3-Flash-DFlash2), model.safetensors, the target's tokenizer, README.md.
Everything about the target (hidden size, vocabulary, layer count, mask token, its bigrams) is read
from TARGET_DIR, so NoPE or EXL3 targets get a matching draft.

The weights are built so proposals are usually right. The target's skip path maps the current token's
embedding to the next token (make_tiny_glm's planted chain); the draft reads that bigram table off the
target's embedding and lm_head. In every draft layer the MLP's grouped convolution shifts the block by
one position and the MLP is a lookup table from a token's embedding direction to its successor's, so
layer l writes succ^(j)(bonus) into block position j for j <= l + 1, and the draft's own lm_head reads
the direction back as a token: with L layers the first L draft tokens follow the chain, the rest are
noise the target rejects. Attention, the context projection (fc) and the candidate selector carry small
random weights: they run and are checked for shape, but cannot overturn the table.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import provenance
from .make_degenerate import source_digest

WEIGHTS_FILE = "model.safetensors"
MASK_TOKEN = "[MASK]"

# Draft shape relative to the target (hidden size and vocabulary always come from the target).
DRAFT_LAYERS = 3                 # = draft tokens per step that follow the chain
DRAFT_HEADS = 4
DRAFT_KV_HEADS = 2
CONV_KERNEL_SIZE = 2             # taps of DFlash2's grouped convolution: 2 = this row and the one before
CONV_GROUP_SIZE = 16
SELECTOR_RANK = 16
SELECTOR_TOP_K = 8
SLIDING_WINDOW = 2048            # GLM-5.3-Flash-DFlash2's window; longer than any simulated context
TABLE_MULTIPLE = 64              # MLP width = table entries rounded up to this

# How strongly each layer writes the looked-up successor, relative to an embedding's norm: the stream
# of a masked position must end up pointing at the successor, not at the [MASK] embedding.
WRITE_GAIN = 3.0
# Sharpness of the lookup (gate scale): a row fires for its own key and barely for other directions.
GATE_SHARPNESS = 4.0
# A bigram counts as planted when its top logit leads the runner-up by this much (the planted ones lead
# by ~11 at hidden 128; tokens without a planted successor by ~0.1).
MIN_BIGRAM_MARGIN = 3.0
READOUT_GAIN = 1.0
NOISE_GAIN = 0.05                # attention, fc and selector weights


def _read_tensor(target: Path, name: str) -> torch.Tensor:
    index = target / f"{WEIGHTS_FILE}.index.json"
    files = [target / json.loads(index.read_text())["weight_map"][name]] if index.exists() else [target / WEIGHTS_FILE]
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name).float()
    raise KeyError(f"{name} not found in {target}")


def mask_token_id(target: Path, vocab_size: int) -> int:
    """GLM's [MASK] when the tokenizer has it, else the last (unused, padded) id of the vocabulary."""
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
    token = added.get(MASK_TOKEN, tokenizer["model"]["vocab"].get(MASK_TOKEN))
    return int(token) if token is not None else vocab_size - 1


def target_bigrams(embed: torch.Tensor, lm_head: torch.Tensor, skip: set[int]) -> dict[int, int]:
    """Next token the target's skip path predicts for each token it predicts clearly.

    The input is the normalized embedding scaled like a final RMSNorm output, so margins are in logits.
    """
    hidden = embed.shape[1]
    unit = embed / embed.norm(dim=1, keepdim=True)
    logits = (unit * math.sqrt(hidden)) @ lm_head.T
    top = logits.topk(2, dim=1)
    margin = top.values[:, 0] - top.values[:, 1]
    return {
        token: int(top.indices[token, 0])
        for token in range(embed.shape[0])
        if token not in skip and float(margin[token]) >= MIN_BIGRAM_MARGIN
    }


def target_layer_ids(num_target_layers: int) -> list[int]:
    """Up to three target layers spread from the first to the last (the last one is the final state)."""
    if num_target_layers <= 3:
        return list(range(num_target_layers))
    return sorted({0, num_target_layers // 2, num_target_layers - 1})


def draft_config(target_config: dict[str, Any], mask_id: int, intermediate: int) -> dict[str, Any]:
    hidden = target_config["hidden_size"]
    layers = DRAFT_LAYERS
    return {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": DRAFT_HEADS,
        "num_key_value_heads": DRAFT_KV_HEADS,
        "head_dim": hidden // DRAFT_HEADS,
        "vocab_size": target_config["vocab_size"],
        "max_position_embeddings": target_config["max_position_embeddings"],
        "rms_norm_eps": target_config["rms_norm_eps"],
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "rope_theta": 1000000.0,
        # Every layer sliding-window and, inside a draft block, non-causal: masked positions see each other.
        "use_sliding_window": True,
        "sliding_window": SLIDING_WINDOW,
        "max_window_layers": 0,
        "layer_types": ["sliding_attention"] * layers,
        "is_causal": False,
        "num_target_layers": target_config["num_hidden_layers"],
        "dflash_config": {
            "block_size": layers + 1,
            "mask_token_id": mask_id,
            "target_layer_ids": target_layer_ids(target_config["num_hidden_layers"]),
            "use_aux_hidden_state": True,
            "conv_kernel_size": CONV_KERNEL_SIZE,
            "conv_group_size": CONV_GROUP_SIZE,
            "selector_rank": SELECTOR_RANK,
            "selector_top_k": SELECTOR_TOP_K,
        },
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }


def _noise(gen: torch.Generator, rows: int, cols: int, gain: float = NOISE_GAIN) -> torch.Tensor:
    return torch.randn(rows, cols, generator=gen) * (gain / math.sqrt(cols))


def _conv(taps_prepare: tuple[float, ...], taps_finish: tuple[float, ...], hidden: int) -> torch.Tensor:
    """base_kernel [2 sides, taps, hidden]: side 0 filters the block's rows before the sublayer, side 1 after."""
    base = torch.zeros(2, CONV_KERNEL_SIZE, hidden)
    for side, taps in enumerate((taps_prepare, taps_finish)):
        for tap, value in enumerate(taps):
            base[side, tap] = value
    return base


def make_weights(
    config: dict[str, Any], embed: torch.Tensor, successor: dict[int, int], seed: int
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inter = config["intermediate_size"]
    draft = config["dflash_config"]
    groups = hidden // CONV_GROUP_SIZE
    unit = embed / embed.norm(dim=1, keepdim=True)
    scale = math.sqrt(hidden)  # norm of an RMSNorm output that points along one embedding

    # The lookup: row i of gate/up matches key token i's direction, column i of down writes its successor.
    keys = sorted(successor)
    gate = torch.zeros(inter, hidden)
    up = torch.zeros(inter, hidden)
    down = torch.zeros(hidden, inter)
    gate[: len(keys)] = GATE_SHARPNESS * unit[keys]
    up[: len(keys)] = unit[keys]
    # A matching row yields silu(sharpness * scale) * scale ~ sharpness * scale^2; write WRITE_GAIN * scale.
    write = WRITE_GAIN * scale / (GATE_SHARPNESS * scale * scale)
    down[:, : len(keys)] = write * unit[[successor[k] for k in keys]].T

    tensors: dict[str, torch.Tensor] = {
        "fc.weight": _noise(gen, hidden, hidden * len(draft["target_layer_ids"])),
        "hidden_norm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": READOUT_GAIN * unit,
        "candidate_selector.hidden_projection.weight": _noise(gen, SELECTOR_RANK, hidden),
        "candidate_selector.predecessor_codebook": _noise(gen, vocab, SELECTOR_RANK),
        "candidate_selector.successor_codebook": _noise(gen, vocab, SELECTOR_RANK),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
        attn = f"{prefix}.self_attn"
        tensors[f"{attn}.q_proj.weight"] = _noise(gen, heads * head_dim, hidden, 1.0)
        tensors[f"{attn}.k_proj.weight"] = _noise(gen, kv_heads * head_dim, hidden, 1.0)
        tensors[f"{attn}.v_proj.weight"] = _noise(gen, kv_heads * head_dim, hidden, 1.0)
        tensors[f"{attn}.o_proj.weight"] = _noise(gen, hidden, heads * head_dim)
        tensors[f"{attn}.q_norm.weight"] = torch.ones(head_dim)
        tensors[f"{attn}.k_norm.weight"] = torch.ones(head_dim)
        # Attention sees the rows as they are; the MLP sees each row's predecessor in the block.
        tensors[f"{prefix}.attention_conv.base_kernel"] = _conv((1.0, 0.0), (1.0, 0.0), hidden)
        tensors[f"{prefix}.mlp_conv.base_kernel"] = _conv((0.0, 1.0), (1.0, 0.0), hidden)
        for conv in ("attention_conv", "mlp_conv"):
            tensors[f"{prefix}.{conv}.kernel_projection.weight"] = torch.zeros(2 * CONV_KERNEL_SIZE * groups, hidden)
        tensors[f"{prefix}.mlp.gate_proj.weight"] = gate
        tensors[f"{prefix}.mlp.up_proj.weight"] = up
        tensors[f"{prefix}.mlp.down_proj.weight"] = down
    return {name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()}


MODEL_CARD = """---
license: mit
library_name: vllm
---
# tiny-dflash2 (simulation)

A DFlash2 draft for the tiny GLM in `{target}`, made by `tools/sim_model/make_tiny_dflash.py` (seed {seed}):
{layers} layers whose MLPs look up the target's planted next-token table, so the first {layers} draft
tokens of a block usually match what the target writes. It knows nothing else.
"""


def write_draft(target: Path, outdir: Path, seed: int = 0) -> Path:
    target_config = json.loads((target / "config.json").read_text())
    vocab = target_config["vocab_size"]
    mask_id = mask_token_id(target, vocab)
    embed = _read_tensor(target, "model.embed_tokens.weight")
    lm_head = _read_tensor(target, "lm_head.weight")
    successor = target_bigrams(embed, lm_head, skip={mask_id})
    if not successor:
        raise ValueError(f"{target}: no token has a clear next token; is it a make_tiny_glm checkpoint?")
    intermediate = max(TABLE_MULTIPLE, -(-len(successor) // TABLE_MULTIPLE) * TABLE_MULTIPLE)
    config = draft_config(target_config, mask_id, intermediate)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(make_weights(config, embed, successor, seed), str(outdir / WEIGHTS_FILE), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(target / name, outdir / name)
    card = MODEL_CARD.format(target=target.name, seed=seed, layers=config["num_hidden_layers"])
    (outdir / "README.md").write_text(card)
    return outdir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="a tiny GLM checkpoint directory (make_tiny_glm)")
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--if-changed", action="store_true",
                        help="write only when OUTDIR was not made by this code, seed and target")
    args = parser.parse_args(argv)
    made_by = (f"make_tiny_dflash seed {args.seed} target sha256:{source_digest(args.target)}"
               f" generator sha256:{provenance.generator_digest()}")
    if args.if_changed and provenance.keep_if_up_to_date(args.outdir, made_by):
        return 0
    path = write_draft(args.target, args.outdir, args.seed)
    if args.if_changed:
        provenance.stamp(path, made_by)
    total = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    print(f"wrote {path} ({total} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
