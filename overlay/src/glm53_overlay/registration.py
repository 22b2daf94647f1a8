"""What `register()` installs into vLLM, each piece guarded so a missing vLLM feature only skips it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from glm53_overlay.vllm_compat import MIN_VLLM, find_vllm

# Under the "vllm." namespace so the lines appear in vLLM's own log output.
_logger = logging.getLogger(f"vllm.{__name__}")


def register_exl3_quantization() -> str | None:
    try:
        from vllm.model_executor.layers.quantization import register_quantization_config

        from glm53_overlay.exl3.config import QUANT_METHOD, Exl3Config
    except ImportError as exc:
        _logger.warning("glm53_overlay: exl3 quantization not registered, this vLLM lacks %s", exc)
        return None
    register_quantization_config(QUANT_METHOD)(Exl3Config)
    return f"quantization:{QUANT_METHOD}"


def register_ablation_hook() -> str | None:
    from glm53_overlay.ablation.settings import parse_ablation_settings

    # Bad settings raise here, so every vLLM process refuses to start instead of serving unablated.
    settings = parse_ablation_settings(os.environ)
    if not settings.enabled:
        _logger.info("glm53_overlay: ablation off (glm53_ablation_enabled is 0)")
        return None
    from glm53_overlay.ablation.hook import install_ablation_hook

    install_ablation_hook(settings)
    return f"ablation:{settings.method}"


def register_nope_mla_padding() -> str | None:
    # vLLM's MLA kernels are 512 + 64 wide; GLM-5.3 Flash's MLA has no rope part (see glm53_overlay.nope).
    try:
        from glm53_overlay.nope.patch import install_nope_padding
    except ImportError as exc:
        _logger.warning("glm53_overlay: NoPE MLA padding not installed, this vLLM lacks %s", exc)
        return None
    return install_nope_padding()


def register_spec_decode_glue() -> str | None:
    # GLM glue for vLLM's DFlash2 drafter, only the pieces this vLLM lacks (see glm53_overlay.spec).
    from glm53_overlay.spec import install_spec_glue

    installed = install_spec_glue()
    return f"spec:{'+'.join(installed)}" if installed else None


def register_sm12x_fixes() -> str | None:
    # The recipe's GB10 fixes our vLLM still needs, only on SM12x devices (see glm53_overlay.sm12x).
    from glm53_overlay.sm12x import APPLIED, PENDING, device_capability, install_fixes

    install = find_vllm()
    if install is None:
        return None
    active = [s.name for s in install_fixes(install, device_capability()) if s.state in (APPLIED, PENDING)]
    return f"sm12x:{'+'.join(active)}" if active else None


# Each registrar returns the name of what it registered, or None when it skipped (and logged why).
REGISTRARS: tuple[Callable[[], str | None], ...] = (
    register_exl3_quantization, register_ablation_hook, register_nope_mla_padding, register_spec_decode_glue,
    register_sm12x_fixes,
)


def register_all() -> list[str]:
    install = find_vllm()
    if install is None:
        _logger.warning("glm53_overlay: no vLLM distribution found; nothing registered")
        return []
    if not install.supported:
        _logger.warning(
            "glm53_overlay: %s %s is older than %s; nothing registered",
            install.distribution, install.version, ".".join(map(str, MIN_VLLM)),
        )
        return []
    return [name for registrar in REGISTRARS if (name := registrar()) is not None]
