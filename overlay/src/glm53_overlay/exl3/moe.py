"""vLLM fused-MoE methods for EXL3 routed experts: both load the same way and share one validation.

Routed experts arrive as per-expert `...experts.{e}.{gate,up,down}_proj.{trellis,suh,svh,mcg|mul1}`
tensors; vLLM's expert mapping routes them to the `w13_*` / `w2_*` placeholders registered here and the
method collects them. After loading:

- `Exl3DequantizedMoEMethod` (CPU / simulation): decodes each expert with the exact reference decoder into
  vLLM's unquantized fused-MoE layout (w13 [E, 2I, H], w2 [E, H, I]) and vLLM's own unquantized MoE path
  runs it; experts cost model-dtype memory.
- `Exl3CudaMoEMethod` (CUDA): keeps the experts packed, this rank's tensor-parallel slice of each stacked
  per projection (`runtime.experts_from_packed`), and `apply` runs them through the kernels `runtime`
  binds.

Imports vLLM at module import: only `config` imports this, and only `registration.register()` imports that.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts, UnquantizedFusedMoEMethod

from glm53_overlay.exl3.codebook import Codebook
from glm53_overlay.exl3.packing import EXL3_PARTS, codebook_of
from glm53_overlay.exl3.reference import dequantize
from glm53_overlay.exl3.runtime import Exl3CudaExperts, experts_from_packed

# Under the "vllm." namespace so the lines appear in vLLM's own log output.
_logger = logging.getLogger(f"vllm.{__name__}")

SHARDS = ("w1", "w3", "w2")
PackedKey = tuple[int, str]


class Exl3MoEMethodBase(UnquantizedFusedMoEMethod):
    """Collects packed experts while loading; `checked_codebooks` is the one check both methods run."""

    def create_weights(  # type: ignore[override]
        self,
        layer: RoutedExperts,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        # The real w13/w2 are created after loading (CPU method): vLLM's strict check would otherwise
        # demand them from the checkpoint, which only has the packed tensors.
        self._unquantized_args = (num_experts, hidden_size, intermediate_size_per_partition, params_dtype)
        self._unquantized_attrs = extra_weight_attrs
        self._packed: dict[PackedKey, dict[str, torch.Tensor]] = {}
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

    @staticmethod
    def local_experts(layer: RoutedExperts) -> list[int]:
        return [e for e in range(layer.moe_config.num_experts) if layer._map_global_expert_id_to_local_expert_id(e) != -1]

    def checked_codebooks(self, layer: RoutedExperts) -> dict[PackedKey, Codebook]:
        """Every local expert's three projections are present and complete; their codebooks."""
        expected = {(expert, shard) for expert in self.local_experts(layer) for shard in SHARDS}
        missing = sorted(expected - self._packed.keys())
        if missing:
            raise ValueError(f"{layer.layer_name}: EXL3 experts missing from the checkpoint: {missing[:8]}")
        return {key: codebook_of(parts, f"{layer.layer_name}: expert {key[0]} {key[1]}")
                for key, parts in sorted(self._packed.items())}

    def drop_placeholders(self, layer: RoutedExperts) -> None:
        self._packed.clear()
        for stem in ("w13", "w2"):
            for part in EXL3_PARTS:
                delattr(layer, f"{stem}_{part}")


class Exl3DequantizedMoEMethod(Exl3MoEMethodBase):
    """Decodes the packed experts into unquantized fused-MoE weights; vLLM's unquantized path runs them."""

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:  # type: ignore[override]
        codebooks = self.checked_codebooks(layer)
        # vLLM's own w13/w2 now (the base class's create_weights registers only the placeholders).
        UnquantizedFusedMoEMethod.create_weights(self, layer, *self._unquantized_args, **self._unquantized_attrs)
        moe = layer.moe_config
        hidden = moe.hidden_dim_unpadded or moe.hidden_dim
        for (expert, shard), parts in sorted(self._packed.items()):
            w = dequantize(parts["trellis"], parts["suh"], parts["svh"], codebook=codebooks[(expert, shard)])
            # exllamav3 stores [in, out] padded to 128s; vLLM wants [out, in] at the true sizes.
            rows, cols = (hidden, moe.intermediate_size) if shard == "w2" else (moe.intermediate_size, hidden)
            weight = w.t()[:rows, :cols].to(layer.params_dtype)
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            param.weight_loader(param, weight, f"{'w2' if shard == 'w2' else 'w13'}_weight", shard, expert)
        _logger.debug("%s: decoded %d EXL3 expert projections", layer.layer_name, len(self._packed))
        self.drop_placeholders(layer)
        super().process_weights_after_loading(layer)


class Exl3CudaMoEMethod(Exl3MoEMethodBase):
    """Keeps the experts packed (this rank's slice) and runs them through the kernels `runtime` binds."""

    experts: Exl3CudaExperts

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:  # type: ignore[override]
        if getattr(layer, "expert_map", None) is not None:
            raise NotImplementedError("EXL3 CUDA MoE: expert parallelism is not supported; use TP")
        codebooks = set(self.checked_codebooks(layer).values())
        if len(codebooks) != 1:
            raise ValueError(f"{layer.layer_name}: experts mix EXL3 codebooks {sorted(codebooks)}")
        moe = layer.moe_config
        self.experts = experts_from_packed(
            self._packed,
            self.local_experts(layer),
            codebook=codebooks.pop(),
            top_k=moe.experts_per_token,
            tp_rank=moe.tp_rank,
            tp_size=moe.tp_size,
            intermediate_per_rank=self._unquantized_args[2],
            # The placeholders were made under the model loader's device context: the rank's device.
            device=layer.w13_trellis.device,
            act_limit=float(getattr(layer, "swiglu_limit", None) or 0.0),
        )
        self.drop_placeholders(layer)

    def get_fused_moe_quant_config(self, layer: RoutedExperts) -> None:  # type: ignore[override]
        return None

    @property
    def is_monolithic(self) -> bool:
        # vLLM's runner routes first and calls `apply` only for non-monolithic methods; the unquantized base
        # would answer from the backend it picked for BF16 experts (a monolithic one on some GPUs).
        return False

    def apply(  # type: ignore[override]
        self,
        layer: RoutedExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: torch.nn.Module | None = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Shared experts are run by vLLM's MoE runner, not by the quant method.
        return self.experts.apply(x, topk_ids, topk_weights)
