"""transformers as the reference engine for the tiny NoPE GLM (BF16 checkpoints: it cannot read EXL3).

transformers' Glm4MoeLite applies its interleaved rotary embedding even when the rope part has width 0
and fails; NoPE means that rotation is the identity, which `nope_rotary` makes it for width-0 inputs.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def nope_rotary() -> Iterator[None]:
    import transformers.models.glm4_moe_lite.modeling_glm4_moe_lite as glm

    rotate = glm.apply_rotary_pos_emb_interleave

    def rotary(q: Any, k: Any, *args: Any, **kwargs: Any) -> Any:
        return (q, k) if q.shape[-1] == 0 else rotate(q, k, *args, **kwargs)

    glm.apply_rotary_pos_emb_interleave = rotary
    try:
        yield
    finally:
        glm.apply_rotary_pos_emb_interleave = rotate
