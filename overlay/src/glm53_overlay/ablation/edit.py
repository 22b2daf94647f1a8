"""Apply the ablation to a loaded model's o_proj weights in place; knows module names, not vLLM."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from glm53_overlay.ablation.direction import load_direction
from glm53_overlay.ablation.donor import load_donor_shard, read_manifest
from glm53_overlay.ablation.projection import direction_residual, project_out
from glm53_overlay.ablation.settings import AblationSettingError, AblationSettings, format_layers

# Target layers are `model.layers.N.self_attn.o_proj`; vLLM's GLM/DeepSeek MTP draft nests the same
# block as `model.layers.N.mtp_block.self_attn.o_proj` with N counting on from num_hidden_layers.
_O_PROJ_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mtp_block\.)?self_attn\.o_proj$")


@dataclass(frozen=True)
class AblationResult:
    model: str  # "target" or "mtp"
    method: str
    layers: tuple[int, ...]
    alpha: float | None
    residual_max: float | None

    def log_line(self, rank: int) -> str:
        alpha = f" alpha={self.alpha}" if self.alpha is not None else ""
        residual = f"{self.residual_max:.1e}" if self.residual_max is not None else "n/a"
        return (
            f"glm53-ablation: rank={rank} model={self.model} method={self.method} "
            f"layers={format_layers(self.layers)} ({len(self.layers)} edited){alpha} residual_max={residual}"
        )


def find_o_projs(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer index → o_proj module, for the layers this rank holds (pipeline stages hold a subset)."""
    found: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        match = _O_PROJ_NAME.search(name)
        if match is not None:
            found[int(match.group(1))] = module
    return found


def _plain_weight(layer: int, module: torch.nn.Module, hidden_size: int) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    # A quantized o_proj keeps packed integers under other names; editing those would corrupt it.
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.ndim != 2:
        raise AblationSettingError(
            "GLM53_ABLATION_LAYERS", f"layer {layer} o_proj has no plain floating-point weight to edit"
        )
    if weight.shape[0] != hidden_size:
        raise AblationSettingError(
            "GLM53_ABLATION_LAYERS", f"layer {layer} o_proj weight {tuple(weight.shape)} does not output {hidden_size}"
        )
    return weight


def ablate_model(
    model: torch.nn.Module, settings: AblationSettings, *, role: str, hidden_size: int, num_hidden_layers: int,
) -> AblationResult:
    """Edit the selected o_proj weights of `model` (role "target" or "mtp") and report what changed.

    The target takes glm53_ablation_layers, which must lie inside the model; the MTP draft, when
    included, takes every MTP block it holds (they sit past num_hidden_layers, outside that range).
    """
    o_projs = find_o_projs(model)
    if role == "target":
        outside = [layer for layer in settings.layers if layer >= num_hidden_layers]
        if outside:
            raise AblationSettingError(
                "GLM53_ABLATION_LAYERS",
                f"layers {format_layers(tuple(outside))} are outside the model's 0-{num_hidden_layers - 1}",
            )
        selected = {layer: o_projs[layer] for layer in settings.layers if layer in o_projs}
    else:
        selected = {layer: module for layer, module in o_projs.items() if layer >= num_hidden_layers}
    if not selected:
        raise AblationSettingError(
            "GLM53_ABLATION_LAYERS",
            f"ablation is enabled but edits nothing in the {role} model "
            f"(wanted {format_layers(settings.layers)}, it has o_proj in {format_layers(tuple(sorted(o_projs)))})",
        )

    direction = load_direction(settings.direction, hidden_size) if settings.direction is not None else None
    manifest = read_manifest(_donor_dir(settings)) if settings.method == "transplant" else None
    residuals: list[float] = []
    with torch.no_grad():
        for layer, module in sorted(selected.items()):
            weight = _plain_weight(layer, module, hidden_size)
            if manifest is not None:
                edited = load_donor_shard(
                    _donor_dir(settings), manifest, layer, (weight.shape[0], weight.shape[1]),
                    int(getattr(module, "tp_rank", 0)), int(getattr(module, "tp_size", 1)), weight.dtype,
                ).to(weight.device)
            else:
                assert direction is not None  # settings require a direction for method proj
                edited = project_out(weight, direction, settings.alpha)
            weight.copy_(edited)
            if direction is not None:
                residuals.append(direction_residual(weight, direction))
    return AblationResult(
        model=role,
        method=settings.method,
        layers=tuple(sorted(selected)),
        alpha=settings.alpha if settings.method == "proj" else None,
        residual_max=max(residuals) if residuals else None,
    )


def _donor_dir(settings: AblationSettings) -> Path:
    assert settings.donor_dir is not None  # settings require a donor dir for method transplant
    return settings.donor_dir
