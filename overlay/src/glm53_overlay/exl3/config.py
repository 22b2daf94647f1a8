"""vLLM quantization method "exl3" for exllamav3 checkpoints whose routed experts are EXL3.

Dense linears may be EXL3 too (`Exl3LinearMethod`: decoded once at load; BF16 linears load as usual).
Routed experts arrive as
per-expert `...experts.{e}.{gate,up,down}_proj.{trellis,suh,svh,mcg|mul1}` tensors; vLLM's expert
mapping routes them to the `w13_*` / `w2_*` placeholders registered here. After loading, each
expert is decoded with the exact reference decoder into vLLM's unquantized fused-MoE layout
(w13 [E, 2I, H], w2 [E, H, I]), and vLLM's own unquantized MoE path runs it. This is the CPU /
simulation path; it expands experts to the model dtype.

Imports vLLM at module import: only `glm53_overlay.registration` imports this, inside `register()`.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts, UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from glm53_overlay.exl3.codebook import codebook_from_marker
from glm53_overlay.exl3.reference import dequantize

# Under the "vllm." namespace so the lines appear in vLLM's own log output.
_logger = logging.getLogger(f"vllm.{__name__}")

QUANT_METHOD = "exl3"
EXL3_PARTS = ("trellis", "suh", "svh", "mcg", "mul1")
REQUIRED_PARTS = ("trellis", "suh", "svh")
# exllamav3's kernels need Ampere; vLLM only consults this on CUDA.
MIN_CAPABILITY = 80
# The per-tensor `tensor_storage` ledger of quantization_config.json is ~37 MiB for GLM-5.3 and
# nothing here needs it; only these small keys are kept.
KEPT_KEYS = ("quant_method", "version", "bits", "head_bits", "codebook")


class Exl3Config(QuantizationConfig):
    def __init__(self, settings: dict[str, Any]) -> None:
        super().__init__()
        self.settings = settings

    def __repr__(self) -> str:
        return f"Exl3Config({self.settings})"

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
        return cls({key: config[key] for key in KEPT_KEYS if key in config})

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):
            from glm53_overlay.exl3 import cuda_moe

            if cuda_moe.cuda_moe_supported():
                return cuda_moe.make_moe_method(layer.moe_config)
            return Exl3DequantizedMoEMethod(layer.moe_config)
        if isinstance(layer, LinearBase):
            return Exl3LinearMethod()
        return None


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
            absent = [part for part in REQUIRED_PARTS if part not in parts]
            if absent:
                raise ValueError(f"{layer.prefix or 'linear'} shard {shard_id}: EXL3 tensor lacks {absent}")
            codebook = codebook_from_marker(parts.get("mcg"), parts.get("mul1"))
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


class Exl3DequantizedMoEMethod(UnquantizedFusedMoEMethod):
    """Collects packed experts while loading, then decodes them into unquantized fused-MoE weights."""

    def create_weights(  # type: ignore[override]
        self,
        layer: RoutedExperts,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        # The real w13/w2 are created after loading: vLLM's strict check would otherwise demand
        # them from the checkpoint, which only has the packed tensors.
        self._unquantized_args = (num_experts, hidden_size, intermediate_size_per_partition, params_dtype)
        self._unquantized_attrs = extra_weight_attrs
        self._packed: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for stem in ("w13", "w2"):
            for part in EXL3_PARTS:
                # Empty placeholders: routing targets for the checkpoint names, exempt from the
                # loaded-from-checkpoint check (a checkpoint has at most one codebook marker).
                placeholder = torch.nn.Parameter(torch.empty(0), requires_grad=False)
                placeholder.weight_loader = partial(self._collect_packed, layer)  # type: ignore[attr-defined]
                layer.register_parameter(f"{stem}_{part}", placeholder)

    def _collect_packed(
        self,
        layer: RoutedExperts,
        param: torch.nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> bool | None:
        if layer._map_global_expert_id_to_local_expert_id(expert_id) == -1:
            return False if return_success else None
        part = weight_name.rsplit(".", 1)[-1].split("_", 1)[1]
        self._packed.setdefault((expert_id, shard_id), {})[part] = loaded_weight.detach().clone()
        return True if return_success else None

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:  # type: ignore[override]
        super().create_weights(layer, *self._unquantized_args, **self._unquantized_attrs)
        self._decode_packed_into(layer)
        for stem in ("w13", "w2"):
            for part in EXL3_PARTS:
                delattr(layer, f"{stem}_{part}")
        super().process_weights_after_loading(layer)

    def _decode_packed_into(self, layer: RoutedExperts) -> None:
        moe = layer.moe_config
        hidden = moe.hidden_dim_unpadded or moe.hidden_dim
        expected = {
            (expert, shard)
            for expert in range(moe.num_experts)
            if layer._map_global_expert_id_to_local_expert_id(expert) != -1
            for shard in ("w1", "w3", "w2")
        }
        missing = sorted(expected - self._packed.keys())
        if missing:
            raise ValueError(f"{layer.layer_name}: EXL3 experts missing from the checkpoint: {missing[:8]}")
        for (expert, shard), parts in sorted(self._packed.items()):
            absent = [part for part in REQUIRED_PARTS if part not in parts]
            if absent:
                raise ValueError(f"{layer.layer_name}: expert {expert} {shard} lacks EXL3 {absent}")
            codebook = codebook_from_marker(parts.get("mcg"), parts.get("mul1"))
            w = dequantize(parts["trellis"], parts["suh"], parts["svh"], codebook=codebook)
            # exllamav3 stores [in, out] padded to 128s; vLLM wants [out, in] at the true sizes.
            rows, cols = (hidden, moe.intermediate_size) if shard == "w2" else (moe.intermediate_size, hidden)
            weight = w.t()[:rows, :cols].to(layer.params_dtype)
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            param.weight_loader(param, weight, f"{'w2' if shard == 'w2' else 'w13'}_weight", shard, expert)
        _logger.debug("%s: decoded %d EXL3 expert projections", layer.layer_name, len(self._packed))
        self._packed.clear()
