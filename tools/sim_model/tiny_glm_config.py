"""The one place that knows the tiny checkpoint's shape: GLM-5.3 Flash's NoPE MLA (qk_rope_head_dim 0,
kv_lora_rank 512) in the GLM-4.7-Flash model class, with EXL3 MLP linears (see EXL3_LINEARS)."""
from __future__ import annotations

from typing import Any

# GLM-4.7-Flash architecture (Glm4MoeLiteForCausalLM) at toy size. kv_lora_rank stays at the real 512
# because vLLM's MLA backends (CPU included) only accept a 512-wide latent; with no rope part (NoPE,
# as in GLM-5.3 Flash) the overlay pads the missing 64 rope dims with zeros.
TINY_GLM: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 0,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "routed_scaling_factor": 1.8,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-5,
    # One MTP layer (model.layers.3) as GLM-5.3 has one: vLLM's `"method": "mtp"` drafts with it.
    "num_nextn_predict_layers": 1,
}

# EXL3 like exllamav3 writes GLM MoE checkpoints: 4 bits per weight, mcg codebook, on the routed experts,
# the shared experts and the dense MLP (vLLM's fused-MoE and linear paths of the overlay).
EXL3_BITS = 4
EXL3_CODEBOOK = "mcg"


# How strongly attention and MLP blocks may move the residual stream away from the current token's
# embedding. At 1.5 greedy text follows the planted word chain about 9 times in 10 (measured with
# check_tiny_glm); the other choices are made by attention and the experts, so a wrong kernel shows.
BLOCK_OUTPUT_GAIN = 1.5
# Logit scale of the planted next-token map; about 11 logits of margin at hidden 128.
LM_HEAD_GAIN = 1.0
# The MTP layer (make_tiny_glm._mtp_layer): its block writes at MTP_BLOCK_GAIN instead of BLOCK_OUTPUT_GAIN so
# its drafts follow the chain, and the target-state half of eh_proj is noise of MTP_STATE_GAIN. Its weights come
# from a generator seeded with seed + MTP_SEED_OFFSET, apart from the target's.
MTP_BLOCK_GAIN = 0.3
MTP_STATE_GAIN = 0.1
MTP_SEED_OFFSET = 0x4D5450
TORCH_DTYPE = "bfloat16"


def hf_config(shape: dict[str, Any], special_ids: dict[str, int]) -> dict[str, Any]:
    """config.json for `shape`; vLLM reads first_k_dense_replace, transformers reads mlp_layer_types."""
    layers = shape["num_hidden_layers"]
    dense = shape["first_k_dense_replace"]
    eos_ids = [special_ids["<|endoftext|>"], special_ids["<|user|>"], special_ids["<|observation|>"]]
    return {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "model_type": "glm4_moe_lite",
        **{k: v for k, v in shape.items() if k != "rope_theta"},
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (layers - dense),
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "partial_rotary_factor": 1.0,
        "rope_interleave": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape["rope_theta"]},
        "rope_scaling": None,
        "rope_theta": shape["rope_theta"],
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "pad_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": eos_ids,
        "dtype": TORCH_DTYPE,
        "torch_dtype": TORCH_DTYPE,
    }
