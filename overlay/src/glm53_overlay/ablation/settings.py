"""The ablation settings, read from the GLM53_ABLATION_* variables that Ansible sets on every rank.

Each variable is the upper-cased name of an Ansible setting (GLM53_ABLATION_LAYERS ↔
`glm53_ablation_layers`); errors name the Ansible setting because that is what an operator edits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

Method = Literal["proj", "transplant"]
METHODS: tuple[Method, ...] = ("proj", "transplant")
# The seed recipe's defaults: layers 0-14 stay untouched as a safety anchor; α=3 over-corrects.
DEFAULT_LAYERS = "15-45"
DEFAULT_ALPHA = 3.0

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class AblationSettingError(ValueError):
    """A bad ablation setting, as the operator would fix it: by its Ansible name."""

    def __init__(self, env_name: str, message: str) -> None:
        self.setting = env_name.lower()
        super().__init__(f"{self.setting}: {message}")


@dataclass(frozen=True)
class AblationSettings:
    enabled: bool
    method: Method = "proj"
    layers: tuple[int, ...] = ()
    alpha: float = DEFAULT_ALPHA
    direction: Path | None = None
    include_mtp: bool = False
    donor_dir: Path | None = None


def parse_layers(text: str, env_name: str = "GLM53_ABLATION_LAYERS") -> tuple[int, ...]:
    """`15-45` or `1,3,5-7` (inclusive) → sorted unique layer indices."""
    layers: set[int] = set()
    for part in text.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise AblationSettingError(env_name, f"{part.strip()!r} in {text!r} is not N or N-M")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise AblationSettingError(env_name, f"range {part.strip()!r} ends before it starts")
        layers.update(range(first, last + 1))
    return tuple(sorted(layers))


def format_layers(layers: tuple[int, ...]) -> str:
    """Inverse of parse_layers, for log lines: (1, 3, 5, 6, 7) → `1,3,5-7`."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "0").strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("0", "false", ""):
        return False
    raise AblationSettingError(name, f"{value!r} is not 0 or 1")


def _path(env: Mapping[str, str], name: str) -> Path | None:
    value = env.get(name, "").strip()
    if value and not Path(value).is_absolute():
        # Relative paths would resolve against vLLM's working directory, which differs per image.
        raise AblationSettingError(name, f"{value!r} must be an absolute path inside the container")
    return Path(value) if value else None


def parse_ablation_settings(env: Mapping[str, str]) -> AblationSettings:
    """Validate the GLM53_ABLATION_* variables; when disabled the others are not read at all."""
    if not _flag(env, "GLM53_ABLATION_ENABLED"):
        return AblationSettings(enabled=False)

    method = env.get("GLM53_ABLATION_METHOD", "proj").strip()
    if method not in METHODS:
        raise AblationSettingError("GLM53_ABLATION_METHOD", f"{method!r} is not one of {', '.join(METHODS)}")

    alpha_text = env.get("GLM53_ABLATION_ALPHA", "").strip() or str(DEFAULT_ALPHA)
    try:
        alpha = float(alpha_text)
    except ValueError:
        raise AblationSettingError("GLM53_ABLATION_ALPHA", f"{alpha_text!r} is not a number") from None
    if not math.isfinite(alpha) or alpha <= 0:
        raise AblationSettingError("GLM53_ABLATION_ALPHA", f"{alpha_text!r} must be a finite number > 0")

    direction = _path(env, "GLM53_ABLATION_DIRECTION")
    donor_dir = _path(env, "GLM53_ABLATION_DONOR_DIR")
    if method == "proj" and direction is None:
        raise AblationSettingError("GLM53_ABLATION_DIRECTION", "required when glm53_ablation_method is proj")
    if method == "transplant" and donor_dir is None:
        raise AblationSettingError("GLM53_ABLATION_DONOR_DIR", "required when glm53_ablation_method is transplant")

    layers_text = env.get("GLM53_ABLATION_LAYERS", "").strip() or DEFAULT_LAYERS
    return AblationSettings(
        enabled=True,
        method=cast(Method, method),
        layers=parse_layers(layers_text),
        alpha=alpha,
        direction=direction,
        include_mtp=_flag(env, "GLM53_ABLATION_INCLUDE_MTP"),
        donor_dir=donor_dir,
    )
