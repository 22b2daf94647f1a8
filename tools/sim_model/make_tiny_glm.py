"""Write a tiny GLM checkpoint (Glm4MoeLiteForCausalLM, NoPE MLA, EXL3 MLPs) made entirely here.

    python -m tools.sim_model.make_tiny_glm OUTDIR [--seed N] [--twin TWIN_DIR | --bf16 | --if-changed]

Run from the repository root. The output is a few MB and byte-identical for a given seed: config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json, README.md, and for the
EXL3 checkpoint quantization_config.json. `--twin` also writes the exact BF16 twin (the EXL3 linears
decoded); `--bf16` writes only the BF16 model the EXL3 one is derived from. `--if-changed` prints "up to
date" and writes nothing when OUTDIR was made by the same generator code and seed (tools/sim_model/provenance.py),
else replaces it.

The weights are random except for a planted next-token map: the residual stream carries the current
token's embedding and lm_head maps it to the next word of a long chain drawn from the training text,
so greedy decoding writes varied English words (and never picks EOS) while attention and the experts
still nudge some choices, which keeps wrong kernels visible in the output.

One MTP layer follows (`model.layers.{num_hidden_layers}`, GLM's `num_nextn_predict_layers` 1, the names
vLLM's Glm4MoeLiteMTP loads), drawn last from its own generator so every other tensor is byte-identical
to a model without it; the target never reads it. It predicts the token after next along the same chain:
eh_proj passes the next token's normalized embedding through, its block writes at a small gain, and its
shared head is lm_head, so its drafts are right wherever the target follows the chain.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from . import provenance
from .corpus import TRAINING_TEXT
from glm53_overlay.exl3.writer import quantize_checkpoint

from .tiny_glm_config import (
    BLOCK_OUTPUT_GAIN, EXL3_BITS, EXL3_CODEBOOK, LM_HEAD_GAIN, MTP_BLOCK_GAIN, MTP_SEED_OFFSET, MTP_STATE_GAIN,
    TINY_GLM, hf_config,
)
from .tiny_tokenizer import save_tokenizer, special_token_ids, train_tokenizer

WEIGHTS_FILE = "model.safetensors"


def word_chain(tokenizer: Tokenizer) -> list[int]:
    """Distinct tokens of the training text in order of first appearance: the cycle greedy text walks."""
    seen: dict[int, None] = {}
    # Line breaks inside paragraphs would glue words together once bare whitespace is dropped.
    for token_id in tokenizer.encode(" ".join(TRAINING_TEXT.split())).ids:
        piece = tokenizer.id_to_token(token_id)
        # Bare whitespace would make the walk print runs of blanks.
        if piece.strip("ĠĊ") and token_id not in seen:
            seen[token_id] = None
    return list(seen)


def next_token_map(tokenizer: Tokenizer) -> dict[int, int]:
    """Planted successor of each token that has one (the rest get weak random logits)."""
    chain = word_chain(tokenizer)
    special = special_token_ids(tokenizer)
    successor = {token: chain[(i + 1) % len(chain)] for i, token in enumerate(chain)}
    # Thinking on: close the think block at once, so reasoning parsers hand the words to `content`.
    successor[special["<|assistant|>"]] = special["<think>"]
    successor[special["<think>"]] = special["</think>"]
    successor[special["</think>"]] = chain[0]
    return successor


def _linear(gen: torch.Generator, out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=gen) * (gain / math.sqrt(in_features))


def _mlp(gen: torch.Generator, prefix: str, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.gate_proj.weight": _linear(gen, inter, hidden),
        f"{prefix}.up_proj.weight": _linear(gen, inter, hidden),
        f"{prefix}.down_proj.weight": _linear(gen, hidden, inter, BLOCK_OUTPUT_GAIN),
    }


def _attention(gen: torch.Generator, prefix: str, shape: dict[str, Any]) -> dict[str, torch.Tensor]:
    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    qk_head = shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"]
    tensors: dict[str, torch.Tensor] = {}
    if shape["q_lora_rank"]:
        tensors[f"{prefix}.q_a_proj.weight"] = _linear(gen, shape["q_lora_rank"], hidden)
        tensors[f"{prefix}.q_a_layernorm.weight"] = torch.ones(shape["q_lora_rank"])
        tensors[f"{prefix}.q_b_proj.weight"] = _linear(gen, heads * qk_head, shape["q_lora_rank"])
    else:
        tensors[f"{prefix}.q_proj.weight"] = _linear(gen, heads * qk_head, hidden)
    kv_rank = shape["kv_lora_rank"]
    tensors[f"{prefix}.kv_a_proj_with_mqa.weight"] = _linear(gen, kv_rank + shape["qk_rope_head_dim"], hidden)
    tensors[f"{prefix}.kv_a_layernorm.weight"] = torch.ones(kv_rank)
    tensors[f"{prefix}.kv_b_proj.weight"] = _linear(
        gen, heads * (shape["qk_nope_head_dim"] + shape["v_head_dim"]), kv_rank
    )
    tensors[f"{prefix}.o_proj.weight"] = _linear(gen, hidden, heads * shape["v_head_dim"], BLOCK_OUTPUT_GAIN)
    return tensors


def _moe(gen: torch.Generator, prefix: str, shape: dict[str, Any]) -> dict[str, torch.Tensor]:
    hidden, inter, experts = shape["hidden_size"], shape["moe_intermediate_size"], shape["n_routed_experts"]
    # A sharp router spreads tokens over all experts instead of a favourite pair.
    tensors = {f"{prefix}.gate.weight": _linear(gen, experts, hidden, 4.0)}
    tensors[f"{prefix}.gate.e_score_correction_bias"] = torch.zeros(experts)
    for expert in range(experts):
        tensors.update(_mlp(gen, f"{prefix}.experts.{expert}", hidden, inter))
    tensors.update(_mlp(gen, f"{prefix}.shared_experts", hidden, inter * shape["n_shared_experts"]))
    return tensors


def _mtp_layer(gen: torch.Generator, shape: dict[str, Any], embed: torch.Tensor,
               lm_head: torch.Tensor) -> dict[str, torch.Tensor]:
    """The MTP block after the last layer: [enorm(embed(next token)), hnorm(target hidden)] -> eh_proj ->
    decoder layer (attention + MoE) -> shared_head (norm, head)."""
    hidden = shape["hidden_size"]
    prefix = f"model.layers.{shape['num_hidden_layers']}"
    # The embedding half is the identity: the block's residual carries the next token as the target's does,
    # so the shared head (lm_head) names its planted successor. The target-state half adds a little noise.
    eh_proj = torch.cat([torch.eye(hidden), _linear(gen, hidden, hidden, MTP_STATE_GAIN)], dim=1)
    tensors = {
        f"{prefix}.enorm.weight": torch.ones(hidden),
        f"{prefix}.hnorm.weight": torch.ones(hidden),
        f"{prefix}.eh_proj.weight": eh_proj,
        f"{prefix}.input_layernorm.weight": torch.ones(hidden),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(hidden),
    }
    block = _attention(gen, f"{prefix}.self_attn", shape) | _moe(gen, f"{prefix}.mlp", shape)
    # The target's blocks write at BLOCK_OUTPUT_GAIN, enough to leave the chain about 1 step in 10; the MTP
    # block writes more quietly so its drafts stay on the chain and are accepted wherever the target is.
    for name, weight in block.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            block[name] = weight * (MTP_BLOCK_GAIN / BLOCK_OUTPUT_GAIN)
    tensors |= block
    # Real GLM/DeepSeek checkpoints carry the MTP layer's own copies of the embedding and the head; vLLM shares
    # the target's at load, but a BF16 load checks that every parameter came from the checkpoint.
    tensors[f"{prefix}.embed_tokens.weight"] = embed.clone()
    tensors[f"{prefix}.shared_head.norm.weight"] = torch.ones(hidden)
    tensors[f"{prefix}.shared_head.head.weight"] = lm_head.clone()
    return tensors


def make_weights(shape: dict[str, Any], successor: dict[int, int], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    vocab, hidden = shape["vocab_size"], shape["hidden_size"]
    embed = torch.randn(vocab, hidden, generator=gen)
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for layer in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors.update(_attention(gen, f"{prefix}.self_attn", shape))
        if layer < shape["first_k_dense_replace"]:
            tensors.update(_mlp(gen, f"{prefix}.mlp", hidden, shape["intermediate_size"]))
        else:
            tensors.update(_moe(gen, f"{prefix}.mlp", shape))
    tensors["model.norm.weight"] = torch.ones(hidden)
    # Rows without a planted predecessor (EOS among them) stay near zero, below any planted logit.
    lm_head = torch.randn(vocab, hidden, generator=gen) * 0.01
    unit = embed / embed.norm(dim=1, keepdim=True)
    for token, nxt in successor.items():
        lm_head[nxt] += LM_HEAD_GAIN * unit[token]
    tensors["lm_head.weight"] = lm_head
    if shape.get("num_nextn_predict_layers"):
        # Its own generator, drawn after everything else: the target's tensors do not depend on the MTP layer.
        mtp_gen = torch.Generator().manual_seed(seed + MTP_SEED_OFFSET)
        tensors.update(_mtp_layer(mtp_gen, shape, embed, lm_head))
    # Real GLM checkpoints keep the router bias in fp32 and everything else in bf16.
    return {
        name: t.float().contiguous() if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16).contiguous()
        for name, t in tensors.items()
    }


def generation_config(special: dict[str, int]) -> dict[str, Any]:
    return {
        "eos_token_id": [special["<|endoftext|>"], special["<|user|>"], special["<|observation|>"]],
        "pad_token_id": special["<|endoftext|>"],
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 0.95,
    }


MODEL_CARD = """---
license: mit
library_name: transformers
pipeline_tag: text-generation
---
# tiny-glm (simulation)

