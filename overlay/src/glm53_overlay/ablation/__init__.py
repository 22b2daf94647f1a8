"""Refusal-direction ablation applied to the target model's `o_proj` weights at load time.

Only the pure math is exported here; the vLLM hook lives in `hook.py` and is imported by the
registrar alone, so importing this package never pulls in vLLM.
"""

from __future__ import annotations

from glm53_overlay.ablation.projection import direction_residual, project_out

__all__ = ["direction_residual", "project_out"]
