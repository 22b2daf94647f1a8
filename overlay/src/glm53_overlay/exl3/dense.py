"""`glm53_dense_quantization`: what the BF16 (non-EXL3) linears run as, read from GLM53_DENSE_QUANTIZATION.

`none` serves them in BF16 as the checkpoint stores them. `fp8` gives them vLLM's online FP8 method (weights
quantized per tensor at load, activations per token at run time), which needs FP8 tensor cores (compute
capability 8.9 or newer); anything else refuses at load instead of serving BF16 under an fp8 setting.
Measured in overlay/benchmarks/results/dense/ (overlay/README.md, "Dense FP8").

vLLM-free: `Exl3Config` (config.py) applies these rules.
"""

from __future__ import annotations

from collections.abc import Mapping

ENV = "GLM53_DENSE_QUANTIZATION"
SETTING = "glm53_dense_quantization"
CHOICES = ("none", "fp8")
# FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell incl. GB10 (12.1).
MIN_FP8_CAPABILITY = (8, 9)
# Linears that stay BF16 under fp8, by the last part of their vLLM prefix:
# - `gate`: the MoE router; its logits pick the experts, and at 4096 x 288 it is 0.1 GB per step.
# - `kv_b_proj`: MLA decode absorbs it into W_UK / W_UV, which vLLM keeps in BF16 whatever its method.
# - `wk_weights_proj`: the DSA indexer's fused key/weights projection; vLLM builds it unquantized anyway.
KEPT_BF16 = ("gate", "kv_b_proj", "wk_weights_proj")
# The vision tower runs once per image, not per decoded token: no decode gain for its accuracy risk.
KEPT_BF16_TOWERS = ("visual.", "vision_tower.", "vision_model.")


class DenseQuantizationError(ValueError):
    """A glm53_dense_quantization value that cannot be served, named as the operator sets it."""


def parse_dense_quantization(environ: Mapping[str, str]) -> str:
    """The setting from the rank's environment; unset or empty means `none`."""
    value = environ.get(ENV, "").strip()
    if value == "":
        return "none"
    if value not in CHOICES:
        raise DenseQuantizationError(f"{SETTING}: {value!r} is not one of {', '.join(CHOICES)} ({ENV})")
    return value


def check_supported(mode: str, capability: tuple[int, int] | None) -> None:
    """Refuse fp8 where no FP8 tensor cores exist (`capability` None: not a CUDA device)."""
    if mode != "fp8":
        return
    if capability is None:
        raise DenseQuantizationError(
            f"{SETTING} is fp8, but this rank has no CUDA GPU (FP8 linears need compute capability "
            f"{MIN_FP8_CAPABILITY[0]}.{MIN_FP8_CAPABILITY[1]}+); set it to none")
    if tuple(capability) < MIN_FP8_CAPABILITY:
        raise DenseQuantizationError(
            f"{SETTING} is fp8, but this GPU is compute capability {capability[0]}.{capability[1]} "
            f"(FP8 linears need {MIN_FP8_CAPABILITY[0]}.{MIN_FP8_CAPABILITY[1]}+); set it to none")


def stays_bf16(prefix: str) -> bool:
    """Whether the linear at this vLLM prefix keeps BF16 under fp8 (see KEPT_BF16)."""
    if any(f".{tower}" in f".{prefix}" for tower in KEPT_BF16_TOWERS):
        return True
    return prefix.rsplit(".", 1)[-1] in KEPT_BF16