Random weights with a planted word chain, GLM-4.7-Flash architecture at toy size. Made by
`tools/sim_model/make_tiny_glm.py` (seed {seed}); it knows nothing.
"""


def write_bf16_checkpoint(outdir: Path, seed: int = 0, shape: dict[str, Any] | None = None) -> Path:
    shape = dict(TINY_GLM if shape is None else shape)
    outdir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(shape["vocab_size"])
    special = special_token_ids(tokenizer)
    save_tokenizer(tokenizer, outdir, shape["max_position_embeddings"])
    config = hf_config(shape, special)
    (outdir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (outdir / "generation_config.json").write_text(json.dumps(generation_config(special), indent=2) + "\n")
    weights = make_weights(shape, next_token_map(tokenizer), seed)
    save_file(weights, str(outdir / WEIGHTS_FILE), metadata={"format": "pt"})
    (outdir / "README.md").write_text(MODEL_CARD.format(seed=seed))
    return outdir


def write_checkpoint(outdir: Path, seed: int = 0, shape: dict[str, Any] | None = None,
                     twin: Path | None = None) -> Path:
    """The simulated cluster's model: EXL3 MLP linears (random valid encodings at the BF16 weights' scale)."""
    with tempfile.TemporaryDirectory() as scratch:
        source = write_bf16_checkpoint(Path(scratch) / "bf16", seed, shape)
        quantize_checkpoint(source, outdir, twin or Path(scratch) / "twin", bits=EXL3_BITS,
                            codebook=EXL3_CODEBOOK, seed=seed)
    return outdir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    variant = parser.add_mutually_exclusive_group()
    variant.add_argument("--twin", type=Path, help="also write the EXL3 model's exact BF16 twin here")
    variant.add_argument("--bf16", action="store_true", help="write the BF16 model instead of the EXL3 one")
    variant.add_argument("--if-changed", action="store_true",
                         help="write the EXL3 model only when OUTDIR was not made by this code and seed")
    args = parser.parse_args(argv)
    made_by = f"make_tiny_glm seed {args.seed} generator sha256:{provenance.generator_digest()}"
    if args.if_changed and provenance.keep_if_up_to_date(args.outdir, made_by):
        return 0
    if args.bf16:
        path = write_bf16_checkpoint(args.outdir, args.seed)
    else:
        path = write_checkpoint(args.outdir, args.seed, twin=args.twin)
    if args.if_changed:
        provenance.stamp(path, made_by)
    total = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    print(f"wrote {path} ({total} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
