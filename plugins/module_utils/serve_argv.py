# SPDX-License-Identifier: MIT
"""The one renderer of the `vllm serve` command line for every rank, and the rules between its settings.

Settings are the role variables without their `glm53_` prefix; every message names the variable as the
user wrote it. Values may arrive as strings (`-e glm53_port=8888`), so numbers and booleans are coerced.
What one setting may hold (type, choice, range) is settings_rules' alone, from the argument spec and its
RULES table; settings_rules.serve_settings_errors runs those and the rules here together.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

# The SM12x sparse-MLA backend only has fp8 kernels; anything else fails when the KV cache is built.
_GPU_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_ds_mla")
# 8192 crashes the GB10 indexer (its shared-memory top-k path); the recipe's maintainers run 7168 by default
# at max_num_seqs 4 (its .env: "7168 ... never 8192 (indexer smem)"), so that is the largest value seen working.
_GPU_MAX_BATCHED_TOKENS = 7168
# ... and 8192 or more is refused on GPUs: it crashes the indexer and OOMs the driver at long contexts.
_GPU_BATCHED_TOKENS_LIMIT = 8192
# DeepGEMM's arch-12 fp8 paged MQA logits kernel wants each kpool index page to hold a multiple of 64 entries;
# with GLM-5.3's kpool of 4 the KV block size must be a multiple of 4 x 64 (docs/gb10.md).
_GPU_BLOCK_SIZE_MULTIPLE = 256
# The argument spec's default utilization; module_utils cannot read the spec where it runs, so a unit test
# (test_settings_single_source.py) keeps the two equal.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.85
GPUS_PER_NODE = 1

_REQUIRED = (
    "model", "port", "master_port", "kv_cache_dtype", "max_model_len", "gpu_memory_utilization",
    "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "spec_method",
)
_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})


def var(key: str) -> str:
    return f"glm53_{key}"


def as_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    raise ValueError(f"{value!r} is not an integer")


def as_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return float(value)
    raise ValueError(f"{value!r} is not a number")


def as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{value!r} is not a boolean")


def as_str(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    raise ValueError(f"{value!r} is not a string")


def _opt_bool(settings: Mapping[str, Any], key: str) -> bool | None:
    value = settings.get(key)
    return None if value is None or value == "" else as_bool(value)


def _value(settings: Mapping[str, Any], key: str, convert: Callable[[Any], Any]) -> Any:
    """The converted value, or None when unset or of the wrong type (the setting's own rule reports that)."""
    value = settings.get(key)
    if value is None or value == "":
        return None
    try:
        return convert(value)
    except ValueError:
        return None


def _extra_args(settings: Mapping[str, Any]) -> list[str]:
    """glm53_extra_serve_args when it is a list of argv words; anything else is its own rule's error."""
    extra = settings.get("extra_serve_args")
    return extra if isinstance(extra, list) and all(isinstance(a, str) for a in extra) else []


def validate_settings(settings: Mapping[str, Any], *, num_attention_heads: int = 64) -> list[str]:
    """Every reason the settings cannot start vLLM together, each naming its `glm53_` variable: the settings
    the renderer cannot do without, and the rules between settings. Single values are settings_rules'."""
    errors = [f"{var(k)} is required" for k in _REQUIRED if settings.get(k) in (None, "")]
    port = _value(settings, "port", as_int)
    if port is not None and port == _value(settings, "master_port", as_int):
        errors.append(f"{var('port')} and {var('master_port')} must differ (both are bound on the head)")
    util = _value(settings, "gpu_memory_utilization", as_float)
    kv_bytes = _value(settings, "kv_cache_memory_bytes", as_int)
    if kv_bytes and util is not None and util != DEFAULT_GPU_MEMORY_UTILIZATION:
        # With a KV size vLLM no longer sizes anything from the utilization; it only keeps it as its start-up
        # gate (free >= utilization x total). A changed utilization next to it would limit nothing it seems to.
        errors.append(f"{var('kv_cache_memory_bytes')} ({kv_bytes}) sizes the KV cache, so {var('gpu_memory_utilization')} "
                      f"must stay at its default {DEFAULT_GPU_MEMORY_UTILIZATION} (got {util}): set one of the two")
    seqs = _value(settings, "max_num_seqs", as_int)
    batched = _value(settings, "max_num_batched_tokens", as_int)
    if seqs is not None and batched is not None and batched < seqs:
        errors.append(f"{var('max_num_batched_tokens')} ({batched}) must be >= {var('max_num_seqs')} ({seqs})")
    errors += _long_prefill_errors(settings)
    errors += _gb10_errors(settings)
    # 0 means "one per node" to the role, which resolves it before rendering; the renderer needs the size.
    tp = _value(settings, "tensor_parallel_size", as_int)
    if tp is not None and (not tp or num_attention_heads % tp):
        errors.append(f"{var('tensor_parallel_size')} must be a divisor of the model's {num_attention_heads} "
                      f"attention heads (got {settings['tensor_parallel_size']!r})")

    method = settings.get("spec_method")
    if method in ("dflash", "mtp"):
        tokens = spec_tokens_key(method)
        if settings.get(tokens) in (None, ""):
            errors.append(f"{var(tokens)} is required when {var('spec_method')} is {method}")
    if method == "dflash":
        if not settings.get("draft_model"):
            errors.append(f"the draft checkpoint ({var('draft_repo')}) is required when {var('spec_method')} is dflash")
        # vLLM runs the draft either on one rank or sharded like the target, nothing in between.
        draft_tp = _value(settings, "draft_tensor_parallel_size", as_int)
        if draft_tp is not None and draft_tp not in (1, tp):
            errors.append(f"{var('draft_tensor_parallel_size')} must be 1 or {var('tensor_parallel_size')} "
                          f"(got {settings['draft_tensor_parallel_size']!r})")

    if settings.get("dense_quantization") == "fp8":
        # The overlay's exl3 config applies it, on FP8 tensor cores only; elsewhere it would refuse at load.
        if _value(settings, "gpu", as_bool) is False:
            errors.append(f"{var('dense_quantization')} fp8 needs a GPU with FP8 tensor cores, and {var('gpu')} is "
                          "false (CPU ranks serve BF16): set it to none")
        if settings.get("quantization") != "exl3":
            errors.append(f"{var('dense_quantization')} fp8 works through the exl3 quantization config, and "
                          f"{var('quantization')} is {settings.get('quantization')!r}: set it to none or use exl3")

    if settings.get("quantization") == "exl3" and _option_value(_extra_args(settings), "--moe-backend") == "marlin":
        # Marlin takes over the routed experts and has no EXL3 kernels: the engine dies loading them.
        errors.append(f"{var('extra_serve_args')}: --moe-backend marlin cannot run EXL3 experts "
                      f"({var('quantization')} is exl3); remove it")
    return errors


def _gb10_errors(settings: Mapping[str, Any]) -> list[str]:
    """Values that start on a CPU but break a GB10 rank (glm53_gpu true)."""
    if not _value(settings, "gpu", as_bool):
        return []
    errors: list[str] = []
    batched = _value(settings, "max_num_batched_tokens", as_int)
    if batched is not None and batched >= _GPU_BATCHED_TOKENS_LIMIT:
        errors.append(f"{var('max_num_batched_tokens')} ({batched}) must be below {_GPU_BATCHED_TOKENS_LIMIT} on GB10 "
                      f"(8192 crashes the indexer top-k and OOMs the driver at long contexts); "
                      f"{_GPU_MAX_BATCHED_TOKENS} is the measured default")
    block = _value(settings, "block_size", as_int)
    if block and block % _GPU_BLOCK_SIZE_MULTIPLE:
        errors.append(f"{var('block_size')} ({block}) must be a multiple of {_GPU_BLOCK_SIZE_MULTIPLE} on GB10 "
                      "(kpool 4 x 64 entries per index page for DeepGEMM's fp8 paged MQA), such as 2304, or 0")
    return errors


def _long_prefill_errors(settings: Mapping[str, Any]) -> list[str]:
    """vLLM refuses a cap above the context length at start-up; an adaptive cap without a cap does nothing."""
    errors: list[str] = []
    threshold = _value(settings, "long_prefill_token_threshold", as_int)
    max_len = _value(settings, "max_model_len", as_int)
    if threshold and max_len and threshold > max_len:
        errors.append(f"{var('long_prefill_token_threshold')} ({threshold}) must not exceed "
                      f"{var('max_model_len')} ({max_len})")
    if _value(settings, "long_prefill_adaptive", as_bool) and not threshold:
        errors.append(f"{var('long_prefill_adaptive')} needs {var('long_prefill_token_threshold')} > 0 "
                      "(it only raises that cap)")
    return errors


def _option_value(argv: list[str], option: str) -> str | None:
    """The value of `option` in an argv list (`--opt value` or `--opt=value`), None when absent."""
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def settings_warnings(settings: Mapping[str, Any], *, gpu: bool = True) -> list[str]:
    """Settings that start but are known to fail or hurt later; empty off the GPU."""
    if not gpu:
        return []
    warnings: list[str] = []
    batched = _value(settings, "max_num_batched_tokens", as_int)
    if batched is not None and batched > _GPU_MAX_BATCHED_TOKENS:
        warnings.append(f"{var('max_num_batched_tokens')}={batched} is above {_GPU_MAX_BATCHED_TOKENS}; "
                        "8192 is known to crash the engine on GB10")
    kv = settings.get("kv_cache_dtype")
    if kv and kv not in _GPU_KV_CACHE_DTYPES:
        warnings.append(f"{var('kv_cache_dtype')}={kv}: the SM12x sparse-MLA backend has fp8 kernels only")
    forced = [settings.get("attention_backend"), _option_value(_extra_args(settings), "--attention-backend")]
    if settings.get("spec_method") == "dflash" and "TRITON_ATTN" in forced:
        warnings.append(f"{var('attention_backend')}/{var('extra_serve_args')} force TRITON_ATTN, which the DFlash2 "
                        "draft then uses too: its non-causal block attention is lost and acceptance collapses")
    return warnings


def _compact_json(value: Mapping[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def spec_tokens_key(method: str) -> str:
    """The recipe keeps one token count per method (DFLASH_TOKENS, MTP_TOKENS)."""
    return "dflash_tokens" if method == "dflash" else "mtp_tokens"


def speculative_config(settings: Mapping[str, Any]) -> dict[str, Any] | None:
    method = settings.get("spec_method")
    if method == "dflash":
        return {
            "method": "dflash",
            "model": as_str(settings["draft_model"]),
            "num_speculative_tokens": as_int(settings["dflash_tokens"]),
            "draft_tensor_parallel_size": as_int(settings.get("draft_tensor_parallel_size", 1)),
        }
    if method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": as_int(settings["mtp_tokens"])}
    return None


def _engine_args(s: Mapping[str, Any]) -> list[str]:
    """Flags that shape the model, memory and scheduler: identical on every rank or ranks disagree."""
    argv = [as_str(s["model"])]
    if _opt_bool(s, "trust_remote_code"):
        argv.append("--trust-remote-code")
    for key in ("dtype", "quantization"):
        if as_str(s.get(key)):
            argv += ["--" + key, as_str(s[key])]
    argv += [
        "--kv-cache-dtype", as_str(s["kv_cache_dtype"]),
        "--max-model-len", str(as_int(s["max_model_len"])),
        "--gpu-memory-utilization", str(as_float(s["gpu_memory_utilization"])),
    ]
    # The utilization stays on the line even then: vLLM still uses it as its start-up gate.
    if as_int(s.get("kv_cache_memory_bytes") or 0) > 0:
        argv += ["--kv-cache-memory-bytes", str(as_int(s["kv_cache_memory_bytes"]))]
    argv += [
        "--max-num-seqs", str(as_int(s["max_num_seqs"])),
        "--max-num-batched-tokens", str(as_int(s["max_num_batched_tokens"])),
    ]
    if as_int(s.get("block_size") or 0) > 0:
        argv += ["--block-size", str(as_int(s["block_size"]))]
    if s.get("kernel_config"):
        argv += ["--kernel-config", _compact_json(s["kernel_config"])]
    threshold = as_int(s.get("long_prefill_token_threshold") or 0)
    if threshold > 0:
        argv += ["--long-prefill-token-threshold", str(threshold)]
        if _opt_bool(s, "long_prefill_adaptive"):
            argv.append("--long-prefill-token-threshold-adaptive")
    # vLLM enables prefix caching by default, so false must be said out loud.
    prefix = _opt_bool(s, "enable_prefix_caching")
    if prefix is not None:
        argv.append("--enable-prefix-caching" if prefix else "--no-enable-prefix-caching")
    if _opt_bool(s, "skip_mm_profiling"):
        argv.append("--skip-mm-profiling")
    # An empty mapping means a text-only model: vLLM rejects limits for modalities it does not have.
    if s.get("limit_mm"):
        argv += ["--limit-mm-per-prompt", _compact_json(s["limit_mm"])]
    if as_str(s.get("attention_backend")):
        argv += ["--attention-backend", as_str(s["attention_backend"])]
    if _opt_bool(s, "enforce_eager"):
        argv.append("--enforce-eager")
    spec = speculative_config(s)
    if spec is not None:
        argv += ["--speculative-config", _compact_json(spec)]
    return argv


def _api_args(s: Mapping[str, Any]) -> list[str]:
    """Flags only the head's API server reads; a headless rank has no API server."""
    argv = ["--port", str(as_int(s["port"]))]
    if as_str(s.get("api_bind")):
        argv += ["--host", as_str(s["api_bind"])]
    if as_str(s.get("served_model_name")):
        argv += ["--served-model-name", as_str(s["served_model_name"])]
    if as_str(s.get("tool_call_parser")):
        argv += ["--tool-call-parser", as_str(s["tool_call_parser"]), "--enable-auto-tool-choice"]
    if as_str(s.get("reasoning_parser")):
        argv += ["--reasoning-parser", as_str(s["reasoning_parser"])]
    return argv


def topology_errors(settings: Mapping[str, Any], *, rank: int, nnodes: int, master_addr: str) -> list[str]:
    errors: list[str] = []
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        return [f"the number of nodes must be an integer >= 1 (got {nnodes!r})"]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < nnodes:
        errors.append(f"node rank {rank!r} is outside 0..{nnodes - 1} for {nnodes} nodes")
    if not master_addr:
        errors.append("the head's fabric address (master_addr) is empty")
    try:
        tp = as_int(settings.get("tensor_parallel_size"))
        pp = as_int(settings.get("pipeline_parallel_size", 1))
    except ValueError:
        return errors  # reported by the sizes' own rules
    if tp * pp != nnodes * GPUS_PER_NODE:
        errors.append(f"{var('tensor_parallel_size')} ({tp}) x {var('pipeline_parallel_size')} ({pp}) must equal "
                      f"the number of GPUs, {nnodes} nodes x {GPUS_PER_NODE} GPU per Spark")
    return errors


def render_serve_argv(settings: Mapping[str, Any], *, rank: int, nnodes: int, master_addr: str,
                      num_attention_heads: int = 64) -> list[str]:
    """argv after the `vllm` executable for node `rank`; raises ValueError listing every broken rule between
    settings and every topology error (the settings' own rules are settings_rules.serve_settings_errors')."""
    errors = validate_settings(settings, num_attention_heads=num_attention_heads)
    errors += topology_errors(settings, rank=rank, nnodes=nnodes, master_addr=master_addr)
    if errors:
        raise ValueError("; ".join(errors))
    pp = as_int(settings.get("pipeline_parallel_size", 1))
    argv = ["serve"] + _engine_args(settings)
    argv += ["--tensor-parallel-size", str(as_int(settings["tensor_parallel_size"]))]
    if pp > 1:
        argv += ["--pipeline-parallel-size", str(pp)]
    argv += [
        "--distributed-executor-backend", "mp",
        "--nnodes", str(nnodes),
        "--node-rank", str(rank),
        "--master-addr", master_addr,
        "--master-port", str(as_int(settings["master_port"])),
    ]
    argv += ["--headless"] if rank >= 1 else _api_args(settings)
    return argv + list(settings.get("extra_serve_args") or [])
