"""vLLM quantization method "exl3" for exllamav3 checkpoints whose routed experts are EXL3.

`Exl3Config` picks each layer's method: routed experts get a fused-MoE method from `moe.py` (the CUDA
one where `runtime.cuda_moe_supported()`, else the exact CPU one); linears get `Exl3LinearMethod` here,
which serves BF16 linears as usual and decodes EXL3 ones once at load, or, with
`glm53_dense_quantization` fp8 (`dense.py`), vLLM's online FP8 method, except the few `dense.KEPT_BF16`.

Layering (no cycle; tests/unit/test_structure.py checks it): config -> moe -> runtime -> packing, and
codebook / trellis / hadamard / reference below them. vLLM is imported at module import: only
`glm53_overlay.registration` imports this, inside `register()`.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.platforms import current_platform

from glm53_overlay.exl3 import dense
from glm53_overlay.exl3.moe import Exl3CudaMoEMethod, Exl3DequantizedMoEMethod
from glm53_overlay.exl3.packing import EXL3_PARTS, codebook_of
from glm53_overlay.exl3.reference import dequantize
from glm53_overlay.exl3 import runtime

# Under the "vllm." namespace so the lines appear in vLLM's own log output.
_logger = logging.getLogger(f"vllm.{__name__}")

QUANT_METHOD = "exl3"
# exllamav3's kernels need Ampere; vLLM only consults this on CUDA.
MIN_CAPABILITY = 80
# The per-tensor `tensor_storage` ledger of quantization_config.json is ~37 MiB for GLM-5.3 and
# nothing here needs it; only these small keys are kept.
KEPT_KEYS = ("quant_method", "version", "bits", "head_bits", "codebook")


class Exl3Config(QuantizationConfig):
    def __init__(self, settings: dict[str, Any], dense_quantization: str = "none") -> None:
        super().__init__()
        self.settings = settings
        self.dense_quantization = dense_quantization

    def __repr__(self) -> str:
        return f"Exl3Config({self.settings}, dense_quantization={self.dense_quantization!r})"

    def get_name(self) -> str:  # type: ignore[override]
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quantization_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Exl3Config:
        if config.get("quant_method") != QUANT_METHOD:
            raise ValueError(f"not an EXL3 quantization_config: quant_method={config.get('quant_method')!r}")
        # vLLM builds the config while loading the model: a bad or unservable setting stops the load here.
        mode = dense.parse_dense_quantization(os.environ)
        dense.check_supported(mode, _device_capability())
        if mode != "none":
            _logger.info("glm53_overlay: %s=%s, BF16 linears get vLLM's online FP8 method", dense.SETTING, mode)
        return cls({key: config[key] for key in KEPT_KEYS if key in config}, dense_quantization=mode)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):
            if runtime.cuda_moe_supported():
                return Exl3CudaMoEMethod(layer.moe_config)
            return Exl3DequantizedMoEMethod(layer.moe_config)
        if isinstance(layer, LinearBase):
            if self.dense_quantization == "fp8" and not dense.stays_bf16(prefix):
                return _fp8_linear_method()
            return Exl3LinearMethod()
        return None


def _device_capability() -> tuple[int, int] | None:
    if not current_platform.is_cuda():
        return None
    capability = current_platform.get_device_capability()
    return None if capability is None else (capability.major, capability.minor)


def _fp8_linear_method() -> QuantizeMethodBase:
    # vLLM's own `--quantization fp8_per_tensor` method: BF16 weights quantized per tensor at load, activations
    # quantized per token at run time (cutlass; per tensor without it). It loads BF16 tensors only: a checkpoint
    # whose dense linears are EXL3 (not GLM-5.3 Flash) cannot use it.
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PerTensorOnlineLinearMethod

    return Fp8PerTensorOnlineLinearMethod()


# Unpadded [out, in] of one checkpoint tensor feeding a (possibly merged) linear.
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


def _full_shape(layer: LinearBase, shard_id: int | str | None) -> tuple[int, int]:
    if shard_id is None:
        return layer.output_size, layer.input_size
    index = _QKV_SHARDS[shard_id] if isinstance(shard_id, str) else shard_id
    return layer.output_sizes[index], layer.input_size  # type: ignore[attr-defined]


class Exl3LinearMethod(UnquantizedLinearMethod):
    """A linear that loads either BF16 `weight` or packed EXL3 parts (per merged shard) and serves BF16.

    EXL3 parts are decoded once after loading and fed through the layer's own weight loader, which
    applies tensor-parallel slicing and merged-shard placement exactly as for a BF16 checkpoint.
    GLM-5.3 Flash keeps its dense layers BF16, so this path costs nothing there; checkpoints that
    quantize attention or shared experts get correct output at BF16 memory for those layers.
    """

    def create_weights(  # type: ignore[override]
        self, layer: LinearBase, *args: Any, **extra_weight_attrs: Any
    ) -> None:
        super().create_weights(layer, *args, **extra_weight_attrs)
        self._packed: dict[int | str | None, dict[str, torch.Tensor]] = {}
        for part in EXL3_PARTS:
            placeholder = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            placeholder.weight_loader = partial(self._collect_packed, part)  # type: ignore[attr-defined]
            layer.register_parameter(part, placeholder)

    def _collect_packed(
        self, part: str, param: torch.nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        self._packed.setdefault(shard_id, {})[part] = loaded_weight.detach().clone()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        for part in EXL3_PARTS:
            delattr(layer, part)
        for shard_id, parts in sorted(self._packed.items(), key=lambda item: str(item[0])):
            codebook = codebook_of(parts, f"{layer.prefix or 'linear'} shard {shard_id}")
            device = layer.weight.device
            w = dequantize(parts["trellis"].to(device), parts["suh"].to(device), parts["svh"].to(device),
                           codebook=codebook)
            rows, cols = _full_shape(layer, shard_id)
            weight = w.t()[:rows, :cols].to(layer.weight.dtype)
            loader_args = () if shard_id is None else (shard_id,)
            layer.weight.weight_loader(layer.weight, weight, *loader_args)
        if self._packed:
            _logger.debug("%s: decoded %d EXL3 shard(s) to %s", layer.prefix, len(self._packed), layer.weight.dtype)
        self._packed.clear()
        super().process_weights_after_loading(layer)
