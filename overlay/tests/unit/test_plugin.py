"""The plugin as vLLM sees it: entry point, idempotent register(), the self-check CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from glm53_overlay.selfcheck import check_entry_point

import vllm


def test_entry_point_is_installed() -> None:
    ok, detail = check_entry_point()
    assert ok, detail


def test_register_is_idempotent_and_registers_exl3() -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from glm53_overlay import register

    first = register()
    assert register() is first
    # ablation registers only when enabled; the spec glue lists the pieces this vLLM lacks
    assert first[:2] == ["quantization:exl3", "nope-mla:pad"]
    assert first[2].startswith("spec:glm-aux-hidden-states+dflash-draft-defaults")
    assert len(first) == 3
    assert QUANTIZATION_METHODS.count("exl3") == 1
    assert get_quantization_config("exl3").__name__ == "Exl3Config"


def test_exl3_config_keeps_only_small_settings() -> None:
    from glm53_overlay.exl3.config import Exl3Config

    ledger = {f"model.layers.{i}.mlp.experts.0.gate_proj": {"quant_format": "exl3"} for i in range(100)}
    config = Exl3Config.from_config({"quant_method": "exl3", "bits": 4.0, "codebook": "mcg", "tensor_storage": ledger})
    assert config.settings == {"quant_method": "exl3", "bits": 4.0, "codebook": "mcg"}
    assert config.get_name() == "exl3"
    with pytest.raises(ValueError, match="quant_method"):
        Exl3Config.from_config({"quant_method": "gptq"})


def test_selfcheck_cli_prints_json_and_exits_zero() -> None:
    env = dict(os.environ, VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"))
    done = subprocess.run(
        [sys.executable, "-m", "glm53_overlay.cli", "selfcheck"], capture_output=True, text=True, env=env, timeout=120
    )
    report = json.loads(done.stdout)
    assert done.returncode == 0, (report, done.stderr[-2000:])
    assert report["ok"] is True
    assert [check["name"] for check in report["checks"]] == [
        "entry_point",
        "vllm_importable",
        "exl3_quantization_registered",
        "exl3_reference_vectors",
        "exl3_cuda_kernels",
        "exl3_gemm_k4_mcg",
        "exl3_moe_apply",
        "exl3_moe_cuda_graph",
        "gb10_image_pins",
        "sm12x_pdl_sm9x_10x_only",
        "sm12x_indexer_topk_per_row",
        "sm12x_sm120_no_dense_mha_prefill",
        "sm12x_kpool_topk_buffer_width",
        "sm12x_kpool_tail_slot_clamp",
    ]
    # Without a GPU the kernel checks and the GPU image's pins report themselves skipped, never silently passed;
    # the GB10 fixes say why they are not needed here.
    assert [check["skipped"] for check in report["checks"]] == [False] * 4 + [True] * 5 + [False] * 5
    assert all(check["detail"].startswith("not needed: no CUDA device") for check in report["checks"][9:])
    assert report["versions"]["vllm"]
    assert {"nvidia-nccl-cu13", "flashinfer-python", "nvidia-cutlass-dsl"} <= set(report["versions"])
