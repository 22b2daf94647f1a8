"""glm53_dense_quantization: the env parsing, the device rule, and the method each linear gets from Exl3Config."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from glm53_overlay.exl3 import dense
from glm53_overlay.exl3.dense import DenseQuantizationError, check_supported, parse_dense_quantization, stays_bf16

vllm_required = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")


@pytest.mark.parametrize(("environ", "mode"), [({}, "none"), ({dense.ENV: ""}, "none"), ({dense.ENV: "none"}, "none"),
                                               ({dense.ENV: "fp8"}, "fp8"), ({dense.ENV: " fp8\n"}, "fp8")])
def test_env_parsing(environ, mode):
    assert parse_dense_quantization(environ) == mode


@pytest.mark.parametrize("value", ["FP8", "int8", "bf16", "true"])
def test_unknown_values_are_refused_by_setting_name(value):
    with pytest.raises(DenseQuantizationError, match=r"glm53_dense_quantization: .* is not one of none, fp8"):
        parse_dense_quantization({dense.ENV: value})


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0), (12, 1)])
def test_fp8_is_allowed_on_fp8_tensor_cores(capability):
    check_supported("fp8", capability)


@pytest.mark.parametrize(("capability", "message"), [(None, "no CUDA GPU"), ((8, 6), "compute capability 8.6"),
                                                     ((8, 0), "compute capability 8.0"), ((7, 5), "7.5")])
def test_fp8_is_refused_without_them(capability, message):
    with pytest.raises(DenseQuantizationError, match=f"glm53_dense_quantization is fp8.*{message}.*set it to none"):
        check_supported("fp8", capability)
    check_supported("none", capability)


@pytest.mark.parametrize(("prefix", "kept"), [
    ("model.layers.3.mlp.gate", True),
    ("language_model.model.layers.10.mlp.gate", True),
    ("model.layers.3.self_attn.kv_b_proj", True),
    ("model.layers.3.self_attn.indexer.wk_weights_proj", True),
    ("visual.blocks.0.attn.qkv", True),
    ("model.visual.merger.proj", True),
    ("model.layers.0.mlp.gate_up_proj", False),
    ("model.layers.4.mlp.shared_experts.gate_up_proj", False),
    ("model.layers.4.mlp.shared_experts.down_proj", False),
    ("model.layers.0.self_attn.qkv_proj", False),
    ("model.layers.0.self_attn.g_a_proj", False),
    ("model.layers.3.self_attn.fused_qkv_a_proj", False),
    ("model.layers.3.self_attn.indexer.wq_b", False),
    ("model.layers.3.self_attn.o_proj", False),
])
def test_which_linears_stay_bf16(prefix, kept):
    assert stays_bf16(prefix) is kept


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """A real VllmConfig of a tiny BF16 model (vLLM's FP8 linear method reads the model dtype from it), in one
    process standing in for TP rank 0 of 1 (vLLM's parameters read the rank from its model-parallel group)."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor import parameter

    model = tmp_path_factory.mktemp("tiny")
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 128,
        "torch_dtype": "bfloat16", "max_position_embeddings": 256}))
    config = VllmConfig(model_config=ModelConfig(model=str(model), dtype="bfloat16", skip_tokenizer_init=True))
    with set_current_vllm_config(config), pytest.MonkeyPatch.context() as patch:
        patch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
        patch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
        yield config


def _linear(prefix: str):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    return ReplicatedLinear(64, 128, bias=False, params_dtype=torch.bfloat16, quant_config=None, prefix=prefix,
                            disable_tp=True)


@vllm_required
@pytest.mark.parametrize(("mode", "prefix", "method"), [
    ("none", "model.layers.0.self_attn.o_proj", "Exl3LinearMethod"),
    ("none", "model.layers.3.mlp.gate", "Exl3LinearMethod"),
    ("fp8", "model.layers.0.self_attn.o_proj", "Fp8PerTensorOnlineLinearMethod"),
    ("fp8", "model.layers.4.mlp.shared_experts.gate_up_proj", "Fp8PerTensorOnlineLinearMethod"),
    ("fp8", "model.layers.3.mlp.gate", "Exl3LinearMethod"),
    ("fp8", "model.layers.3.self_attn.kv_b_proj", "Exl3LinearMethod"),
])
def test_exl3_config_gives_each_linear_its_method(vllm_config, mode, prefix, method):
    from glm53_overlay.exl3.config import Exl3Config

    config = Exl3Config({"quant_method": "exl3", "bits": 4}, dense_quantization=mode)
    assert type(config.get_quant_method(_linear(prefix), prefix)).__name__ == method


@vllm_required
def test_non_linear_layers_get_no_method(vllm_config):
    from glm53_overlay.exl3.config import Exl3Config

    config = Exl3Config({"quant_method": "exl3"}, dense_quantization="fp8")
    assert config.get_quant_method(torch.nn.LayerNorm(64), "model.layers.0.input_layernorm") is None


@vllm_required
def test_fp8_is_refused_at_load_on_this_cpu(monkeypatch):
    from glm53_overlay.exl3.config import Exl3Config

    monkeypatch.setenv(dense.ENV, "fp8")
    with pytest.raises(DenseQuantizationError, match="glm53_dense_quantization is fp8, but this rank has no CUDA GPU"):
        Exl3Config.from_config({"quant_method": "exl3", "bits": 4})
    monkeypatch.setenv(dense.ENV, "none")
    assert Exl3Config.from_config({"quant_method": "exl3", "bits": 4}).dense_quantization == "none"
    monkeypatch.setenv(dense.ENV, "int4")
    with pytest.raises(DenseQuantizationError, match="glm53_dense_quantization: 'int4'"):
        Exl3Config.from_config({"quant_method": "exl3"})
