# SPDX-License-Identifier: MIT
from __future__ import annotations

import json
from typing import Any

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.serve_argv import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    render_serve_argv,
    settings_warnings,
    speculative_config,
    validate_settings,
)

MODEL = "/root/.cache/huggingface/hub/models--Mia-AiLab--GLM-5.3-Flash-EXL3-TR3-4bpw/snapshots/abc123"
DRAFT = "/root/.cache/huggingface/hub/models--incoai--GLM-5.3-Flash-DFlash2/snapshots/def456"

# The production launch of REFERENCE.md, as role variables without the glm53_ prefix.
PRODUCTION: dict[str, Any] = {
    "model": MODEL,
    "served_model_name": "GLM-5.3-Flash-EXL3",
    "port": 8888,
    "quantization": "exl3",
    "kv_cache_dtype": "fp8",
    "max_model_len": 900000,
    "gpu_memory_utilization": 0.87,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 1024,
    "enable_prefix_caching": True,
    "skip_mm_profiling": True,
    "limit_mm": {"video": 1, "image": 4},
    "spec_method": "dflash",
    "dflash_tokens": 7,
    "mtp_tokens": 2,
    "draft_model": DRAFT,
    "draft_tensor_parallel_size": 1,
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 1,
    "master_port": 29521,
    "tool_call_parser": "glm47",
    "reasoning_parser": "glm45",
    "attention_backend": "",
    "trust_remote_code": False,
    "enforce_eager": False,
    "dtype": "",
    "extra_serve_args": [],
}

ENGINE = [
    MODEL,
    "--quantization", "exl3",
    "--kv-cache-dtype", "fp8",
    "--max-model-len", "900000",
    "--gpu-memory-utilization", "0.87",
    "--max-num-seqs", "4",
    "--max-num-batched-tokens", "1024",
    "--enable-prefix-caching",
    "--skip-mm-profiling",
    "--limit-mm-per-prompt", '{"image":4,"video":1}',
    "--speculative-config",
    '{"draft_tensor_parallel_size":1,"method":"dflash","model":"' + DRAFT + '","num_speculative_tokens":7}',
]

API_ONLY = ("--port", "--served-model-name", "--tool-call-parser", "--enable-auto-tool-choice",
            "--reasoning-parser")


def settings(**changes: Any) -> dict[str, Any]:
    return {**PRODUCTION, **changes}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_head_of_two_sparks_is_the_recipe_command():
    argv = render_serve_argv(PRODUCTION, rank=0, nnodes=2, master_addr="10.0.0.1")
    assert argv == ["serve", *ENGINE,
                    "--tensor-parallel-size", "2",
                    "--distributed-executor-backend", "mp",
                    "--nnodes", "2", "--node-rank", "0",
                    "--master-addr", "10.0.0.1", "--master-port", "29521",
                    "--port", "8888",
                    "--served-model-name", "GLM-5.3-Flash-EXL3",
                    "--tool-call-parser", "glm47", "--enable-auto-tool-choice",
                    "--reasoning-parser", "glm45"]


def test_worker_is_headless_without_api_flags():
    argv = render_serve_argv(PRODUCTION, rank=1, nnodes=2, master_addr="10.0.0.1")
    assert argv == ["serve", *ENGINE,
                    "--tensor-parallel-size", "2",
                    "--distributed-executor-backend", "mp",
                    "--nnodes", "2", "--node-rank", "1",
                    "--master-addr", "10.0.0.1", "--master-port", "29521",
                    "--headless"]


def test_engine_flags_are_identical_on_every_rank_of_four():
    s = settings(tensor_parallel_size=4)
    ranks = [render_serve_argv(s, rank=r, nnodes=4, master_addr="10.0.0.1") for r in range(4)]
    shared = ranks[0][:ranks[0].index("--node-rank")]
    assert all(a[:len(shared)] == shared for a in ranks)
    assert {flag(a, "--master-addr") for a in ranks} == {"10.0.0.1"}
    assert [flag(a, "--node-rank") for a in ranks] == ["0", "1", "2", "3"]
    assert ["--headless" in a for a in ranks] == [False, True, True, True]
    assert all(not any(f in a for f in API_ONLY) for a in ranks[1:])
    assert flag(ranks[3], "--tensor-parallel-size") == "4" and "--pipeline-parallel-size" not in ranks[3]


def test_pipeline_parallel_across_four_nodes():
    argv = render_serve_argv(settings(tensor_parallel_size=2, pipeline_parallel_size=2),
                             rank=3, nnodes=4, master_addr="10.0.0.1")
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert flag(argv, "--pipeline-parallel-size") == "2"


