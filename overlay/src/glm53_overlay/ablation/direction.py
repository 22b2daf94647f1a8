"""The refusal direction file: torch.save({"directions": tensor[H] or [1, H]})."""

from __future__ import annotations

from pathlib import Path

import torch

from glm53_overlay.ablation.settings import AblationSettingError

_SETTING = "GLM53_ABLATION_DIRECTION"
DIRECTION_KEY = "directions"


def load_direction(path: Path, hidden_size: int) -> torch.Tensor:
    """The direction as fp32 [hidden_size]; any doubt about the file is an error, never a fallback."""
    if not path.is_file():
        raise AblationSettingError(_SETTING, f"{path} does not exist in this container")
    try:
        # weights_only: the file comes from outside the image and must not be able to run code.
        content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several unrelated types for unreadable files
        raise AblationSettingError(_SETTING, f"{path} is not a readable torch file: {exc}") from exc
    if not isinstance(content, dict) or DIRECTION_KEY not in content:
        keys = sorted(map(str, content)) if isinstance(content, dict) else type(content).__name__
        raise AblationSettingError(_SETTING, f"{path} has no {DIRECTION_KEY!r} key (found {keys})")
    direction = content[DIRECTION_KEY]
    if not isinstance(direction, torch.Tensor):
        raise AblationSettingError(_SETTING, f"{path}: {DIRECTION_KEY!r} is a {type(direction).__name__}")
    if direction.ndim == 2 and direction.shape[0] == 1:
        direction = direction[0]
    if direction.ndim != 1 or direction.numel() != hidden_size:
        raise AblationSettingError(
            _SETTING, f"{path}: direction shape {tuple(direction.shape)} does not match hidden size {hidden_size}"
        )
    direction = direction.to(torch.float32)
    if not bool(torch.isfinite(direction).all()) or float(direction.norm()) == 0.0:
        raise AblationSettingError(_SETTING, f"{path}: direction norm is zero or not finite")
    return direction
