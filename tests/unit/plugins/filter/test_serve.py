# SPDX-License-Identifier: MIT
"""The serve filters refuse a value its own rule refuses: the rank render and bench.yml call vllm_serve_argv
without the preflight's settings_errors (`--skip-tags preflight`), so the filter runs that check itself."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible_collections.sparkops.glm53.plugins.filter.serve import vllm_serve_argv, vllm_settings_check

DEFAULTS = yaml.safe_load((Path(__file__).resolve().parents[4] / "roles/glm53/defaults/main.yml").read_text())
SERVE = {**{name.removeprefix("glm53_"): value for name, value in DEFAULTS.items()},
         "model": "/checkpoint", "draft_model": "/draft", "tensor_parallel_size": 2}


def serve(**changes: Any) -> dict[str, Any]:
    return {**SERVE, **changes}


def test_the_shipped_settings_render_on_both_ranks() -> None:
    assert vllm_serve_argv(serve(), 0, 2, "10.0.0.1")[:2] == ["serve", "/checkpoint"]
    assert vllm_serve_argv(serve(), 1, 2, "10.0.0.1")[-1] == "--headless"


def test_the_rank_command_is_refused_for_a_value_only_its_own_rule_refuses() -> None:
    with pytest.raises(AnsibleFilterError) as err:
        vllm_serve_argv(serve(max_model_len=0, container_prefix="a b", master_port=8888), 0, 2, "10.0.0.1")
    message = str(err.value)
    assert message.startswith("vllm_serve_argv: ")
    for expected in ("glm53_max_model_len must be >= 1 (got 0)", "glm53_container_prefix must be a docker container",
                     "glm53_port and glm53_master_port must differ"):
        assert expected in message, message


def test_the_settings_check_reports_own_rules_rules_between_settings_and_topology_once_each() -> None:
    result = vllm_settings_check(serve(gpu_memory_utilization="1.5", tensor_parallel_size="3"), nnodes=2)
    assert result["errors"] == [
        "glm53_gpu_memory_utilization must be in (0, 1] (got '1.5')",
        "glm53_tensor_parallel_size must be a divisor of the model's 64 attention heads (got '3')",
        "glm53_tensor_parallel_size (3) x glm53_pipeline_parallel_size (1) must equal the number of GPUs, "
        "2 nodes x 1 GPU per Spark",
    ]
    assert result["warnings"] == []