def test_mtp_and_none_speculation():
    mtp = render_serve_argv(settings(spec_method="mtp", mtp_tokens=2, draft_model=""),
                            rank=0, nnodes=2, master_addr="10.0.0.1")
    assert flag(mtp, "--speculative-config") == '{"method":"mtp","num_speculative_tokens":2}'
    none = render_serve_argv(settings(spec_method="none", dflash_tokens=0, draft_model=""),
                             rank=1, nnodes=2, master_addr="10.0.0.1")
    assert "--speculative-config" not in none


def test_speculative_config_dflash_shape():
    assert speculative_config(PRODUCTION) == {
        "method": "dflash", "model": DRAFT, "num_speculative_tokens": 7, "draft_tensor_parallel_size": 1,
    }
    assert speculative_config(settings(spec_method="none")) is None


def test_optional_flags_are_omitted_when_empty():
    s = settings(quantization="", served_model_name="", tool_call_parser="", reasoning_parser="",
                 limit_mm=None, skip_mm_profiling=False, spec_method="none")
    del s["enable_prefix_caching"]
    argv = render_serve_argv(s, rank=0, nnodes=2, master_addr="10.0.0.1")
    for absent in ("--quantization", "--served-model-name", "--tool-call-parser", "--enable-auto-tool-choice",
                   "--reasoning-parser", "--limit-mm-per-prompt", "--skip-mm-profiling", "--enable-prefix-caching",
                   "--no-enable-prefix-caching", "--attention-backend", "--dtype", "--trust-remote-code",
                   "--enforce-eager"):
        assert absent not in argv
    assert flag(argv, "--port") == "8888"


def test_simulation_settings_and_extra_args_last():
    s = settings(quantization="exl3", kv_cache_dtype="auto", gpu_memory_utilization="0.2",
                 enable_prefix_caching=False, attention_backend="CPU_ATTN", trust_remote_code=True,
                 enforce_eager=True, dtype="bfloat16", port="8888", extra_serve_args=["--block-size", "128"])
    argv = render_serve_argv(s, rank=1, nnodes=2, master_addr="172.28.0.10")
    assert argv[1:3] == [MODEL, "--trust-remote-code"]
    assert flag(argv, "--dtype") == "bfloat16"
    assert flag(argv, "--gpu-memory-utilization") == "0.2"
    assert flag(argv, "--attention-backend") == "CPU_ATTN"
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    assert argv[-3:] == ["--headless", "--block-size", "128"]


def test_strings_from_extra_vars_are_coerced():
    argv = render_serve_argv(settings(port="8000", master_port="29500", tensor_parallel_size="2",
                                      enable_prefix_caching="yes", dflash_tokens="5"),
                             rank=0, nnodes=2, master_addr="10.0.0.1")
    assert flag(argv, "--port") == "8000" and flag(argv, "--master-port") == "29500"
    assert "--enable-prefix-caching" in argv
    assert json.loads(flag(argv, "--speculative-config"))["num_speculative_tokens"] == 5


def test_json_flags_are_compact_and_sorted():
    argv = render_serve_argv(settings(limit_mm={"video": 0, "image": 2}),
                             rank=0, nnodes=2, master_addr="10.0.0.1")
    assert flag(argv, "--limit-mm-per-prompt") == '{"image":2,"video":0}'


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"rank": 2, "nnodes": 2}, "node rank 2 is outside 0..1 for 2 nodes"),
        ({"rank": -1, "nnodes": 2}, "node rank -1 is outside"),
        ({"rank": 0, "nnodes": 4}, r"glm53_tensor_parallel_size \(2\) x glm53_pipeline_parallel_size \(1\) "
                                   r"must equal the number of GPUs, 4 nodes"),
        ({"rank": 0, "nnodes": 0}, "number of nodes must be an integer >= 1"),
        ({"rank": 0, "nnodes": 2, "master_addr": ""}, "master_addr"),
    ],
)
def test_topology_errors(kw, message):
    args = {"master_addr": "10.0.0.1", **kw}
    with pytest.raises(ValueError, match=message):
        render_serve_argv(PRODUCTION, **args)


def test_render_refuses_invalid_settings_naming_every_variable():
    with pytest.raises(ValueError) as err:
        render_serve_argv(settings(master_port=8888, max_num_seqs=8, max_num_batched_tokens=4),
                          rank=0, nnodes=2, master_addr="10.0.0.1")
    assert "glm53_port and glm53_master_port must differ" in str(err.value)
    assert "glm53_max_num_batched_tokens (4) must be >= glm53_max_num_seqs (8)" in str(err.value)


