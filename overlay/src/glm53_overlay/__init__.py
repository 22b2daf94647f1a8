"""vLLM plugin for GLM-5.3 Flash EXL3 serving.

vLLM calls `register()` once in every process it starts (API server, engine core, workers), so it
must stay cheap and idempotent; everything heavy is imported inside it.
"""

from __future__ import annotations

import logging

__all__ = ["register"]

# Under the "vllm." namespace so the lines appear in vLLM's own log output.
_logger = logging.getLogger(f"vllm.{__name__}")
_registered: list[str] | None = None


def register() -> list[str]:
    """Register this package's vLLM extensions; returns what was registered (same list on repeat calls)."""
    global _registered
    if _registered is None:
        from glm53_overlay.registration import register_all

        _registered = register_all()
        _logger.info("glm53_overlay registered: %s", ", ".join(_registered) or "nothing")
    return _registered