def test_production_settings_are_valid():
    assert validate_settings(PRODUCTION) == []
    assert settings_warnings(PRODUCTION) == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"master_port": 8888}, "glm53_port and glm53_master_port must differ"),
        ({"tensor_parallel_size": 3}, "glm53_tensor_parallel_size must be a divisor of the model's 64 attention"),
        ({"tensor_parallel_size": 0}, "glm53_tensor_parallel_size must be a divisor of the model's 64 attention"),
        ({"dflash_tokens": None}, "glm53_dflash_tokens is required when glm53_spec_method is dflash"),
        ({"draft_model": ""}, "the draft checkpoint (glm53_draft_repo) is required when glm53_spec_method is dflash"),
        ({"draft_tensor_parallel_size": 3}, "glm53_draft_tensor_parallel_size must be 1 or glm53_tensor_parallel"),
        ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, "glm53_max_num_batched_tokens (4) must be >= "),
        ({"model": ""}, "glm53_model is required"),
    ],
)
def test_validate_settings_names_the_variable(changes, message):
    errors = validate_settings(settings(**changes))
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("changes", [
    {"gpu_memory_utilization": 1.5}, {"gpu_memory_utilization": "lots"}, {"port": 70000}, {"master_port": "x"},
    {"max_model_len": 0}, {"spec_method": "eagle3"}, {"kv_cache_dtype": "nvfp4"}, {"dflash_tokens": 0},
    {"kv_cache_memory_bytes": -1, "gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION},
    {"long_prefill_token_threshold": -1, "long_prefill_adaptive": False},
    {"pipeline_parallel_size": 0}, {"enable_prefix_caching": "maybe"}, {"limit_mm": "image=4"},
    {"extra_serve_args": "--foo bar"}, {"extra_serve_args": ["--moe-backend", 1]}, {"served_model_name": 5},
    {"port": True},
])
def test_a_value_only_its_own_rule_refuses_is_left_to_settings_rules(changes):
    # settings_rules.serve_settings_errors reports these (test_settings_rules.py); twice would be noise.
    assert validate_settings(settings(**changes)) == []


def test_missing_required_settings_are_each_named():
    errors = validate_settings({})
    assert "glm53_model is required" in errors and "glm53_master_port is required" in errors
    assert len(errors) == 10


def test_spec_tokens_ignored_without_speculation():
    assert validate_settings(settings(spec_method="none", dflash_tokens=0, draft_model="")) == []


def test_head_count_is_a_parameter():
    assert validate_settings(settings(tensor_parallel_size=2), num_attention_heads=4) == []
    assert validate_settings(settings(tensor_parallel_size=8), num_attention_heads=4) != []


def test_gpu_warnings():
    warnings = settings_warnings(settings(max_num_batched_tokens=8192, kv_cache_dtype="bfloat16"))
    assert len(warnings) == 2
    assert "glm53_max_num_batched_tokens=8192 is above 7168" in warnings[0]
    assert "glm53_kv_cache_dtype=bfloat16" in warnings[1]
    # The recipe's current default chunk.
    assert settings_warnings(settings(max_num_batched_tokens=7168)) == []
    assert settings_warnings(settings(max_num_batched_tokens=8192), gpu=False) == []
    assert settings_warnings(settings(max_num_batched_tokens="junk")) == []


def test_marlin_moe_backend_is_refused_for_exl3():
    for extra in (["--moe-backend", "marlin"], ["--moe-backend=marlin"]):
        errors = validate_settings(settings(extra_serve_args=extra))
        assert any("glm53_extra_serve_args: --moe-backend marlin cannot run EXL3" in e for e in errors), errors
    assert validate_settings(settings(extra_serve_args=["--moe-backend", "marlin"], quantization="")) == []
    assert validate_settings(settings(extra_serve_args=["--moe-backend", "triton"])) == []


def test_triton_attention_for_the_dflash_draft_warns():
    for forced in ({"attention_backend": "TRITON_ATTN"}, {"extra_serve_args": ["--attention-backend=TRITON_ATTN"]}):
        warnings = settings_warnings(settings(spec_method="dflash", **forced))
        assert any("TRITON_ATTN" in w and "acceptance" in w for w in warnings), warnings
    assert not any("TRITON_ATTN" in w for w in settings_warnings(settings(spec_method="none",
                                                                          attention_backend="TRITON_ATTN")))


def test_kv_cache_memory_bytes_is_rendered_next_to_the_utilization_gate():
    kv = settings(gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION, kv_cache_memory_bytes=15032385536)
    for rank in (0, 1):
        argv = render_serve_argv(kv, rank=rank, nnodes=2, master_addr="10.0.0.1")
        assert flag(argv, "--kv-cache-memory-bytes") == "15032385536"
        assert flag(argv, "--gpu-memory-utilization") == str(DEFAULT_GPU_MEMORY_UTILIZATION)
    for unset in (0, "0", None):
        argv = render_serve_argv(settings(kv_cache_memory_bytes=unset), rank=0, nnodes=2, master_addr="10.0.0.1")
        assert "--kv-cache-memory-bytes" not in argv


def test_kv_cache_memory_bytes_together_with_a_changed_utilization_is_refused():
    errors = validate_settings(settings(gpu_memory_utilization=0.9, kv_cache_memory_bytes="11811160064"))
    assert errors == ["glm53_kv_cache_memory_bytes (11811160064) sizes the KV cache, so glm53_gpu_memory_utilization "
                      f"must stay at its default {DEFAULT_GPU_MEMORY_UTILIZATION} (got 0.9): set one of the two"]
    assert validate_settings(settings(gpu_memory_utilization=0.9, kv_cache_memory_bytes=0)) == []


def test_long_prefill_cap_is_rendered_only_when_set() -> None:
    base = settings()
    assert "--long-prefill-token-threshold" not in render_serve_argv(base, rank=0, nnodes=2, master_addr="10.0.0.1")
    argv = render_serve_argv({**base, "long_prefill_token_threshold": 512, "long_prefill_adaptive": True},
                             rank=1, nnodes=2, master_addr="10.0.0.1")
    i = argv.index("--long-prefill-token-threshold")
    # An engine flag: every rank's scheduler view must agree, so the headless rank carries it too.
    assert argv[i + 1] == "512" and "--long-prefill-token-threshold-adaptive" in argv


@pytest.mark.parametrize(("changes", "message"), [
    ({"long_prefill_token_threshold": 4096, "max_model_len": 2048},
     "glm53_long_prefill_token_threshold (4096) must not exceed glm53_max_model_len (2048)"),
    ({"long_prefill_adaptive": True}, "glm53_long_prefill_adaptive needs glm53_long_prefill_token_threshold > 0"),
])
def test_long_prefill_settings_vllm_would_refuse_are_caught_first(changes: dict, message: str) -> None:
    errors = validate_settings(settings(**changes))
    assert any(e.startswith(message) for e in errors), errors


def test_dense_fp8_is_refused_without_a_gpu_or_outside_exl3():
    assert validate_settings(settings(dense_quantization="fp8", gpu=True)) == []
    assert validate_settings(settings(dense_quantization="none", gpu=False)) == []
    errors = validate_settings(settings(dense_quantization="fp8", gpu=False))
    assert any("glm53_dense_quantization fp8 needs a GPU" in e and "glm53_gpu is false" in e for e in errors), errors
    errors = validate_settings(settings(dense_quantization="fp8", gpu=True, quantization=""))
    assert any("glm53_dense_quantization fp8 works through the exl3" in e for e in errors), errors


def test_gb10_block_size_and_kernel_config_are_rendered_when_set():
    argv = render_serve_argv(settings(block_size=2304, kernel_config={"enable_flashinfer_autotune": False,
                                                                      "enable_cutedsl_warmup": False}),
                             rank=1, nnodes=2, master_addr="10.0.0.1")
    assert flag(argv, "--block-size") == "2304"
    assert flag(argv, "--kernel-config") == '{"enable_cutedsl_warmup":false,"enable_flashinfer_autotune":false}'
    plain = render_serve_argv(settings(block_size=0, kernel_config={}), rank=1, nnodes=2, master_addr="10.0.0.1")
    assert "--block-size" not in plain and "--kernel-config" not in plain


@pytest.mark.parametrize(("changes", "message"), [
    ({"max_num_batched_tokens": 8192}, "glm53_max_num_batched_tokens (8192) must be below 8192 on GB10"),
    ({"max_num_batched_tokens": 16384}, "glm53_max_num_batched_tokens (16384) must be below 8192 on GB10"),
    ({"block_size": 2176}, "glm53_block_size (2176) must be a multiple of 256 on GB10"),
    ({"block_size": 64}, "glm53_block_size (64) must be a multiple of 256 on GB10"),
])
def test_gb10_refuses_what_breaks_its_kernels(changes, message):
    errors = validate_settings(settings(gpu=True, **changes))
    assert any(message in e for e in errors), errors
    assert validate_settings(settings(gpu=False, **changes)) == []


def test_gb10_accepts_its_defaults():
    assert validate_settings(settings(gpu=True, max_num_batched_tokens=8191, block_size=2304)) == []
    assert validate_settings(settings(gpu=True, max_num_batched_tokens=7168, block_size=0)) == []
